"""A small but real PyTorch DistributedDataParallel training job, instrumented for stragglers.

Launched by srun (one process per task): rank and world size come from Slurm, the rendezvous
is the job's first node. Every step's compute and all-reduce wait go to Redis through
StepReporter + the DDP integration; a checkpoint is written every --ckpt-every steps to a
shared directory and reported as an event, and a restarted job (Slurm requeue) resumes from the
last checkpoint. gloo on CPU, NCCL when CUDA is available.

    srun python examples/ddp_train.py --steps 300 --ckpt-dir /shared/ckpt
"""

from __future__ import annotations

import time

import _launch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin import StepReporter
from slurm_plugin.telemetry.torch import attach


def _model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def main() -> None:
    args = _launch.arguments(__doc__, batch=256, width=1024).parse_args()
    torch.set_num_threads(1)
    rank, world, device = _launch.init()
    torch.manual_seed(1234 + rank)
    model = DistributedDataParallel(_model(args.width).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = args.ckpt_dir / "last.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from checkpoint at step {start}", flush=True)
    reporter = StepReporter.from_env()
    timer = attach(model, reporter, start_step=start)
    loss_fn = nn.CrossEntropyLoss()
    began = time.time()
    for step in range(start, args.steps):
        x = torch.randn(args.batch, 256, device=device)
        y = torch.randint(0, 10, (args.batch,), device=device)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % args.ckpt_every == 0:
            if rank == 0:
                reporter.event("checkpoint_begin", step=step + 1)
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                tmp = ckpt.with_suffix(".tmp")
                torch.save(
                    {
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step + 1,
                    },
                    tmp,
                )
                tmp.replace(ckpt)
                reporter.event("checkpoint_end", step=step + 1)
            dist.barrier()
    timer.finish()
    reporter.close()
    if rank == 0:
        print(
            f"done: steps {start}..{args.steps} on {world} ranks in {time.time() - began:.1f} s",
            flush=True,
        )
        (args.ckpt_dir / "done").write_text(f"{args.steps}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
