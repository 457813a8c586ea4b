"""A rank of a pretend training job: publishes step timings through StepReporter.

Run under srun. Ranks on ``SLOW_NODE`` report ``SLOW_FACTOR`` times more compute; rank 0 also
publishes a few records claiming a node outside the job (``node9``), which the service must
ignore. Usage: python -m tests.integration._fake_rank SECONDS SLOW_NODE SLOW_FACTOR
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time

from slurm_plugin import StepReporter
from slurm_plugin.store.telemetry_store import TelemetryStore, connect


def main() -> None:
    seconds, slow_node, factor = float(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    # "node3,node2": node3 is slow in the first run, node2 after one restart, and so on.
    choices = slow_node.split(",")
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    slow = node == choices[min(attempt, len(choices) - 1)]
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    rng = random.Random(rank)  # noqa: S311 - measurement noise, not cryptography
    reporter = StepReporter.from_env()
    forged = None
    if rank == 0:  # forged evidence against a node that is not in the job
        forged = StepReporter(
            os.environ["SLURM_JOB_ID"],
            99,
            "node9",
            store_factory=lambda: TelemetryStore(connect(os.environ["STRAGGLER_REDIS_URL"])),
        )
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        compute = 0.05 * (factor if slow else 1.0) * (1 + 0.01 * rng.gauss(0, 1))
        step_s = 0.05 * factor + 0.01
        reporter.record(step, step_s, compute, step_s - compute, 0.001)
        if forged is not None:
            forged.record(step, step_s, 0.5, 0.0, 0.001)
        step += 1
        time.sleep(0.05)
    reporter.close()
    if forged is not None:
        forged.close()


if __name__ == "__main__":
    main()
