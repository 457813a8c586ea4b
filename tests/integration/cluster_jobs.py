"""What the cluster tests share: a job submitted to the dev cluster with one slow node, and
the rails under which a node's second incident makes it a persistent straggler."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from slurm_plugin.policy.history import Incident, NodeHistory
from slurm_plugin.service.state import ServiceState
from tests.integration.conftest import Slurm

REPO = Path(__file__).resolve().parents[2]
HOSTILE_NAME = 'it\'s; "a" $(job) name'


def submit(
    slurm: Slurm,
    job_dir: Path,
    policy: str,
    nodes: int = 3,
    seconds: int = 300,
    slow: str = "node3",
    factor: float = 1.5,
) -> str:
    """A job of ``nodes`` nodes, two ranks each (tests/integration/_fake_rank.py), under
    ``policy``, with ``slow`` computing ``factor`` times as long; its name is hostile."""
    # node3 at 1.5x costs the job ~29 % of its step time: an eviction pays (~520 s saved
    # against the 180 s restart plus the work lost) until ~3 minutes into the job. At 1.2x
    # (~14 %) it paid only for the first ~40 s, which a slow CI machine's start-up used up.
    return slurm.sbatch(
        f"-N{nodes}",
        "--ntasks-per-node=2",
        "--requeue",
        "-t",
        "30",
        "-J",
        HOSTILE_NAME,
        f'--comment=straggler:policy={policy}; note="quoted; value"',
        f"--output={job_dir / 'job-%j.log'}",
        "--chdir",
        str(REPO),
        "--wrap",
        f"srun {sys.executable} -m tests.integration._fake_rank {seconds} {slow} {factor}",
    )


RAILS = {
    "STRAGGLER_SERVICE_DEFAULT_POLICY": "evict-aggressive",
    "STRAGGLER_SERVICE_DRAIN_PERSISTENT": "true",
    "STRAGGLER_SAFETY": '{"max_partition_drained_fraction": 0.5}',
    "STRAGGLER_PERSISTENCE": '{"incidents": 2, "sustained_s": 0}',
}


def one_earlier_incident(state: ServiceState, node: str) -> None:
    """``node`` was slow in another job a minute ago (a suspect): its next incident makes it a
    persistent straggler under :data:`RAILS`."""
    state.save_node_history(
        NodeHistory(
            node,
            incidents=(Incident("999", time.time() - 60),),
            state="suspect",
            last_incident=time.time() - 60,
        )
    )
