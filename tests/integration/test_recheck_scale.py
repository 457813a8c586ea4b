"""Issue 25: the pre-eviction re-check looks at the detector's own newest rows, not at a fixed
window of Redis entries: at thousands of per-rank flushes the newest 5,000 entries held none of
the slow node's ranks, and "no data" was read as "recovered" (17 of 24 evictions vetoed at
16,384 ranks). The real Service over a private redis-server with FakeScheduler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.detection.recheck import tail_slowdown_pct
from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.policy.verdict import UNKNOWN, recheck
from slurm_plugin.service.waiting import probe
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.loop_harness import Loop, make_loop, publish, running_job

__all__ = ["make_loop"]  # the fixture, from loop_harness
pytestmark = pytest.mark.integration


def test_a_straggler_among_thousands_of_ranks_is_not_vetoed(
    make_loop: Callable[..., Loop],
) -> None:
    """2,800 nodes x 2 ranks, each rank its own stream entry per flush; node3's entries are
    the oldest of every cycle (outside the newest 5,000)."""
    clock = FakeClock()
    names = tuple(f"node{i}" for i in range(1, 2801))
    nodes = [NodeInfo(n, "idle", (), "", ("debug",)) for n in (*names, "spare1")]
    job = replace(running_job(clock, nodes=names), node_count=len(names), submit_time=clock() - 700)
    slurm = FakeScheduler([job], nodes)
    loop = make_loop(slurm, clock, "a")
    for cycle in range(20):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {"node3": 2.0})
        loop.service.cycle()
        clock.advance(1)
        if slurm.changes and slurm.changes[-1][0] == "release":
            break
    reasons = [d.get("reasons", "") for d in loop.state.job_decisions("5")]
    assert ("release", "5") in [c[:2] for c in slurm.changes], reasons
    assert not any("no recent steps" in r or "recovered" in r for r in reasons), reasons


def test_tail_slowdown_is_unknown_without_rows_and_never_recovered() -> None:
    excess = np.array([[0.0, 1.0, 1.1], [0.0, 0.9, np.nan], [0.0, np.nan, np.nan]])
    numbers = np.array([10.0, 11.0, 12.0])
    on_node = np.array([1, 2])
    # Step 10: the node's two ranks against one other, whose median is theirs: no comparison
    # (left out); step 11: one against one.
    assert tail_slowdown_pct(excess, numbers, on_node) == pytest.approx(90.0)
    assert tail_slowdown_pct(excess, numbers, on_node, ranks=[2]) == pytest.approx(110.0)
    assert tail_slowdown_pct(excess, numbers, on_node, since_step=12) is None  # all NaN
    assert tail_slowdown_pct(excess, numbers, on_node, since_step=13) is None  # no row yet
    assert tail_slowdown_pct(excess, numbers, on_node, ranks=[7]) is None  # not its rank
    assert tail_slowdown_pct(excess, numbers, np.array([0])) == pytest.approx(0.0)


def test_a_recheck_without_a_detector_is_unknown() -> None:
    """No rows of the job at all: unknown (decided again), never a reason it recovered."""
    from slurm_plugin.policy.loader import load_policy  # noqa: PLC0415
    from tests.integration.conftest import REPO  # noqa: PLC0415

    policy = load_policy(REPO / "policies" / "evict.toml")
    clock = FakeClock()
    job = running_job(clock)
    check = probe(lambda _job_id: None, job, policy.detection.min_slowdown_pct)
    event = StragglerEvent(job.job_id, "node3", None, [2], 4, 0.0, 1.0, 80.0, "compute", "gpu")
    slowdown = check(event, event.step)
    assert slowdown is None
    assert recheck(event.node, slowdown, policy.detection.min_slowdown_pct) == UNKNOWN
