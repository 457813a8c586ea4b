"""Onset to the first healthy step, timed by the real service over a real Redis and a fake
Slurm (issue 40, item 4): a job at its pace, then slowed by node3 until the service requeues it
without node3, then at its pace again on its new nodes; the service says how long from the
onset and from the requeue (``service.recovered``, the ``straggler_recovery_seconds``
histogram)."""

from __future__ import annotations

from collections.abc import Callable

from structlog.testing import capture_logs

from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.loop_harness import NODES, Loop, run_cycles, running_job
from tests.integration.test_lifecycle_service import make_loop

__all__ = ["make_loop"]


def evictions(loop: Loop) -> list[dict[str, str]]:
    return [d for d in loop.state.job_decisions("5") if d.get("action") == "evict"]


def test_a_requeue_is_timed_from_the_onset_to_the_first_healthy_step(
    make_loop: Callable[..., Loop],
) -> None:
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    with capture_logs() as logs:
        for cycle in range(10):  # its pace: 0.06 s a step
            run_cycles(loop, cycle * 10, 1, {})
            clock.advance(4)
        onset = clock()
        for cycle in range(10, 90):  # node3 computes 2x: 0.11 s a step
            run_cycles(loop, cycle * 10, 1, {"node3": 2.0})
            if evictions(loop):
                break
        (decision,) = evictions(loop)
        assert (decision["action"], decision["state"]) == ("evict", "verified"), decision
        requeued = clock()
        assert "node3" not in slurm.job_table["5"].nodes
        for cycle in range(10):  # the new attempt, at its pace again
            run_cycles(loop, 1000 + cycle * 10, 1, {})
        healthy_by = clock()
    recovered = [e for e in logs if e["event"] == "service.recovered"]
    (timed,) = recovered
    assert (timed["recovery"], timed["decision_id"]) == ("requeue", decision["id"])
    # From the onset: at least the slow stretch; from the requeue: its first healthy cycles.
    assert requeued - onset - 2 <= timed["onset_to_healthy_s"] <= healthy_by - onset
    assert 0 <= timed["action_to_healthy_s"] <= healthy_by - requeued
    assert timed["onset_to_healthy_s"] > timed["action_to_healthy_s"]
