"""Every training stack reports what finds its straggler, in process, on gloo (issue 39).

For FSDP2, PyTorch Lightning (ddp strategy) and the Hugging Face Trainer, the stack's example
job (``examples/``, unchanged) runs as four ranks on this machine, each its own "node" for
the telemetry, with a private redis-server. Once every rank has reported its first steps, the
third rank is slowed for real: the test stops and continues its process (SIGSTOP / SIGCONT),
so it keeps a tenth of the wall time, as the demo's cgroup quota gives node3. Then:

- node3's rank computes far longer than it did and than the others, and waits less than they
  do; the others wait longer than before (what :func:`check_why` asks of a cluster run);
- the detector, fed the job's records from Redis as the service reads them, names node3 and
  no other node.

The eviction itself is the same for every stack: the cluster tier evicts the demo's plain DDP
job (``test_demo``) and the code-free job (``test_stacks``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slurm_plugin.detection import Detector, StragglerEvent
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.model.records import StepRecord
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from tests.integration.conftest import RedisServer, free_port, wait_for

pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

REPO = Path(__file__).resolve().parents[2]
WORLD = 4  # the detector compares at least four ranks
SLOW = 2  # the rank on node3
#: stack -> (examples/ script, the module it needs, its options).
STACKS = {
    "fsdp2": ("fsdp2_train.py", "torch", ("--steps", "400")),
    "lightning": ("lightning_train.py", "lightning", ("--steps", "400")),
    "hf-trainer": ("hf_train.py", "transformers", ("--steps", "400")),
}
#: Steps every rank reports before node3 is slowed, then steps after.
BEFORE, AFTER = 25, 40
#: node3's process runs for this long at a time, then is stopped for nine times as long as it
#: really ran (it keeps a tenth of the wall time even when a loaded machine wakes us late).
RUN_S, STOPPED_PER_RUN = 0.005, 9


def _env(rank: int, port: int, redis_url: str) -> dict[str, str]:
    """What srun and slurmd give one task of a 4-node job (one task per node)."""
    return {
        **os.environ,
        "SLURM_JOB_ID": "777",
        "SLURM_JOB_NAME": "straggler-stack",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(rank),
        "SLURM_NTASKS": str(WORLD),
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NUM_NODES": str(WORLD),
        "SLURM_NNODES": str(WORLD),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURMD_NODENAME": f"node{rank + 1}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "STRAGGLER_REDIS_URL": redis_url,
        "STRAGGLER_TELEMETRY_FLUSH_INTERVAL_S": "0.2",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


class _Throttle(threading.Thread):
    """Stop and continue a process so that it keeps at most a tenth of the wall time, until
    stopped. The stop follows how long the process really ran: on a loaded machine this
    thread wakes late, and a fixed period would hand the process far more than a tenth."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.done = threading.Event()
        self.started_ts: float | None = None

    def run(self) -> None:
        self.started_ts = time.time()
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGCONT)
                ran = time.monotonic()
                time.sleep(RUN_S)
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(STOPPED_PER_RUN * (time.monotonic() - ran))
        except ProcessLookupError:
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)


def _steps(store: TelemetryStore) -> dict[int, list[StepRecord]]:
    by_rank: dict[int, list[StepRecord]] = {r: [] for r in range(WORLD)}
    for record in store.iter_steps("777"):
        by_rank.setdefault(record.rank, []).append(record)
    return by_rank


def _median(records: list[StepRecord], attr: str) -> float:
    values = [getattr(r, attr) for r in records if getattr(r, attr) is not None]
    assert values, attr
    return float(statistics.median(values))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_slowed_rank_of_each_stack_is_found_from_its_compute(
    stack: str, private_redis: RedisServer, tmp_path: Path
) -> None:
    script, needs, options = STACKS[stack]
    pytest.importorskip(needs, reason="the stacks' extras are installed by `make install`")
    port = free_port()
    logs = [(tmp_path / f"rank{r}.log").open("w") for r in range(WORLD)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "examples" / script),
                *options,
                "--ckpt-dir",
                str(tmp_path / "ckpt"),
                "--ckpt-every",
                "100000",
            ],
            cwd=tmp_path,
            env=_env(rank, port, private_redis.url),
            stdout=logs[rank],
            stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD)
    ]
    store = TelemetryStore(connect(private_redis.url))
    throttle = _Throttle(procs[SLOW].pid)

    def log_tail() -> str:
        return "\n".join(
            f"-- rank {r} --\n"
            + "\n".join((tmp_path / f"rank{r}.log").read_text().splitlines()[-15:])
            for r in range(WORLD)
        )

    def reported(steps: int) -> bool:
        assert all(p.poll() in (None, 0) for p in procs), log_tail()
        return all(len(v) >= steps for v in _steps(store).values())

    try:
        wait_for(lambda: reported(BEFORE), 240, f"{BEFORE} steps of every rank\n{log_tail()}")
        throttle.start()
        onset = time.time()
        wait_for(lambda: reported(BEFORE + AFTER), 300, f"steps after the onset\n{log_tail()}")
    finally:
        throttle.done.set()
        if throttle.is_alive():
            throttle.join(timeout=5)
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
        for log in logs:
            log.close()
    by_rank = _steps(store)
    settle = 1.0  # steps that ended this soon after the onset may have begun before it
    before = {r: [x for x in v if x.ts < onset and x.step >= 5] for r, v in by_rank.items()}
    after = {r: [x for x in v if x.ts > onset + settle] for r, v in by_rank.items()}
    compute = {
        (r, a): _median((after if a else before)[r], "compute_s") for r in by_rank for a in (0, 1)
    }
    wait = {(r, a): _median((after if a else before)[r], "comm_s") for r in by_rank for a in (0, 1)}
    figures = f"compute {compute}\nwait {wait}"
    assert compute[SLOW, 1] > 2 * compute[SLOW, 0], figures
    for rank in range(WORLD):
        if rank == SLOW:
            continue
        assert compute[SLOW, 1] > 2 * compute[rank, 1], figures
        assert wait[rank, 1] > wait[rank, 0], figures
        assert wait[rank, 1] > 1.3 * wait[SLOW, 1], figures
    # The detector, on the records as the service reads them, names node3 alone.
    detector = Detector()
    records = [x for v in by_rank.values() for x in v]
    detector.add("777", RecordBatch.from_records(records))
    flagged = {
        e.node
        for e in detector.advance(final=True)
        if isinstance(e, StragglerEvent) and e.cause == "compute"
    }
    assert flagged == {"node3"}, (flagged, figures)
