"""Many ranks of one node in one process, publishing through the node's relay.

Usage: python -m tests.integration._relay_ranks JOB FIRST_RANK RANKS SECONDS SOCKET REDIS_URL
Prints one JSON line: the records each rank published (the relay's node is put on them; the
ranks here claim the node "claimed").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from slurm_plugin import StepReporter
from slurm_plugin.store.telemetry_store import TelemetryStore, connect


def main() -> None:
    job, first, ranks, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    socket_path, url = Path(sys.argv[5]), sys.argv[6]
    reporters = [
        StepReporter(
            job,
            first + i,
            "claimed",
            i % 8,
            store_factory=lambda: TelemetryStore(connect(url, retries=0)),
            flush_interval_s=0.5,
            relay_socket=socket_path,
        )
        for i in range(ranks)
    ]
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        for rep in reporters:
            rep.record(step, 0.1, 0.08, 0.015, 0.005)
        step += 1
        time.sleep(0.1)
    for rep in reporters:
        rep.close(timeout_s=20.0)
    result = {
        "published": sum(r.published for r in reporters),
        "dropped": sum(r.dropped for r in reporters),
        "steps": step,
    }
    print(json.dumps(result))  # noqa: T201 - the answer, on stdout


if __name__ == "__main__":
    main()
