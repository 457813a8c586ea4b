"""Checkpoints as the service needs them: ``checkpoint_end`` events with the step saved.

The code-free mode reports the saves of ``torch.distributed.checkpoint`` (the way FSDP2 and
most sharded jobs save), the ``torch.save`` of a training state (a model's or an optimizer's
state dict, alone or in a dict under the usual keys: plain PyTorch, Lightning's
``save_checkpoint``, HF Trainer's optimizer) and safetensors' saves of a model (HF Trainer's
weights); the framework callbacks report their framework's saves. One checkpoint per step: the
second save of a step (the model, then its optimizer) says nothing more.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from slurm_plugin.telemetry import instrument

#: Keys under which a dict saved with ``torch.save`` holds a training state: a model's
#: (``model``, ``state_dict``: Lightning), an optimizer's (``optimizer``, ``optimizer_states``:
#: Lightning; ``param_groups``: an optimizer's own state dict, HF Trainer's ``optimizer.pt``).
STATE_KEYS = frozenset(
    {
        "model",
        "model_state_dict",
        "state_dict",
        "module",
        "optimizer",
        "optimizer_state_dict",
        "optimizer_states",
        "param_groups",
    }
)

#: The instrumentation and step of the process's last reported checkpoint.
_last: list[tuple[int, int]] = []
_saving = threading.local()  # inside a save we report: its own inner saves say nothing


def saved(step: int | None = None) -> None:
    """Report a completed checkpoint from global rank 0 (other ranks say nothing), once per
    step."""
    inst = instrument.current()
    if inst is None or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    if step is None:
        if inst.ddp is not None:
            step = inst.ddp.completed
        else:
            step = inst.timer.step if inst.timer is not None else inst.start_step
    this = (id(inst), int(step))
    if this in _last:
        return
    _last[:] = [this]
    inst.reporter.event("checkpoint_end", step=int(step))


def is_training_state(obj: object) -> bool:
    """What ``torch.save`` writes at a checkpoint: a dict holding a model's or optimizer's
    state under one of :data:`STATE_KEYS`, or a model's state dict itself (tensors named
    ``weight`` / ``bias``, ``<module>.weight``...). A tensor, a batch, a config, RNG states
    are not."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    if any(isinstance(key, str) and key in STATE_KEYS for key in obj):
        return True
    return all(isinstance(v, torch.Tensor) for v in obj.values()) and any(
        isinstance(key, str) and key.rpartition(".")[2] in {"weight", "bias"} for key in obj
    )


def _reporting(original: Callable[..., Any], counts: Callable[..., bool]) -> Callable[..., Any]:
    """``original`` wrapped: a completed call that ``counts(*args, **kwargs)`` is a checkpoint
    (a failed one raises as it did, unreported); calls made inside it say nothing."""

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        if getattr(_saving, "on", False):
            return original(*args, **kwargs)
        _saving.on = True
        try:
            result = original(*args, **kwargs)
        finally:
            _saving.on = False
        with contextlib.suppress(Exception):  # a report must never fail the save
            if counts(*args, **kwargs):
                saved()
        return result

    save.__straggler__ = True  # type: ignore[attr-defined]
    return save


def _wrap(module: ModuleType, name: str, counts: Callable[..., bool]) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "__straggler__", False):
        return
    setattr(module, name, _reporting(original, counts))


def _first_is_state(obj: object = None, *_args: Any, **_kwargs: Any) -> bool:
    return is_training_state(obj)


def _always(*_args: Any, **_kwargs: Any) -> bool:
    return True


def report_torch_saves(module: ModuleType) -> None:
    """Wrap ``torch.save``: each completed save of a training state is a checkpoint."""
    _wrap(module, "save", _first_is_state)


def report_safetensors_saves(module: ModuleType) -> None:
    """Wrap ``safetensors.torch``'s ``save_file`` and ``save_model``: a model's weights
    written (HF Trainer's checkpoints) are a checkpoint."""
    _wrap(module, "save_file", _always)
    _wrap(module, "save_model", _always)


def report_dcp_saves(module: ModuleType) -> None:
    """Wrap ``torch.distributed.checkpoint.save``: each completed save is a checkpoint."""
    _wrap(module, "save", _always)


__all__ = [
    "is_training_state",
    "report_dcp_saves",
    "report_safetensors_saves",
    "report_torch_saves",
    "saved",
]
