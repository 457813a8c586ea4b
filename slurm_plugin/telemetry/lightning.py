"""PyTorch Lightning: ``Trainer(callbacks=[StragglerCallback()])`` and every rank reports.

For the ``ddp`` strategies the DDP model Lightning builds is timed as it is built (on CPU
too, and with a ``ddp_comm_hook`` given to the strategy: the timing leaves DDP's hooks alone);
for ``fsdp`` and the model-parallel strategy, the
rank's waits in the collectives are timed (:mod:`slurm_plugin.telemetry.waits`). A step is an
optimizer step (so gradient accumulation is one step). Lightning's checkpoints are reported
as ``checkpoint_end`` events once written, so the policy can evict right after one.

Needs the ``lightning`` extra: ``pip install 'slurm-straggler[lightning]'``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin.telemetry import checkpoints
from slurm_plugin.telemetry.instrument import Instrumentation, instrument
from slurm_plugin.telemetry.reporter import StepReporter


class StragglerCallback(Callback):
    """Reports every rank's step, compute and collective wait, and the job's checkpoints."""

    def __init__(self, reporter: StepReporter | None = None) -> None:
        super().__init__()
        self._reporter = reporter
        self._inst: Instrumentation | None = None
        self._saving: int | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before the strategy wraps the model: the DDP model is timed as it is built.
        if stage == "fit":
            self._inst = instrument(self._reporter)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        inst = self._inst or instrument(self._reporter)
        self._inst = inst
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):  # wrapped before setup (a custom one)
            inst.ddp_built(model)
        inst.adopt(None, trainer.global_step, "")  # resumed from a checkpoint

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning asks for the callbacks' state before it writes the file: the checkpoint
        # counts once the next batch starts (or training ends), after the write.
        self._saving = trainer.global_step

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._saved()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saved()
        if self._inst is not None:
            self._inst.finish()
            self._inst.reporter.flush()

    def _saved(self) -> None:
        if self._saving is not None:  # reported by global rank 0 alone (checkpoints.saved)
            step, self._saving = self._saving, None
            checkpoints.saved(step)


__all__ = ["StragglerCallback"]
