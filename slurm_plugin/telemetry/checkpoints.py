"""Checkpoints as the service needs them: ``checkpoint_end`` events with the step saved.

The code-free mode reports the saves of ``torch.distributed.checkpoint`` (the way FSDP2 and
most sharded jobs save); the framework callbacks report their framework's saves.
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType
from typing import Any

import torch.distributed as dist

from slurm_plugin.telemetry import instrument


def saved(step: int | None = None) -> None:
    """Report a completed checkpoint from global rank 0 (other ranks say nothing)."""
    inst = instrument.current()
    if inst is None or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    if step is None:
        if inst.ddp is not None:
            step = inst.ddp.completed
        else:
            step = inst.timer.step if inst.timer is not None else inst.start_step
    inst.reporter.event("checkpoint_end", step=int(step))


def report_dcp_saves(module: ModuleType) -> None:
    """Wrap ``torch.distributed.checkpoint.save``: each completed save is a checkpoint."""
    original = getattr(module, "save", None)
    if original is None or getattr(original, "__straggler__", False):
        return

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        with contextlib.suppress(Exception):  # a report must never fail the save
            saved()
        return result

    save.__straggler__ = True  # type: ignore[attr-defined]
    module.save = save  # type: ignore[attr-defined]


__all__ = ["report_dcp_saves", "saved"]
