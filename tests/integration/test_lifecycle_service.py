"""The decision lifecycle (policy/lifecycle.py) as the service carries it out: a waited
eviction is valued and timed like any other, on the verdict it was decided on."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.loop_harness import (
    NODES,
    Loop,
    flag_while_waiting_for_a_checkpoint,
    make_loop,
    run_cycles,
    running_job,
)

__all__ = ["make_loop"]  # the fixture, shared with the control loop's tests


class _Recorder:
    """A metric that keeps what it was given (a counter's increments, a histogram's
    observations), whatever its labels."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def labels(self, **_labels: Any) -> _Recorder:
        return self

    def inc(self, amount: float = 1.0) -> None:
        self.values.append(amount)

    def observe(self, value: float) -> None:
        self.values.append(value)


def test_a_waited_eviction_reaches_the_value_metrics_and_the_latency(
    make_loop: Callable[..., Loop],
) -> None:
    """node3 flagged while job 5 waits for its checkpoint, still slow when it comes: the
    eviction after the checkpoint counts the GPU-hours it spends and expects to save, and its
    latency from the first detection, once each; its record holds the verdict it was taken
    on (saved and cost), with the hardware evidence the first decision found."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    metrics = loop.service.metrics
    spent, saved, latency = _Recorder(), _Recorder(), _Recorder()
    metrics.gpu_hours_spent, metrics.gpu_hours_saved, metrics.decision_seconds = (
        spent,
        saved,
        latency,
    )
    flag_while_waiting_for_a_checkpoint(loop)
    (waiting,) = loop.state.job_decisions("5")
    detected = float(waiting["detected_ts"])
    assert (spent.values, saved.values, latency.values) == ([], [], [])
    run_cycles(loop, 400, 5, {"node3": 2.0})
    loop.store.publish("5", events=[{"name": "checkpoint_end", "ts": clock(), "step": 440}])
    run_cycles(loop, 450, 1, {"node3": 2.0})
    decision = loop.state.decision(waiting["id"])
    assert (decision["state"], decision["after"], decision["node"]) == (
        "verified",
        "checkpoint",
        "node3",
    )
    assert len(spent.values) == len(saved.values) == len(latency.values) == 1
    assert spent.values[0] > 0
    assert saved.values[0] > 0
    assert latency.values[0] >= clock() - detected - 2  # from the first detection, not now
    gpus = loop.service._value.gpus("5")
    assert saved.values[0] * 3600 / gpus == pytest.approx(float(decision["saved_s"]), abs=0.1)
    assert spent.values[0] * 3600 / gpus == pytest.approx(float(decision["cost_s"]), abs=0.1)
    assert decision["hardware_evidence"] == waiting["hardware_evidence"]


def _until_decided(loop: Loop) -> list[dict[str, Any]]:
    """Cycles of job 5 with node3 at 2x from step 0 until a decision about it is saved (40
    at most); its decisions."""
    for cycle in range(40):
        run_cycles(loop, cycle * 10, 1, {"node3": 2.0})
        if loop.state.job_decisions("5"):
            break
    return loop.state.job_decisions("5")


#: The modules of the service and the policy a job's detection passes through on its way to
#: an eviction: the decision itself (the first six: gathered, decided, carried out), then
#: where its facts come from and where it is kept. A new module on that path fails here.
DECISION_PATH = (
    "service.loop",
    "policy.lifecycle",
    "policy.decide",
    "policy.verdict",
    "service.decisions",
    "service.executor",
)
FACTS_AND_STATE = (
    "service.policies",
    "service.detectors",
    "policy.durations",
    "service.identity",
    "service.evidence",
    "service.node_rails",
    "policy.history",
    "policy.rails",
    "service.waiting",
    "service.value",
    "service.metrics",
    "service.recovery",
    "service.state",
    "service.fence",
)


def test_a_detection_reaches_its_eviction_through_six_decision_modules(
    make_loop: Callable[..., Loop],
) -> None:
    """Every function of the package called while the service handles the detection that
    evicts job 5, by module: the decision chain is the six of :data:`DECISION_PATH`, and
    nothing of the service or the policy outside it and its facts is entered."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    entered: set[str] = set()
    handle = loop.service._handle

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":
            entered.add(str(frame.f_globals.get("__name__", "")).removeprefix("slurm_plugin."))

    def traced(*args: Any, **kwargs: Any) -> Any:
        sys.setprofile(profile)
        try:
            return handle(*args, **kwargs)
        finally:
            sys.setprofile(None)

    loop.service._handle = traced  # type: ignore[method-assign]
    (decision,) = _until_decided(loop)
    assert (decision["action"], decision["state"], decision["node"]) == (
        "evict",
        "verified",
        "node3",
    )
    ours = {m for m in entered if m.split(".")[0] in {"service", "policy"}}
    assert set(DECISION_PATH) <= ours
    assert sorted(ours - set(DECISION_PATH) - set(FACTS_AND_STATE)) == []


def test_an_eviction_goes_into_the_nodes_history_however_short_the_slowdown(
    make_loop: Callable[..., Loop],
) -> None:
    """Job 5 evicted from node3 within seconds of its slowdown: node3's history holds one
    incident, younger than ``sustained_s`` (a report that young is no incident unless the job
    was evicted for it), and no other node has one."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock)], NODES)
    loop = make_loop(slurm, clock, "a")
    (decision,) = _until_decided(loop)
    assert (decision["action"], decision["node"]) == ("evict", "node3")
    (incident,) = loop.state.node_history("node3").incidents
    assert incident.lasted_s is not None
    assert incident.lasted_s < loop.service.rails.persistence.params().sustained_s
    assert [h.node for h in loop.state.nodes() if h.incidents] == ["node3"]


def test_a_slowdown_from_the_start_that_comes_back_after_the_requeue_is_not_evicted_again(
    make_loop: Callable[..., Loop],
) -> None:
    """Issue 36, class 6, in the service: job 5 is evicted from node3, slow since its first
    step (a fault, or a stage of the job filling that node: nothing told). The service keeps
    which attempt that was (``from_start_requeued``); the next attempt is slow since its
    first step again, on the node it got instead: the job's own design, noted, not evicted
    again (with room in the partition and the cooldown long past)."""
    clock = FakeClock()
    spare = [NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(5, 9)]
    slurm = FakeScheduler([running_job(clock)], NODES + spare)
    loop = make_loop(slurm, clock, "a")
    (decision,) = _until_decided(loop)
    assert (decision["action"], decision["node"]) == ("evict", "node3")
    assert loop.state.job_state("5").from_start_requeued == 0
    job = slurm.job_table["5"]
    assert job.restarts == 1
    (instead,) = set(job.nodes) - {"node1", "node2"}
    clock.advance(7200)  # the cooldown is long past
    for cycle in range(40):
        run_cycles(loop, cycle * 10, 1, {instead: 2.0})
        later = [d for d in loop.state.job_decisions("5") if d["node"] == instead]
        if later:
            break
    assert later
    assert all(d["action"] != "evict" for d in later)
    said = [r for d in later for r in json.loads(d.get("reasons") or "[]")]
    assert any("requeued from attempt 0" in r for r in said), said
    assert [c[0] for c in slurm.changes].count("requeue_hold") == 1
