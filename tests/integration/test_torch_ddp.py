"""A real 4-rank gloo DDP job: the slowed rank reports high compute and low wait."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from tests.integration.conftest import free_port

#: A real training job whose timings are asserted: run with nothing beside it.
pytestmark = pytest.mark.alone


pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

REPO = Path(__file__).resolve().parents[2]


def test_slow_rank_shows_high_compute_and_low_wait(redis_url: str) -> None:
    """Rank 2 sleeps 40 ms per forward: its compute is the highest and its wait the lowest."""
    world, steps, slow_rank = 4, 25, 2
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "SLURM_JOB_ID": "4242",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURMD_NODENAME": f"node{rank + 1}",
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "STRAGGLER_REDIS_URL": redis_url,
            "STRAGGLER_TELEMETRY_FLUSH_INTERVAL_S": "0.2",
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.integration._ddp_worker",
                    str(steps),
                    str(slow_rank),
                    "0.04",
                ],
                cwd=REPO,
                env=env,
            )
        )
    for proc in procs:
        assert proc.wait(timeout=180) == 0

    records = list(TelemetryStore(connect(redis_url)).iter_steps("4242"))
    by_rank = {r: [x for x in records if x.rank == r] for r in range(world)}
    for rank, recs in by_rank.items():
        assert [x.step for x in recs] == list(range(steps)), f"rank {rank} steps"
        assert recs[0].node == f"node{rank + 1}"

    def median(rank: int, attr: str) -> float:
        values = [getattr(x, attr) for x in by_rank[rank][3:]]  # skip the gloo warm-up
        return float(statistics.median(values))

    slow_compute, slow_wait = median(slow_rank, "compute_s"), median(slow_rank, "comm_s")
    for rank in range(world):
        if rank == slow_rank:
            continue
        assert slow_compute > median(rank, "compute_s") + 0.025
        assert slow_wait < median(rank, "comm_s") - 0.02
    # Synchronous training: every rank's step time is about the same.
    step_medians = [median(r, "step_s") for r in range(world)]
    assert max(step_medians) - min(step_medians) < 0.02
