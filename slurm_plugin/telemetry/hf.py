"""Hugging Face ``Trainer`` and Accelerate: every rank reports compute and collective wait.

``Trainer(..., callbacks=[StragglerCallback()])``: the callback instruments the process when
it is built, before the Trainer wraps the model (Accelerate builds the DDP model inside
``train()``, and callbacks are never handed the wrapped one), so the DDP model is timed as it
is built; FSDP and DeepSpeed ranks are timed by their waits in the
collectives. Each checkpoint the Trainer writes is reported once written (``on_save``).

With Accelerate alone: ``attach_accelerator(accelerator)`` before or after
``accelerator.prepare(...)``.

Needs the ``hf`` extra: ``pip install 'slurm-straggler[hf]'``.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from slurm_plugin.telemetry import checkpoints
from slurm_plugin.telemetry.instrument import Instrumentation, instrument
from slurm_plugin.telemetry.reporter import StepReporter


class StragglerCallback(TrainerCallback):
    """Reports every rank's step, compute and collective wait, and the Trainer's checkpoints."""

    def __init__(self, reporter: StepReporter | None = None) -> None:
        self.instrumentation = instrument(reporter)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.instrumentation.adopt(None, state.global_step, "")  # resumed from a checkpoint

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        checkpoints.saved(state.global_step)  # reported by global rank 0 alone

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.instrumentation.finish()
        self.instrumentation.reporter.flush()


def attach_accelerator(
    accelerator: Any, reporter: StepReporter | None = None, *, start_step: int = 0
) -> Instrumentation:
    """Instrument an Accelerate job: models it prepared already are timed now, the ones it
    prepares later as they are built."""
    inst = instrument(reporter, start_step=start_step)
    for model in getattr(accelerator, "_models", ()):
        if isinstance(model, DistributedDataParallel):
            inst.ddp_built(model)
    return inst


__all__ = ["StragglerCallback", "attach_accelerator"]
