"""The detector on bad input: records it must drop and count (NaN, negative, a rank beyond
any job), records late, shuffled or missing, a restarted job's attempts, and any finite input
at all (hypothesis), without ever raising."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_plugin.detection import DetectionParams, Detector, RecordBatch, StragglerEvent
from slurm_plugin.model.records import StepRecord
from tests.scenarios import detect
from tests.scenarios.generator import JobSpec, generate, step_change


def test_a_rank_beyond_any_job_is_a_bad_record_not_an_allocation() -> None:
    """One record claiming rank 10**12 is dropped and counted; it does not make the detector
    size its arrays for a trillion ranks (which raised MemoryError for every job it held)."""
    records = [
        StepRecord("1", rank, "n1", 0, step, 100.0 + step, 1.0, 0.5, 0.1, 0.0)
        for step in range(3)
        for rank in (0, 1, 2, 3, 10**12)
    ]
    det = Detector()
    det.add("1", RecordBatch.from_records(records))
    assert det.advance(final=True) == []
    assert det.bad_records == 3


def test_world_size_one_and_identical_ranks_raise_nothing() -> None:
    """One rank (nothing to compare) or perfectly equal ranks (MAD 0) never alarm."""
    assert detect.run(JobSpec("13", 1, 300, seed=10)) == []
    spec = JobSpec("14", 16, 300, noise=0.0, data_jitter=0.0, data_spike_p=0.0, compute_spike_p=0.0)
    assert detect.run(spec) == []


def test_rank_missing_for_100_steps_is_tolerated() -> None:
    """A rank that stops reporting for 100 steps is not blamed; a real straggler still is."""
    spec = JobSpec("15", 64, 600, seed=11, compute_slow={50: step_change(0.05, 400)})
    batch = generate(spec)
    keep = ~((batch.rank == 3) & (batch.step >= 100) & (batch.step < 200))
    det = Detector()
    det.add("15", batch.take(keep))
    (event,) = detect.first_reports(list(det.advance(final=True)))
    assert event.ranks == [50]


def test_a_flagged_rank_gone_silent_is_not_reported_with_nothing_to_show() -> None:
    """Rank 5, 2x slow and reported, stops reporting at step 400 while the job goes on: its
    chart is still high, but no report follows without a measurement (the demo showed one
    with slowdown NaN); the reports it had are all finite."""
    spec = JobSpec("s", 32, 800, seed=4, compute_slow={5: step_change(1.0, 100)})
    batch = generate(spec)
    det = Detector()
    det.add("s", batch.take(~((batch.rank == 5) & (batch.step >= 400))))
    events = detect.reports(list(det.advance(final=True)))
    assert events
    assert all(math.isfinite(e.slowdown_pct) for e in events), events
    assert max(e.step for e in events) < 400 + 32  # the window still holds measured steps


def test_out_of_order_and_late_records() -> None:
    """Records arriving shuffled in small batches give the same detection; records for
    steps already processed are counted as late."""
    spec = JobSpec("16", 64, 400, seed=12, compute_slow={9: step_change(0.05, 200)})
    batch = generate(spec)
    rng = np.random.default_rng(0)
    det = Detector()
    collected: list[object] = []
    for start in range(0, spec.steps, 5):  # 5 steps at a time, shuffled inside
        idx = np.flatnonzero((batch.step >= start) & (batch.step < start + 5))
        det.add("16", batch.take(rng.permutation(idx)))
        collected += det.advance()
    det.add("16", batch.take(np.flatnonzero(batch.step == 3)))  # replayed old records
    events = detect.first_reports([*collected, *det.advance(final=True)])
    assert [e.ranks for e in events] == [[9]]
    assert det.late_records == 64


def test_nan_and_invalid_values_are_dropped_and_counted() -> None:
    """NaN step times, negative or infinite phases are dropped; NaN phases mean missing."""
    spec = JobSpec("17", 16, 100, seed=13)
    batch = generate(spec)
    batch.step_s[:5] = np.nan
    batch.compute_s[5:8] = -1.0
    batch.comm_s[8] = np.inf
    batch.compute_s[20:40] = np.nan  # not measured: allowed
    det = Detector()
    det.add("17", batch)
    assert det.advance(final=True) == []
    assert det.bad_records == 9


def test_restart_starts_a_new_attempt() -> None:
    """A higher attempt resets the job's state; its events carry the attempt; stale records
    of the old attempt are ignored."""
    first = JobSpec("18", 64, 300, seed=14, compute_slow={10: step_change(0.05, 100)})
    second = JobSpec(
        "18",
        64,
        300,
        seed=15,
        attempt=1,
        start_ts=1_700_010_000.0,
        compute_slow={20: step_change(0.05, 150)},
    )
    det = Detector()
    det.add("18", generate(first))
    events = detect.first_reports(list(det.advance(final=True)))
    det.add("18", generate(second))
    det.add("18", generate(first).take(np.arange(64)))  # a straggling record of attempt 0
    events += detect.first_reports(list(det.advance(final=True)))
    assert [(e.attempt, e.ranks) for e in events] == [(0, [10]), (1, [20])]


finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(min_value=1, max_value=12),
    st.lists(
        st.tuples(
            st.integers(0, 11),
            st.integers(0, 40),
            st.integers(0, 2),
            finite,
            finite,
            st.one_of(st.none(), finite),
            st.one_of(st.none(), finite),
        ),
        min_size=1,
        max_size=300,
    ),
)
def test_detector_never_raises_on_arbitrary_finite_input(
    world: int, rows: list[tuple[int, int, int, float, float, float | None, float | None]]
) -> None:
    """Any finite records, in any order and shape, are accepted without an exception."""
    nan = float("nan")
    rows = [r for r in rows if r[0] < world]
    if not rows:
        return
    batch = RecordBatch(
        rank=np.array([r[0] for r in rows], dtype=np.int64),
        step=np.array([r[1] for r in rows], dtype=np.int64),
        attempt=np.array([r[2] for r in rows], dtype=np.int64),
        gpu=np.zeros(len(rows), dtype=np.int64),
        ts=np.array([1e9 + r[1] for r in rows], dtype=np.float64),
        step_s=np.array([r[3] for r in rows]),
        compute_s=np.array([r[4] for r in rows]),
        comm_s=np.array([nan if r[5] is None else r[5] for r in rows]),
        data_s=np.array([nan if r[6] is None else r[6] for r in rows]),
        node=[f"n{r[0] // 4}" for r in rows],
    )
    det = Detector(DetectionParams(warmup_steps=2, min_world_size=2))
    det.add("99", batch)
    det.advance()
    det.advance(final=True)
    det.check_hangs(2e9)


def test_after_a_restart_ranks_are_bound_to_their_new_nodes() -> None:
    """Issue 13: attempt 0 ran on node1-3 (node3 slow, excluded); attempt 1 runs on node1,
    node2, node4 and node4 is slow: the straggler is node4, never the excluded node3."""

    def attempt(number: int, nodes: list[str], slow: str, steps: range) -> RecordBatch:
        rng = np.random.default_rng(number)
        records = [
            StepRecord("7", 2 * i + g, node, g, step, 1000.0 + step, 0.2,
                       0.1 * (2.0 if node == slow else 1.0) * (1 + 0.01 * rng.normal()),
                       0.05, 0.0, number)
            for step in steps
            for i, node in enumerate(nodes)
            for g in range(2)
        ]  # fmt: skip
        return RecordBatch.from_records(records)

    detector = Detector()
    detector.add("7", attempt(0, ["node1", "node2", "node3"], "node3", range(60)))
    first = [e for e in detector.advance() if isinstance(e, StragglerEvent)]
    assert {e.node for e in first} == {"node3"}
    detector.add("7", attempt(1, ["node1", "node2", "node4"], "node4", range(80)))
    second = [e for e in detector.advance() if isinstance(e, StragglerEvent)]
    assert second
    assert {e.node for e in second} == {"node4"}
