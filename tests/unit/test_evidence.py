"""Evidence rules: which records the service believes, and hardware corroboration."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_plugin.model.cluster import MAX_RANKS_PER_NODE, JobInfo
from slurm_plugin.model.records import StepRecord
from slurm_plugin.policy.history import HistoryParams, Incident, NodeHistory, record_incident
from slurm_plugin.service.evidence import EvidenceFilter, hardware_evidence
from slurm_plugin.service.ingest import forget_oldest

JOB = JobInfo(
    job_id="7",
    name="train",
    state="RUNNING",
    reason="None",
    nodes=("node1", "node2"),
    excluded=(),
    restarts=1,
    requeue=True,
    comment="",
    admin_comment="",
    partition="debug",
    node_count=2,
    user="alice",
)


def _rec(rank: int, node: str, attempt: int = 1, step: int = 0) -> StepRecord:
    return StepRecord("7", rank, node, 0, step, 0.0, 0.1, 0.08, 0.02, 0.0, attempt)


def _filter(
    evidence: EvidenceFilter, job: JobInfo, records: list[StepRecord]
) -> tuple[list[StepRecord], Counter[str]]:
    """The records ``evidence`` believes (its arrays built from record objects)."""
    nodes = sorted({r.node for r in records})
    keep, dropped = evidence.judge(
        job,
        np.array([r.rank for r in records], dtype=np.int64),
        np.array([nodes.index(r.node) for r in records], dtype=np.int64),
        nodes,
        np.array([r.attempt for r in records], dtype=np.int64),
    )
    return [r for r, ok in zip(records, keep, strict=True) if ok], dropped


def _reference(
    state: dict[str, object], job: JobInfo, records: list[StepRecord]
) -> tuple[list[StepRecord], Counter[str]]:
    """The rules record by record, as first written (the arrays must agree with it)."""
    kept, dropped = [], Counter[str]()
    for r in records:
        if r.node not in job.nodes:
            dropped["foreign_node"] += 1
            continue
        if r.rank >= job.node_count * MAX_RANKS_PER_NODE:
            dropped["rank_out_of_range"] += 1
            continue
        if r.attempt > job.restarts:
            dropped["future_attempt"] += 1
            continue
        if r.attempt > state["attempt"]:  # type: ignore[operator]
            state["attempt"], state["nodes"] = r.attempt, {}
        if r.attempt == state["attempt"]:
            bound = state["nodes"].setdefault(r.rank, r.node)  # type: ignore[attr-defined]
            if bound != r.node:
                dropped["rank_moved"] += 1
                continue
        kept.append(r)
    return kept, dropped


_RECORD = st.builds(
    _rec,
    st.one_of(st.integers(0, 4), st.sampled_from([2047, 2048, 10**12])),
    st.sampled_from(["node1", "node2", "node3"]),
    st.integers(0, 3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_RECORD, max_size=12), min_size=1, max_size=4))
def test_the_arrays_judge_as_the_rules_do_record_by_record(
    cycles: list[list[StepRecord]],
) -> None:
    evidence, state = EvidenceFilter(), {"attempt": -1, "nodes": {}}
    for records in cycles:  # one cycle's records after another: the bindings carry over
        assert _filter(evidence, JOB, records) == _reference(state, JOB, records)


def test_records_that_do_not_fit_the_job_are_dropped_and_counted() -> None:
    """Foreign nodes, ranks beyond the job's size, future attempts and ranks that change node
    are dropped, by reason."""
    evidence = EvidenceFilter()
    records = [
        _rec(0, "node1"),
        _rec(1, "node2"),
        _rec(2, "node9"),  # not one of the job's nodes
        _rec(0, "node2", step=1),  # rank 0 was on node1 in this attempt
        _rec(1, "node2", attempt=2),  # Slurm says restart count 1
        _rec(1, "node1", attempt=0),  # an older attempt: the detector drops it later
        _rec(10**12, "node1"),  # 2 nodes: at most 2,048 ranks
    ]
    kept, dropped = _filter(evidence, JOB, records)
    assert kept == [records[0], records[1], records[5]]
    assert dict(dropped) == {
        "foreign_node": 1,
        "rank_moved": 1,
        "future_attempt": 1,
        "rank_out_of_range": 1,
    }
    # The binding outlives the batch: a later batch cannot move rank 0 either.
    kept, dropped = _filter(evidence, JOB, [_rec(0, "node2", step=2), _rec(0, "node1", step=2)])
    assert [r.node for r in kept] == ["node1"]
    assert dropped["rank_moved"] == 1


def test_a_new_attempt_rebinds_ranks() -> None:
    """After a requeue ranks may land on other nodes; the binding starts again."""
    evidence = EvidenceFilter()
    _filter(evidence, replace(JOB, restarts=0), [_rec(0, "node1", attempt=0)])
    kept, dropped = _filter(evidence, JOB, [_rec(0, "node2", attempt=1)])
    assert len(kept) == 1
    assert not dropped
    evidence.forget_all_but([])
    kept, _ = _filter(evidence, JOB, [_rec(0, "node1", attempt=1)])
    assert len(kept) == 1  # forgotten: node1 is the first binding again


def test_a_job_that_left_nodes_on_advice_may_renumber_its_ranks() -> None:
    """torch elastic numbers the ranks of a group re-formed without a node anew: once the job
    left nodes on advice, a rank on another of its nodes is bound there (not dropped), until
    the next attempt, where the usual rule holds again."""
    evidence = EvidenceFilter()
    job = replace(JOB, nodes=("node1", "node2", "node3"), node_count=3)
    _filter(evidence, job, [_rec(0, "node1"), _rec(1, "node2"), _rec(2, "node3")])
    _, dropped = _filter(evidence, job, [_rec(1, "node3", step=1)])
    assert dropped["rank_moved"] == 1
    evidence.regrouped(job.job_id)
    kept, dropped = _filter(evidence, job, [_rec(1, "node3", step=2), _rec(0, "node2", step=2)])
    assert len(kept) == 2
    assert not dropped
    kept, dropped = _filter(evidence, job, [_rec(1, "node3", step=3), _rec(1, "node1", step=3)])
    assert len(kept) == 2
    later = replace(job, restarts=2)
    _filter(evidence, later, [_rec(0, "node1", attempt=2)])
    _, dropped = _filter(evidence, later, [_rec(0, "node2", attempt=2, step=1)])
    assert dropped["rank_moved"] == 1


def _sample(node: str, **gpu: object) -> dict[str, object]:
    base = {"index": 2, "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980, "throttle_reasons": []}
    return {"node": node, "gpus": [{**base, **gpu}]}


def test_hardware_evidence_from_sidecar_and_prolog() -> None:
    """Thermal/power throttling, XIDs, low clocks under load and prolog findings count."""
    samples = [
        _sample("node1", throttle_reasons=["hw_thermal_slowdown", "sw_power_cap"]),
        _sample("node1", xids=[79]),
        _sample("node1", sm_clock_mhz=900),
        _sample("node2", throttle_reasons=["hw_slowdown"]),  # another node
        _sample("node1", sm_clock_mhz=300, throttle_reasons=["gpu_idle"]),  # idle: not evidence
    ]
    check = {"findings": [{"check": "pcie", "severity": "warn", "message": "x8 of x16"}]}
    assert hardware_evidence(samples, "node1", [2], check) == [
        "gpu2 hw_thermal_slowdown",
        "gpu2 sm clock 900/1980 MHz",
        "gpu2 xid 79",
        "prolog pcie: x8 of x16",
    ]
    assert hardware_evidence(samples, "node1", [5]) == []  # another GPU of node1
    assert hardware_evidence([_sample("node1")], "node1") == []
    assert hardware_evidence([{"node": "node1", "gpus": ["garbage", None]}], "node1") == []


def test_require_corroboration_keeps_timing_alone_from_draining() -> None:
    """With require_corroboration, incidents from many jobs and users do not make a node
    persistent until one of them has hardware evidence."""
    params = HistoryParams(incidents=3, distinct_jobs=2, require_corroboration=True)
    history = NodeHistory("node1")
    for i, job in enumerate(["1", "2", "3", "4"]):
        transition = record_incident(history, Incident(job, 1000.0 + i, 10.0, user=job), params)
        history = transition.history
        assert not transition.became_persistent
    transition = record_incident(history, Incident("5", 1010.0, 10.0, corroborated=True), params)
    assert transition.became_persistent
    assert "1 with hardware evidence" in transition.reasons[0]


def test_the_sessions_remembered_per_job_are_bounded() -> None:
    """A job's user can mint a reporter session per flush: past the cap the service forgets
    the oldest half, the sessions it read first."""
    seen = {(str(rank), f"{i:016x}"): 1 for i, rank in enumerate(range(10))}
    forget_oldest(seen, 16)
    assert len(seen) == 10
    seen.update({("0", f"{i:016x}"): 1 for i in range(10, 40)})
    forget_oldest(seen, 16)
    assert len(seen) == 8
    assert list(seen) == [("0", f"{i:016x}") for i in range(32, 40)]


def test_the_common_cycle_is_judged_as_the_rules_do() -> None:
    """The cheap check of a running job's usual cycle (every rank bound, on its node, of the
    attempt in force) believes exactly what the rules believe: the same records again are all
    kept; one rank on another node, a rank new to the job, an older attempt or a foreign node
    each go through the rules and are judged as before."""
    evidence, state = EvidenceFilter(), {"attempt": -1, "nodes": {}}
    first = [_rec(0, "node1"), _rec(1, "node1"), _rec(2, "node2"), _rec(3, "node2")]
    for records in (
        first,
        first,  # the common cycle
        [*first, _rec(1, "node2")],  # rank 1 moved
        [*first, _rec(4, "node2")],  # a rank new to the job
        [*first, _rec(0, "node1", attempt=0)],  # an older attempt
        [*first, _rec(3, "node3")],  # a node that is not the job's
        first,
    ):
        assert _filter(evidence, JOB, records) == _reference(state, JOB, records)


def test_a_reused_job_ids_leftover_steps_are_not_this_runs() -> None:
    """Issue 38, item 6: the service never saw job 7's earlier holder (it was down), whose
    slow-node steps are still in the stream; the new job 7 (Slurm's attempt 1, started at
    t=1000) must not be evicted on them. Records of its current attempt stamped over 30 s
    before that start are dropped as `before_start`; its own (and a node clock a few seconds
    behind) are kept, as are records of an older attempt (judged as they always were)."""
    job = replace(JOB, start_time=1000.0)
    times = np.array([10.0, 500.0, 975.0, 1000.0, 1200.0, 400.0])
    attempts = np.array([1, 1, 1, 1, 1, 0])
    keep, dropped = EvidenceFilter().judge(
        job,
        np.array([0, 1, 0, 1, 0, 1]),
        np.zeros(6, dtype=np.int64),
        ["node1"],
        attempts,
        times,
    )
    assert keep.tolist() == [False, False, True, True, True, True]
    assert dropped == Counter({"before_start": 2})
    # A job whose start Slurm did not give is judged as before (nothing is dropped by time).
    keep, dropped = EvidenceFilter().judge(
        JOB, np.array([0]), np.zeros(1, dtype=np.int64), ["node1"], np.array([1]), times[:1]
    )
    assert keep.tolist() == [True]
    assert not dropped
