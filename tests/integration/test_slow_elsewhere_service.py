"""Issue 36, class 7, through Redis and the service: two nodes slow by the same amount from a
job's first step are a stage of the job's own unless other jobs saw them slow. With node
history saying another job did (an incident of job 77 an hour ago on each), the service tells
the job's detector, which leaves them out of the structure and finds them: the job is evicted
from them under `evict`. Without that history, the same job decides nothing
(``test_a_pipeline_stage_is_never_evicted_but_a_straggler_in_it_is``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from slurm_plugin.policy.history import Incident, NodeHistory
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.loop_harness import NODES, Loop, make_loop, publish, running_job

__all__ = ["make_loop"]  # the fixture, from loop_harness

BAD = ("node3", "node4")


def _slow_elsewhere(loop: Loop) -> None:
    """Job 77 saw node3 and node4 slow an hour ago (node history, as the service keeps it)."""
    for node in BAD:
        incident = Incident("77", loop.clock() - 3600.0, 40.0, "compute", user="bob")
        loop.state.save_node_history(
            NodeHistory(node, (incident,), "suspect", last_incident=incident.ts)
        )


def _until_requeued(loop: Loop, slurm: FakeScheduler, restarts: int) -> None:
    """Cycles of node3 and node4 at 1.4x from step 0, until Slurm restarted the job once
    more than ``restarts`` (60 at most)."""
    for cycle in range(60):
        steps = range(cycle * 10, cycle * 10 + 10)
        publish(loop, slurm.job_table["5"], steps, {"node3": 1.4, "node4": 1.4})
        assert loop.service.cycle().error is None
        loop.clock.advance(1)
        if slurm.job_table["5"].restarts > restarts:
            break


def test_nodes_slow_elsewhere_are_not_taken_for_a_stage(make_loop: Callable[..., Loop]) -> None:
    clock = FakeClock()
    nodes = ("node1", "node2", "node3", "node4")
    slurm = FakeScheduler([running_job(clock, nodes=nodes)], NODES)
    loop = make_loop(slurm, clock, "a")
    _slow_elsewhere(loop)
    _until_requeued(loop, slurm, restarts=0)
    excluded = set(slurm.job_table["5"].excluded)
    assert excluded, slurm.changes
    assert excluded <= set(BAD), slurm.changes
    flagged = {d["node"] for d in loop.state.job_decisions("5") if d.get("node") != "none"}
    assert flagged <= set(BAD), flagged


def test_a_requeued_job_is_told_again_about_its_nodes(make_loop: Callable[..., Loop]) -> None:
    """What its nodes did elsewhere is read again for each run of the job (a requeue lands
    on other nodes, or the same ones later): job 5 ran healthy before node3 and node4 were
    seen slow elsewhere; its next run (Slurm's restart count 1) starts with both slow from
    its first step and is evicted from them, not taught they are a stage."""
    clock = FakeClock()
    nodes = ("node1", "node2", "node3", "node4")
    slurm = FakeScheduler([running_job(clock, nodes=nodes)], NODES)
    loop = make_loop(slurm, clock, "a")
    for cycle in range(5):
        publish(loop, slurm.job_table["5"], range(cycle * 10, cycle * 10 + 10), {})
        assert loop.service.cycle().error is None
        clock.advance(1)
    _slow_elsewhere(loop)
    slurm.job_table["5"] = replace(slurm.job_table["5"], restarts=1)
    _until_requeued(loop, slurm, restarts=1)
    job = slurm.job_table["5"]
    assert job.restarts == 2, slurm.changes
    assert set(job.excluded) <= set(BAD)
