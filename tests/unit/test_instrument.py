"""The PyTorch instrumentation in one process: steps from the optimizer, waits from c10d, DDP
timed as built and once, and never an exception into training.

A real single-rank gloo process group (in-process store): every collective goes through the
real ``Work.wait`` the timer times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

import torch
import torch.distributed as dist
from structlog.testing import capture_logs
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin.telemetry import instrument as instrument_module
from slurm_plugin.telemetry import waits
from slurm_plugin.telemetry.instrument import instrument
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.telemetry.torch import attach
from slurm_plugin.telemetry.waits import NO_WAIT_STEPS, CollectiveTimer
from slurm_plugin.testing import RecordingReporter


def _as_reporter(captured: RecordingReporter) -> StepReporter:
    return cast("StepReporter", captured)


@pytest.fixture(autouse=True)
def fresh_process() -> Iterator[None]:
    """Each test starts uninstrumented (the hooks stay installed: they pass through)."""
    yield
    instrument_module._current = None
    waits.process.timer = None
    waits.process.failed = False
    waits.process.ddp_timing = False


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, **kw: Any) -> None:
    compute_s, collective = kw.get("compute_s", 0.0), kw.get("collective", True)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        time.sleep(compute_s)
        if collective:
            dist.all_reduce(torch.ones(1))
        optimizer.step()
        optimizer.zero_grad()


def test_steps_end_at_the_optimizer_and_the_waits_are_the_collectives(group: None) -> None:
    rep = RecordingReporter()
    instrument(_as_reporter(rep), start_step=100)
    model = nn.Linear(8, 2)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 6, compute_s=0.02)
    # The first optimizer step completes step 100 and starts the clock: 101..105 reported.
    assert [s[0] for s in rep.steps] == [101, 102, 103, 104, 105]
    for _, step_s, compute_s, comm_s in rep.steps:
        assert compute_s is not None
        assert comm_s is not None
        assert step_s >= 0.02
        assert comm_s > 0  # the all_reduce went through the timed Work.wait
        assert compute_s == pytest.approx(step_s - comm_s)
        assert compute_s >= 0.02


def test_the_timer_adds_the_waits_of_a_step_and_reports_it_once_closed() -> None:
    rep = RecordingReporter()
    timer = CollectiveTimer(_as_reporter(rep), start_step=0)
    optimizer = object()
    timer.optimizer_stepped(optimizer)
    timer.add_wait(10.0, 10.25)
    timer.add_wait(11.0, 11.5)
    assert rep.steps == []  # still in progress
    time.sleep(0.8)
    timer.optimizer_stepped(optimizer)
    (step, step_s, compute_s, comm_s) = rep.steps[0]
    assert step == 1
    assert comm_s == pytest.approx(0.75)
    assert compute_s == pytest.approx(step_s - 0.75)
    timer.add_wait(0.0, 100.0)  # a wait longer than its step (clock skew) is the whole step
    timer.optimizer_stepped(optimizer)
    assert rep.steps[1][2] == 0.0


def test_a_second_optimizer_and_other_threads_are_not_the_steps(group: None) -> None:
    rep = RecordingReporter()
    instrument(_as_reporter(rep))
    gen, disc = nn.Linear(8, 2), nn.Linear(8, 2)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    for _ in range(4):
        for model, opt in ((gen, opt_g), (disc, opt_d)):  # a GAN's two optimizers
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        waiter = threading.Thread(target=lambda: [dist.barrier() for _ in range(3)])
        waiter.start()  # an async checkpointer's barrier: another thread's wait
        waiter.join()
    assert [s[0] for s in rep.steps] == [1, 2, 3]
    assert all(s[3] is None for s in rep.steps)  # the other thread's waits are not its


def test_a_job_without_collectives_reports_step_times_and_says_so_once(group: None) -> None:
    rep = RecordingReporter()
    instrument(_as_reporter(rep))
    model = nn.Linear(8, 2)
    with capture_logs() as logs:
        _train(
            model, torch.optim.SGD(model.parameters(), lr=0.1), NO_WAIT_STEPS + 5, collective=False
        )
    assert len(rep.steps) == NO_WAIT_STEPS + 4
    assert all(s[2] is None and s[3] is None for s in rep.steps)
    said = [x for x in logs if x["event"] == "telemetry.step_times_only"]
    assert len(said) == 1


def test_code_free_mode_waits_for_torch_distributed() -> None:
    rep = RecordingReporter()  # before init_process_group: a single-process helper is not a rank
    inst = instrument(_as_reporter(rep), distributed_only=True)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, 3, collective=False)
    assert inst.timer is None
    assert rep.steps == []
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        _train(model, opt, 3)
    finally:
        dist.destroy_process_group()
    assert [s[0] for s in rep.steps] == [1, 2]


def test_a_broken_reporter_never_reaches_training(group: None) -> None:
    instrument(_as_reporter(RecordingReporter(fail=True)))
    model = nn.Linear(8, 2)
    with capture_logs() as logs:
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 5)  # must not raise
    assert waits.process.failed
    assert waits.process.timer is None
    assert [x["event"] for x in logs].count("telemetry.hook_failed") == 1


def test_a_ddp_model_is_timed_as_built_once_and_keeps_the_jobs_own_hook(group: None) -> None:
    auto, explicit = RecordingReporter(), RecordingReporter()
    instrument(_as_reporter(auto), distributed_only=True)  # the code-free mode
    model = DistributedDataParallel(nn.Linear(8, 2))
    calls = []

    def own_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        calls.append(state)
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook("state", own_hook)
    timer = attach(model, _as_reporter(explicit), start_step=7)  # and the explicit API
    assert timer is getattr(model, "_straggler_timer", None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, 5, compute_s=0.01, collective=False)
    timer.finish()
    assert calls
    assert set(calls) == {"state"}
    assert auto.steps == []  # the explicit reporter took over
    assert [s[0] for s in explicit.steps] == [7, 8, 9, 10, 11]  # each step once
    assert all(s[2] is not None and s[3] is not None for s in explicit.steps)


def test_gradient_accumulation_is_one_step_and_fsdp_attach_labels_from_the_mesh(
    group: None,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from slurm_plugin.telemetry import fsdp  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    model = nn.Linear(8, 2)
    sharded = fully_shard(model, mesh=mesh["dp_shard"])
    rep = RecordingReporter()
    fsdp.attach(model, _as_reporter(rep), mesh=mesh)
    assert rep.group == "tp=0"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        for micro in range(3):  # three micro-batches, one optimizer step
            sharded.set_requires_gradient_sync(micro == 2)
            model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert [s[0] for s in rep.steps] == [1, 2, 3]


def test_ddp_gradient_accumulation_with_no_sync_is_one_step(group: None) -> None:
    model = DistributedDataParallel(nn.Linear(8, 2))
    rep = RecordingReporter()
    timer = attach(model, _as_reporter(rep))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        for micro in range(3):
            if micro < 2:
                with model.no_sync():
                    model(torch.randn(4, 8)).pow(2).mean().backward()
            else:
                model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    timer.finish()
    assert [s[0] for s in rep.steps] == [0, 1, 2, 3]
    assert all(s[2] is not None and s[3] is not None for s in rep.steps)


@pytest.fixture
def meshes_labelled() -> Iterator[Any]:
    """``init_device_mesh`` as the code-free mode leaves it once torch is imported (its
    ``torch.save`` too); the originals restored after."""
    from torch.distributed import device_mesh  # noqa: PLC0415

    from slurm_plugin.telemetry import auto  # noqa: PLC0415

    module_original, save = device_mesh.init_device_mesh, torch.save
    package_original = getattr(dist, "init_device_mesh", None)
    auto._torch_loaded(torch)
    assert getattr(device_mesh.init_device_mesh, "__straggler__", False)
    yield device_mesh.init_device_mesh
    device_mesh.init_device_mesh = module_original
    torch.save = save
    if package_original is not None:
        dist.init_device_mesh = package_original  # type: ignore[attr-defined]


def test_code_free_mode_labels_a_rank_by_its_device_mesh(group: None, meshes_labelled: Any) -> None:
    """Issue 36, class 6: a pipeline job's mesh says which stage a rank runs, with no change
    to the job: the first mesh with a dimension that is not data parallel labels the rank
    (a pure data-parallel mesh before it says nothing); the mesh is the job's, untouched."""
    rep = RecordingReporter()
    inst = instrument(_as_reporter(rep), distributed_only=True)
    flat = meshes_labelled("cpu", (1,), mesh_dim_names=("dp",))
    assert rep.group == ""
    mesh = meshes_labelled("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    assert rep.group == "pp=0"
    assert (mesh.mesh_dim_names, flat.mesh_dim_names) == (("dp", "pp"), ("dp",))
    meshes_labelled("cpu", (1, 1), mesh_dim_names=("dp", "tp"))  # later meshes change nothing
    assert (rep.group, inst.mesh_group) == ("pp=0", "pp=0")
    if hasattr(dist, "init_device_mesh"):  # the re-export is the same function
        assert dist.init_device_mesh is meshes_labelled


def test_a_label_the_job_gave_wins_and_a_failing_label_never_breaks_the_mesh(
    group: None, meshes_labelled: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rep = RecordingReporter()
    rep.group = "stage1"  # STRAGGLER_GROUP, or StepReporter(group=...)
    instrument(_as_reporter(rep), distributed_only=True)
    meshes_labelled("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    assert rep.group == "stage1"

    def broken(self: Any, mesh: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(instrument_module.Instrumentation, "mesh_built", broken)
    with capture_logs() as logs:
        mesh = meshes_labelled("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    assert mesh.mesh_dim_names == ("dp", "pp")
    assert [e["where"] for e in logs if e["event"] == "telemetry.hook_failed"] == [
        "device mesh built"
    ]
