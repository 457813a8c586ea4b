"""One rank of a real gloo DDP job, instrumented with StepReporter (run by the DDP test).

Usage: python -m tests.integration._ddp_worker STEPS SLOW_RANK SLOW_S; rank, world size and
rendezvous come from SLURM_PROCID / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin import StepReporter
from slurm_plugin.telemetry.torch import attach


class _Net(nn.Module):
    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
        self.slow_s = slow_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_s:
            time.sleep(self.slow_s)  # the artificial straggler: slow local compute
        out: torch.Tensor = self.body(x)
        return out


def main() -> None:
    steps, slow_rank, slow_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    rank = int(os.environ["SLURM_PROCID"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    model = DistributedDataParallel(_Net(slow_s if rank == slow_rank else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with StepReporter.from_env() as reporter:
        timer = attach(model, reporter)
        for _ in range(steps):
            x = torch.randn(32, 64)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            model(torch.randn(4, 64))  # an evaluation pass must not count as a step
        timer.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
