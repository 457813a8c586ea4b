"""A job, its nodes, a detection and the facts of now, as the decision tests share them:
job 5 on node1-3 (node4 idle) under the shipped policies, node3 slow."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.decide import ClusterContext, JobContext
from slurm_plugin.policy.lifecycle import World
from slurm_plugin.policy.loader import load_policies

NOW = 1_700_000_000.0
REPO = Path(__file__).resolve().parents[2]  # the checkout
POLICIES = load_policies(REPO / "policies")
NODES = tuple(
    NodeInfo(f"node{i}", "allocated" if i < 4 else "idle", (), "", ("debug",)) for i in range(1, 5)
)


BASE_JOB = JobInfo(
    job_id="5",
    name="train",
    state="RUNNING",
    reason="None",
    nodes=("node1", "node2", "node3"),
    excluded=(),
    restarts=0,
    requeue=True,
    comment="",
    admin_comment="",
    partition="debug",
    node_count=3,
    user="alice",
    time_limit_s=4 * 3600.0,
    start_time=NOW - 600,
)


def job(**overrides: Any) -> JobInfo:
    """The running job 5 on node1-3, with ``overrides``."""
    return replace(BASE_JOB, **overrides)


def event(
    slowdown: float = 10.0, cause: str = "compute", lasted_s: float = 900.0
) -> StragglerEvent:
    """A detection at NOW of a slowdown that began ``lasted_s`` ago (by default long enough to
    be taken for a lasting one)."""
    return StragglerEvent(
        job_id="5",
        node="node3",
        gpu=1,
        ranks=[5],
        step=100,
        ts=NOW,
        cusum_ratio=1.2,
        slowdown_pct=slowdown,
        cause=cause,  # type: ignore[arg-type]
        scope="gpu",
        since_ts=NOW - lasted_s,
    )


def world(now: float, job: JobInfo = BASE_JOB) -> World:
    """The shipped evict policy; a re-check that never has anything to look at (the job's
    newest steps never show the node: restarted with other step numbers, say)."""
    return World(
        job,
        POLICIES["evict"],
        JobContext(last_checkpoint_ts=now - 60),
        ClusterContext(nodes=tuple(NodeInfo(n.name, "idle", (), "", ("debug",)) for n in NODES)),
        now,
        lambda _event, _since: None,
    )


def slowdown() -> StragglerEvent:
    """node3 at +40 %, a quarter of the job's time, for 15 minutes."""
    return replace(event(40.0), job_loss_pct=25.0)
