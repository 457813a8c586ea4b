"""CUDA-event timing on a real GPU: the rank slowed by extra GPU work is found from its
compute, under DDP, FSDP2 and the code-free mode (marker gpu; skipped without CUDA)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_plugin.devcluster.cluster import AUTOLOAD_DIR
from tests.integration.conftest import free_port

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
STEPS = 60


def _run(mode: str, out: Path, extra_env: dict[str, str] | None = None) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **(extra_env or {}),
        }
        argv = [sys.executable, "-m", "tests.gpu._cuda_worker", mode, str(STEPS), str(out)]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=240) == 0


def _check(steps: dict[int, list[tuple[float, float]]], what: str) -> None:
    """rank -> [(compute_s, comm_s)]: rank 1 computes longer and waits less than rank 0."""
    med = {
        r: (statistics.median(c for c, _ in v[5:]), statistics.median(w for _, w in v[5:]))
        for r, v in steps.items()
    }
    print(f"FIGURES {what}: compute/wait ms rank0 {med[0]}, rank1 {med[1]}")  # noqa: T201
    assert med[1][0] > 1.3 * med[0][0], med
    assert med[1][1] < med[0][1], med


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_the_rank_slowed_by_gpu_work_is_found_from_its_compute(mode: str, tmp_path: Path) -> None:
    _run(mode, tmp_path)
    steps = {}
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(rows) >= STEPS - 2
        steps[rank] = [(float(r[2]), float(r[3])) for r in rows]
    _check(steps, mode)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_code_free_mode_times_an_unmodified_fsdp2_job(tmp_path: Path, redis_server: str) -> None:
    from slurm_plugin.store.telemetry_store import TelemetryStore, connect  # noqa: PLC0415

    env = {
        "PYTHONPATH": f"{AUTOLOAD_DIR}{os.pathsep}{REPO}",
        "STRAGGLER_AUTO": "1",
        "SLURM_JOB_ID": "7001",
        "STRAGGLER_REDIS_URL": redis_server,
        "STRAGGLER_TELEMETRY_FLUSH_INTERVAL_S": "0.2",
    }
    _run("code-free", tmp_path, env)
    records = list(TelemetryStore(connect(redis_server)).iter_steps("7001"))
    steps = {
        r: [(float(x.compute_s or 0.0), float(x.comm_s or 0.0)) for x in records if x.rank == r]
        for r in (0, 1)
    }
    assert all(len(v) >= STEPS - 2 for v in steps.values())
    _check(steps, "code-free")
