"""One rank of the GPU check's jobs: DDP or FSDP2 on CUDA, rank 1 slowed by extra GPU work.

Usage: ``python -m tests.gpu._cuda_worker MODE STEPS OUT`` (MODE: ddp, fsdp2, code-free); rank
and world size from RANK / WORLD_SIZE. NCCL when every rank has a GPU of its own, gloo when
ranks share one. ddp and fsdp2 write each rank's reported steps to OUT/rankN.json; code-free
reports through the reporter the job's environment gives (the sitecustomize on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 2048
EXTRA_MATMULS = 24  # the slow rank's extra GPU work per forward


class _Net(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
        self.slow = slow
        self.register_buffer("extra", torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            y = x
            for _ in range(EXTRA_MATMULS):
                y = y @ self.extra  # type: ignore[operator]
            x = x + 0.0 * y
        out: torch.Tensor = self.body(x)
        return out


def main() -> None:
    mode, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpus >= world else "gloo", rank=rank, world_size=world)
    model: nn.Module = _Net(slow=rank == 1).to(device)
    recorder = None
    timer: Any = None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

        from slurm_plugin.telemetry.torch import attach  # noqa: PLC0415
        from slurm_plugin.testing import RecordingReporter  # noqa: PLC0415

        model = DistributedDataParallel(model, device_ids=[device.index])
        recorder = RecordingReporter()
        timer = attach(model, recorder)  # type: ignore[arg-type]
    elif mode in ("fsdp2", "code-free"):
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for layer in model.body:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        if mode == "fsdp2":
            from slurm_plugin.telemetry import fsdp  # noqa: PLC0415
            from slurm_plugin.testing import RecordingReporter  # noqa: PLC0415

            recorder = RecordingReporter()
            timer = fsdp.attach(model, recorder)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(torch.randn(512, WIDTH, device=device)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    if recorder is not None:
        timer.finish()
        (out / f"rank{rank}.json").write_text(json.dumps(recorder.steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
