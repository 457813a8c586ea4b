"""An FSDP2 training job with no slurm-straggler code in it: the code-free mode's example.

``fully_shard`` on every layer and on the model, AdamW, a DCP checkpoint (sharded, every rank
writes its part) every --ckpt-every steps to a shared directory, and a restarted job (Slurm
requeue) resumes from the last one. Submitted with ``--straggler-telemetry=auto``, every
rank reports its compute and its wait in FSDP2's all-gathers and reduce-scatters, and each
checkpoint, without a line of our code. gloo on CPU, NCCL when CUDA is available.

    srun python examples/fsdp2_plain.py --steps 300 --ckpt-dir /shared/ckpt
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import _launch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def build(width: int, depth: int, device: torch.device) -> nn.Module:
    """A stack of linear layers, each its own FSDP2 unit."""
    layers = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _resume(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: Path) -> int:
    last = ckpt_dir / "last"
    if not last.exists():
        return 0
    step = int(last.read_text())
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(ckpt_dir / f"step-{step}"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return step


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: Path, step: int) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state}, checkpoint_id=str(ckpt_dir / f"step-{step}")
    )
    if dist.get_rank() == 0:
        tmp = ckpt_dir / "last.tmp"
        tmp.write_text(f"{step}\n")
        tmp.replace(ckpt_dir / "last")


def main(on_model: Callable[[nn.Module, int], object] | None = None) -> None:
    """Train; ``on_model(model, start_step)`` is called once the model is sharded and resumed
    (``fsdp2_train.py`` instruments it there)."""
    parser = _launch.arguments(__doc__, batch=512, width=512)
    parser.add_argument("--depth", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world, device = _launch.init()
    torch.manual_seed(1234)
    model = build(args.width, args.depth, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = _resume(model, optimizer, args.ckpt_dir)
    if rank == 0 and start:
        print(f"resumed from checkpoint at step {start}", flush=True)
    if on_model is not None:
        on_model(model, start)
    began = time.time()
    torch.manual_seed(1234 + rank)
    for step in range(start, args.steps):
        x = torch.randn(args.batch, 256, device=device)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.ckpt_every == 0:
            _save(model, optimizer, args.ckpt_dir, step + 1)
    if rank == 0:
        print(f"done: steps {start}..{args.steps} on {world} ranks in {time.time() - began:.1f} s")
        (args.ckpt_dir / "done").write_text(f"{args.steps}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
