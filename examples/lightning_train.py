"""A PyTorch Lightning job (ddp strategy), instrumented with one callback.

``Trainer(callbacks=[StragglerCallback()])``: every rank reports its compute and its wait in
DDP's all-reduce, and each checkpoint. Lightning finds its place in the Slurm job itself;
``ModelCheckpoint`` writes ``last.ckpt`` every --ckpt-every steps to a shared directory and a
restarted job (Slurm requeue) resumes from it. CPU here (``--accelerator gpu`` on GPUs).

    srun python examples/lightning_train.py --steps 300 --ckpt-dir /shared/ckpt
"""

from __future__ import annotations

import os

import _launch
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from slurm_plugin.telemetry.lightning import StragglerCallback


class _Random(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        return torch.randn(256, generator=gen), torch.randint(0, 10, (), generator=gen)


class _Net(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(256, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )
        self.loss = nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = self.loss(self.net(x), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = _launch.arguments(__doc__, batch=256, width=1024)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=int(os.environ.get("SLURM_NTASKS_PER_NODE", "1")),
        num_nodes=int(os.environ.get("SLURM_JOB_NUM_NODES", "1")),
        strategy="ddp",
        max_steps=args.steps,
        callbacks=[
            StragglerCallback(),
            ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_last=True
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = args.ckpt_dir / "last.ckpt"
    if last.exists() and trainer.is_global_zero:
        print("resuming from", last, flush=True)
    trainer.fit(
        _Net(args.width),
        DataLoader(_Random(args.steps * args.batch), batch_size=args.batch),
        ckpt_path=str(last) if last.exists() else None,
    )
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps", flush=True)
        (args.ckpt_dir / "done").write_text(f"{trainer.global_step}\n")


if __name__ == "__main__":
    main()
