"""Hosts torch elastic's rendezvous store for a whole Slurm job, in its batch step: every
node's launcher joins as a client (``is_host=false``), so any node may leave the job,
including the first (no slurm-straggler code here).

    python examples/_rdzv_store.py PORT
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def main() -> None:
    port = int(sys.argv[1])
    # Every node's agent connects to this store, so it listens on every interface.
    store = TCPStore(
        "0.0.0.0",  # noqa: S104
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(hours=1),
    )
    print(f"rendezvous store on port {port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del store


if __name__ == "__main__":
    main()
