"""The code-free mode on real processes: a job's unmodified PyTorch script reports through the
``sitecustomize`` the SPANK plugin puts on its path, to the real Redis; and it never changes
what the job does otherwise."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_plugin.devcluster.cluster import AUTOLOAD_DIR
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from tests.integration.conftest import free_port

#: A real training job whose timings are asserted: run with nothing beside it.
pytestmark = pytest.mark.alone


pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

REPO = Path(__file__).resolve().parents[2]

#: A training script with no slurm-straggler code: a gloo all-reduce per step, a DCP
#: checkpoint every 5 steps; rank SLOW computes 30 ms longer per step.
SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

steps, slow, ckpt, collective = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
rank = int(os.environ["SLURM_PROCID"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["SLURM_NTASKS"]))
model = nn.Linear(64, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    model(torch.randn(16, 64)).pow(2).mean().backward()
    if rank == slow:
        time.sleep(0.03)
    if collective == "yes":
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    if (step + 1) % 5 == 0 and collective == "yes":
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{ckpt}/step-{step + 1}")
print("torch" in sys.modules, "trained", flush=True)
dist.destroy_process_group()
"""


def _run(
    tmp_path: Path,
    redis_url: str,
    *,
    world: int = 2,
    steps: int = 25,
    slow: int = 1,
    collective: bool = True,
    auto: str = "1",
    python_path: tuple[Path, ...] = (AUTOLOAD_DIR,),
    code: str | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT if code is None else code)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PYTHONPATH": os.pathsep.join(str(p) for p in python_path),
            "STRAGGLER_AUTO": auto,
            "SLURM_JOB_ID": "9191",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURMD_NODENAME": f"node{rank + 1}",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "STRAGGLER_REDIS_URL": redis_url,
            "STRAGGLER_TELEMETRY_FLUSH_INTERVAL_S": "0.2",
        }
        argv = [sys.executable, str(script), str(steps), str(slow), str(tmp_path / "ckpt")]
        procs.append(
            subprocess.Popen(
                [*argv, "yes" if collective else "no"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    done = []
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
        assert proc.returncode == 0, out
    return done


def test_an_unmodified_job_reports_compute_wait_and_checkpoints(
    tmp_path: Path, redis_url: str
) -> None:
    runs = _run(tmp_path, redis_url)
    assert all("True trained" in r.stdout for r in runs)
    store = TelemetryStore(connect(redis_url))
    records = list(store.iter_steps("9191"))
    by_rank = {r: [x for x in records if x.rank == r] for r in (0, 1)}
    for rank, recs in by_rank.items():
        # The first optimizer step starts the clock: steps 1..24 of 0..24 are timed.
        assert [x.step for x in recs] == list(range(1, 25)), rank
        assert all(x.compute_s is not None and x.comm_s is not None for x in recs)

    def median(rank: int, attr: str) -> float:
        return float(statistics.median(getattr(x, attr) for x in by_rank[rank][3:]))

    assert median(1, "compute_s") > median(0, "compute_s") + 0.02
    assert median(1, "comm_s") < median(0, "comm_s") - 0.02
    events, _, bad = store.read_events("9191")
    assert bad == 0
    saved = [(e["name"], e["step"], e["rank"]) for e in events]
    assert saved == [("checkpoint_end", n, 0) for n in (5, 10, 15, 20, 25)]


def test_a_job_without_collectives_reports_step_times_and_says_so_once(
    tmp_path: Path, redis_url: str
) -> None:
    (run,) = _run(tmp_path, redis_url, world=1, steps=30, slow=-1, collective=False)
    assert run.stdout.count("telemetry.step_times_only") == 1, run.stdout
    records = list(TelemetryStore(connect(redis_url)).iter_steps("9191"))
    assert len(records) == 29
    assert all(x.compute_s is None and x.comm_s is None for x in records)


def test_off_reports_nothing(tmp_path: Path, redis_url: str) -> None:
    _run(tmp_path, redis_url, auto="0", steps=8)
    assert list(TelemetryStore(connect(redis_url)).iter_steps("9191")) == []


def test_the_jobs_own_sitecustomize_still_runs_and_torch_is_not_imported(
    tmp_path: Path, redis_url: str
) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(
        "import pathlib\npathlib.Path('own-sitecustomize-ran').write_text('yes')\n"
    )
    code = "import sys\nprint('torch' in sys.modules, 'plain job', flush=True)\n"
    (run,) = _run(tmp_path, redis_url, world=1, python_path=(AUTOLOAD_DIR, own), code=code)
    assert run.stdout.strip() == "False plain job"  # no torch imported on its behalf
    assert (tmp_path / "own-sitecustomize-ran").read_text() == "yes"


def test_a_job_whose_python_lacks_slurm_straggler_runs_unchanged(
    tmp_path: Path, redis_url: str
) -> None:
    shadow = tmp_path / "shadow" / "slurm_plugin"  # what a job's own venv without us looks like
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named slurm_plugin')\n")
    runs = _run(tmp_path, redis_url, steps=6, python_path=(AUTOLOAD_DIR, shadow.parent))
    for run in runs:
        assert "True trained" in run.stdout
        assert run.stdout.count("code-free telemetry is off in this Python") == 1
    assert list(TelemetryStore(connect(redis_url)).iter_steps("9191")) == []


def test_a_job_that_uses_the_explicit_api_is_instrumented_once(
    tmp_path: Path, redis_url: str
) -> None:
    """The DDP test's worker (StepReporter + attach) under the code-free mode: each step of
    each rank is reported once, by the explicit reporter."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": f"{AUTOLOAD_DIR}{os.pathsep}{REPO}",
            "STRAGGLER_AUTO": "1",
            "SLURM_JOB_ID": "9192",
            "SLURM_PROCID": str(rank),
            "SLURMD_NODENAME": f"node{rank + 1}",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "STRAGGLER_REDIS_URL": redis_url,
            "STRAGGLER_TELEMETRY_FLUSH_INTERVAL_S": "0.2",
        }
        argv = [sys.executable, "-m", "tests.integration._ddp_worker", "12", "1", "0.01"]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=180) == 0
    records = list(TelemetryStore(connect(redis_url)).iter_steps("9192"))
    for rank in (0, 1):
        assert sorted(x.step for x in records if x.rank == rank) == list(range(12))
