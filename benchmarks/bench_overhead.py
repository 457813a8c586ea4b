"""What the PyTorch integrations cost a training step, on a small CPU model.

Per integration, the same single-process job (gloo, world size 1: the hooks run, the
collectives are trivial) with and without it, each in its own process and alternated
``--rounds`` times; per-step wall time, median and p99 over every timed step (the first
``WARMUP`` of each run left out). Two models: ``tiny`` (an MLP of width 512, batch 64:
~2 ms steps, where a fixed cost per step shows most) and ``small`` (the demo's: width 1,024,
batch 256; the Hugging Face rows are a 2-layer GPT-2 at n_embd 64 and 256). The reporter is
the real one, publishing to ``$STRAGGLER_REDIS_URL`` (its keys expire a minute after the
run; no database is flushed). Also ``record()``'s cost on the training thread. Run with the
dev cluster up:
``python -m benchmarks.bench_overhead``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import machine, redis_url, table

REPO = Path(__file__).resolve().parents[1]
AUTOLOAD = REPO / "slurm_plugin" / "telemetry" / "autoload"
WARMUP = 30
STACKS = ("ddp", "fsdp2", "code-free", "lightning", "hf-trainer")


# -- one run (a child process) ---------------------------------------------------------------
#: model -> (width, batch)
MODELS = {"tiny": (512, 64), "small": (1024, 256)}


def _model(width: int) -> Any:
    from torch import nn  # noqa: PLC0415 - the parent process never imports torch

    return nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _torch_loop(stack: str, on: bool, steps: int, size: str) -> list[float]:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch._C._distributed_c10d import HashStore  # noqa: PLC0415

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    width, batch = MODELS[size]
    model = _model(width)
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

        model = DistributedDataParallel(model)
        if on:
            from slurm_plugin import StepReporter  # noqa: PLC0415
            from slurm_plugin.telemetry.torch import attach  # noqa: PLC0415

            attach(model, StepReporter.from_env())
    else:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        if on and stack == "fsdp2":
            from slurm_plugin.telemetry import fsdp  # noqa: PLC0415

            fsdp.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = model(torch.randn(batch, 256)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return times


def _lightning_loop(on: bool, steps: int, size: str) -> list[float]:
    import lightning.pytorch as pl  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    from slurm_plugin.telemetry.lightning import StragglerCallback  # noqa: PLC0415

    times: list[float] = []
    width, batch = MODELS[size]

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(width)

        def training_step(self, batch: Any, _idx: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(pl.Callback):
        last = 0.0

        def on_train_batch_end(self, *_args: Any) -> None:
            now = time.perf_counter()
            if self.last:
                times.append(now - self.last)
            self.last = now

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp",
        max_steps=steps,
        callbacks=[Clock(), *([StragglerCallback()] if on else [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = TensorDataset(torch.randn(steps * batch, 256))
    trainer.fit(Net(), DataLoader(data, batch_size=batch))
    return times


def _hf_loop(on: bool, steps: int, size: str, work: Path) -> list[float]:
    import torch  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from slurm_plugin.telemetry.hf import StragglerCallback  # noqa: PLC0415

    times: list[float] = []

    class Clock(TrainerCallback):
        last = 0.0

        def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
            now = time.perf_counter()
            if self.last:
                times.append(now - self.last)
            self.last = now

    ids = torch.randint(0, 256, (steps * 4, 32))
    data = [{"input_ids": x, "labels": x} for x in ids]
    embd = 64 if size == "tiny" else 256
    config = GPT2Config(n_layer=2, n_embd=embd, n_head=2, vocab_size=256, n_positions=32)
    args = TrainingArguments(
        output_dir=str(work),
        max_steps=steps,
        per_device_train_batch_size=4,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callbacks = [Clock(), *([StragglerCallback()] if on else [])]
    Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=callbacks
    ).train()
    return times


def _per_call_ns(fn: Any, calls: int = 20_000) -> float:
    best = float("inf")
    for _ in range(5):  # the best of five batches: the cost, not the machine's noise
        started = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - started) / calls)
    return best


def hook_costs() -> dict[str, float]:
    """What the hooks themselves cost, in ns: a collective's wait, an optimizer step, and a
    DDP step's forward and backward (tiny model), each without and then with the hooks."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torch._C._distributed_c10d import HashStore  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from slurm_plugin.telemetry.instrument import instrument  # noqa: PLC0415
    from slurm_plugin.telemetry.torch import attach  # noqa: PLC0415
    from slurm_plugin.testing import RecordingReporter  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    one = torch.ones(1)
    layer = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)  # no gradients: step() is bare
    plain, timed = (
        DistributedDataParallel(nn.Linear(4, 4)),
        DistributedDataParallel(nn.Linear(4, 4)),
    )
    x = torch.randn(2, 4)

    def ddp_step(model: Any) -> Any:
        return lambda: model(x).sum().backward()

    costs = {
        "collective": _per_call_ns(lambda: dist.all_reduce(one)),
        "optimizer step": _per_call_ns(optimizer.step),
        "ddp step": _per_call_ns(ddp_step(plain), 5_000),
    }
    rep: Any = RecordingReporter()
    instrument(rep)
    optimizer.step()  # the first step makes the timer (this thread)
    attach(timed, rep)
    after = {
        "collective": _per_call_ns(lambda: dist.all_reduce(one)),
        "optimizer step": _per_call_ns(optimizer.step),
        "ddp step": _per_call_ns(ddp_step(timed), 5_000),
    }
    return {k: after[k] - costs[k] for k in costs} | {f"{k} base": v for k, v in costs.items()}


def child(stack: str, on: bool, steps: int, size: str, work: Path) -> None:
    """One run: print its per-step times as JSON."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    if stack in ("ddp", "fsdp2", "code-free"):
        times = _torch_loop(stack, on, steps, size)
    elif stack == "lightning":
        times = _lightning_loop(on, steps, size)
    else:
        times = _hf_loop(on, steps, size, work)
    print(json.dumps(times[WARMUP:]))


# -- the parent ------------------------------------------------------------------------------
def _run(stack: str, on: bool, steps: int, size: str, job: str, work: Path) -> list[float]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": job,
        "SLURM_PROCID": "0",
        "SLURMD_NODENAME": "bench",
        "STRAGGLER_REDIS_URL": redis_url(),
        "STRAGGLER_AUTO": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29611",
    }
    if stack == "code-free":
        env["PYTHONPATH"] = f"{AUTOLOAD}{os.pathsep}{REPO}"
        env["STRAGGLER_AUTO"] = "1" if on else "0"
    argv = [sys.executable, "-m", "benchmarks.bench_overhead", "--child", stack]
    argv += ["--steps", str(steps), "--model", size, "--work", str(work)]
    argv += ["--on"] if on else []
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{stack} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    times: list[float] = json.loads(out.stdout.strip().splitlines()[-1])
    return times


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def _record_ns(job: str) -> float:
    os.environ.update(SLURM_JOB_ID=job, SLURM_PROCID="0", STRAGGLER_REDIS_URL=redis_url())
    from slurm_plugin import StepReporter  # noqa: PLC0415

    rep = StepReporter.from_env()
    samples = []
    for _ in range(50):
        started = time.perf_counter_ns()
        for i in range(1000):
            rep.record(i, 0.1, 0.08, 0.02)
        samples.append((time.perf_counter_ns() - started) / 1000)
    rep.close()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=330)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--model", default="tiny,small", help="tiny, small or both")
    parser.add_argument("--child")
    parser.add_argument("--on", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp"))  # noqa: S108
    args = parser.parse_args()
    if args.child == "hooks":
        print(json.dumps(hook_costs()))
        return
    if args.child:
        child(args.child, args.on, args.steps, args.model, args.work)
        return
    from slurm_plugin.store.telemetry_store import TelemetryStore, connect  # noqa: PLC0415

    job = str(900_000_000 + os.getpid())  # a job id no Slurm job of the dev cluster has
    rows = []
    try:
        for size in args.model.split(","):
            for stack in args.stacks.split(","):
                steps = args.steps if size == "tiny" else max(WARMUP + 60, args.steps // 3)
                runs: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(args.rounds):
                    for on in (False, True):
                        runs[on] += _run(stack, on, steps, size, job, args.work)
                off, on_ = runs[False], runs[True]
                med_off, med_on = statistics.median(off), statistics.median(on_)
                rows.append(
                    [
                        stack,
                        size,
                        f"{med_off * 1e3:.2f} / {_p99(off) * 1e3:.2f}",
                        f"{med_on * 1e3:.2f} / {_p99(on_) * 1e3:.2f}",
                        f"{(med_on - med_off) * 1e6:+.0f} us",
                        f"{100 * (med_on - med_off) / med_off:+.2f} %",
                        len(on_),
                    ]
                )
        record_ns = _record_ns(job)
        hooks_run = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_overhead", "--child", "hooks"],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1"},
            capture_output=True,
            text=True,
            check=True,
        )
        hooks = json.loads(hooks_run.stdout.strip().splitlines()[-1])
    finally:
        TelemetryStore(connect(redis_url())).expire_job(job, ttl_s=60)
    print(f"# PyTorch integration overhead ({machine()}, {args.rounds} rounds)\n")
    header = ["stack", "model", "step ms without (median / p99)", "with", "overhead", "%", "steps"]
    print(table(header, rows))
    print(f"\nrecord(): {record_ns:.0f} ns per call (median of 50 x 1,000)")
    print("\nThe hooks alone (best of 5 batches, ns; base: the same call without them):\n")
    what = ("collective", "optimizer step", "ddp step")
    print(
        table(
            ["call", "base ns", "added ns"],
            [[w, f"{hooks[w + ' base']:.0f}", f"{hooks[w]:+.0f}"] for w in what],
        )
    )


if __name__ == "__main__":
    main()
