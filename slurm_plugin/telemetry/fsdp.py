"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and FSDP1: compute against collective wait.

``attach(model)`` instruments the process (:mod:`slurm_plugin.telemetry.instrument`): each
optimizer step is a step, the rank's waits in FSDP's all-gathers and reduce-scatters (and any
other collective) are its ``comm_s``. With gradient accumulation a step is one optimizer step.
The rank's peer group comes from the model's device mesh: on an HSDP or 2-D mesh, ranks that
differ only in their data-parallel coordinates are peers (``group_from_mesh``). Each completed
``torch.distributed.checkpoint.save`` is reported as the job's checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from slurm_plugin.telemetry.checkpoints import report_dcp_saves
from slurm_plugin.telemetry.instrument import Instrumentation, instrument
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.telemetry.torch import group_from_mesh


def mesh_of(model: nn.Module) -> Any:
    """The device mesh the model is sharded on (its first DTensor parameter's), or None."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh
    return None


def attach(
    model: nn.Module | None = None,
    reporter: StepReporter | None = None,
    *,
    mesh: Any = None,
    start_step: int = 0,
) -> Instrumentation:
    """Instrument an FSDP job; ``reporter`` defaults to ``StepReporter.from_env()``.

    Call it once the model is sharded (and resumed: ``start_step`` is the step it resumes
    at); ``mesh`` overrides the model's own. ``finish()`` on the result after training
    reports the last steps.
    """
    if mesh is None and model is not None:
        mesh = mesh_of(model)
    group = group_from_mesh(mesh) if mesh is not None else ""
    inst = instrument(reporter, start_step=start_step, group=group)
    report_dcp_saves(dcp)  # FSDP's checkpoints: each completed dcp.save is one
    return inst


__all__ = ["attach", "mesh_of"]
