"""Checkpoints reported without a change to the job (issue 36, class 2): a ``torch.save`` of a
training state (plain PyTorch, Lightning's ``save_checkpoint``, HF Trainer's optimizer),
safetensors' model saves and ``dcp.save``, once per step, never a save of anything else, and
never an error into the save. Real torch, real saves to files, in one process."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

import torch
from torch import nn

from slurm_plugin.telemetry import checkpoints, waits
from slurm_plugin.telemetry import instrument as instrument_module
from slurm_plugin.telemetry.checkpoints import (
    is_training_state,
    report_dcp_saves,
    report_safetensors_saves,
    report_torch_saves,
)
from slurm_plugin.telemetry.instrument import instrument
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.testing import RecordingReporter


@pytest.fixture
def rep() -> Iterator[RecordingReporter]:
    """An instrumented process (its reporter recorded) with torch.save reported; both undone
    after."""
    original = torch.save
    recorded = RecordingReporter()
    instrument(cast("StepReporter", recorded))
    report_torch_saves(torch)
    yield recorded
    torch.save = original
    instrument_module._current = None
    waits.process.timer = None
    checkpoints._last.clear()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _saved(rep: RecordingReporter) -> list[tuple[str, Any]]:
    return [(e["name"], e.get("step")) for e in rep.events]


def test_a_training_state_saved_is_a_checkpoint_once_per_step(
    rep: RecordingReporter, tmp_path: Path
) -> None:
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, 3)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}
    torch.save(state, tmp_path / "ckpt.pt")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")  # the same step: said once
    assert _saved(rep) == [("checkpoint_end", 3)]
    _train(model, optimizer, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")  # a bare state dict
    assert _saved(rep) == [("checkpoint_end", 3), ("checkpoint_end", 5)]
    assert torch.load(tmp_path / "ckpt.pt")["step"] == 3  # the save itself is untouched


def test_saves_of_anything_else_say_nothing(rep: RecordingReporter, tmp_path: Path) -> None:
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, 2)
    torch.save(torch.ones(3), tmp_path / "t.pt")
    torch.save({"x": torch.ones(2), "y": torch.zeros(2)}, tmp_path / "batch.pt")
    torch.save({"python": 1, "cpu": torch.get_rng_state()}, tmp_path / "rng.pth")
    torch.save({"lr": 0.1, "last_epoch": 3}, tmp_path / "scheduler.pt")
    torch.save([model.state_dict()], tmp_path / "list.pt")
    assert rep.events == []


def test_a_failed_save_raises_as_before_and_is_not_a_checkpoint(
    rep: RecordingReporter, tmp_path: Path
) -> None:
    model = nn.Linear(8, 2)
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.save(model.state_dict(), tmp_path / "missing" / "model.pt")
    assert rep.events == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_is_one_checkpoint_whatever_it_saves_inside(
    rep: RecordingReporter, tmp_path: Path
) -> None:
    dcp: Any = importlib.import_module("torch.distributed.checkpoint")

    original = dcp.save
    report_dcp_saves(dcp)
    try:
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, optimizer, 2)
        dcp.save({"model": model.state_dict(), "extra": {"note": "x"}}, checkpoint_id=tmp_path)
    finally:
        dcp.save = original
    assert _saved(rep) == [("checkpoint_end", 2)]


def test_safetensors_model_saves_are_checkpoints(rep: RecordingReporter, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    before = {name: getattr(safetensors, name) for name in ("save_file", "save_model")}
    report_safetensors_saves(safetensors)
    try:
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, optimizer, 2)
        safetensors.save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    finally:
        for name, function in before.items():
            setattr(safetensors, name, function)
    assert _saved(rep) == [("checkpoint_end", 2)]


def test_lightnings_save_checkpoint_is_a_checkpoint(rep: RecordingReporter, tmp_path: Path) -> None:
    """What Lightning writes (its checkpoint dict, through its own atomic save) is seen."""
    lightning = pytest.importorskip("lightning")
    cloud_io = importlib.import_module("lightning.fabric.utilities.cloud_io")
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, 2)
    assert lightning.__version__
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    cloud_io._atomic_save({**checkpoint, "epoch": 0, "global_step": 2}, tmp_path / "x.ckpt")
    assert _saved(rep) == [("checkpoint_end", 2)]


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"state_dict": {}}, True),
        ({"param_groups": [], "state": {}}, True),
        ({"fc.weight": torch.ones(1), "fc.bias": torch.ones(1)}, True),
        ({"weights": torch.ones(1)}, False),
        ({}, False),
        (None, False),
        ("model", False),
    ],
)
def test_what_counts_as_a_training_state(obj: object, expected: bool) -> None:
    assert is_training_state(obj) is expected
