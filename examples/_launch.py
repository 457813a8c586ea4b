"""How the example jobs find their place in a Slurm job, and the options they share (no
slurm-straggler code here).

``srun`` starts one process per task; torch.distributed wants RANK, WORLD_SIZE, LOCAL_RANK and
a rendezvous (MASTER_ADDR/MASTER_PORT): :func:`torch_env` derives them from Slurm's variables
(what torchrun would set), :func:`init` also initialises the process group (gloo on CPU,
NCCL when CUDA is available).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import hostlist
import torch
import torch.distributed as dist


def torch_env() -> tuple[int, int]:
    """Set torch.distributed's variables from Slurm's; returns (rank, world size). Under
    torchrun (torch elastic) its own variables stand: it sets them per worker and round."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
    world = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", "1")))
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    os.environ.setdefault(
        "MASTER_ADDR", hostlist.expand_hostlist(nodes)[0] if nodes else "127.0.0.1"
    )
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    os.environ.setdefault("MASTER_PORT", str(20000 + (job * 7 + restart) % 20000))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    return rank, world


def init() -> tuple[int, int, torch.device]:
    """Initialise the process group; returns (rank, world size, this rank's device)."""
    rank, world = torch_env()
    cuda = torch.cuda.is_available()
    device = (
        torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
        )
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, device


def arguments(description: str | None, *, batch: int, width: int) -> argparse.ArgumentParser:
    """The options every example job takes: steps, batch size, model width, checkpoints."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--ckpt-every", type=int, default=20)
    return parser
