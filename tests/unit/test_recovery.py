"""Onset to the first healthy step, as the service times it (service/recovery.py): the job's
pace before the onset is the bar, the first cycle after our action at that pace (and the
next ones too) is the healthy step."""

from __future__ import annotations

import math

from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.model.records import StepRecord
from slurm_plugin.service.recovery import CONFIRM, GIVE_UP_S, KEEP, Recovered, RecoveryClock

ONSET = 100.0


def cycle(first_ts: float, step_s: float, ranks: int = 4, steps: int = 2) -> RecordBatch:
    """One 2 s cycle of a job: ``steps`` steps of ``ranks`` ranks from ``first_ts`` on."""
    return RecordBatch.from_records(
        StepRecord(
            job_id="5",
            rank=r,
            node=f"node{1 + r // 2}",
            gpu=r % 2,
            step=int(first_ts) + s,
            ts=first_ts + s * step_s,
            step_s=step_s,
            compute_s=step_s / 2,
            comm_s=step_s / 2,
        )
        for s in range(steps)
        for r in range(ranks)
    )


def run(clock: RecoveryClock, start: float, end: float, step_s: float) -> list[Recovered]:
    """Cycles every 2 s over [start, end); what they completed."""
    done = []
    t = start
    while t < end:
        found = clock.feed("5", cycle(t, step_s))
        if found is not None:
            done.append(found)
        t += 2.0
    return done


def test_a_requeue_is_timed_from_the_onset_and_from_the_action() -> None:
    clock = RecoveryClock()
    assert run(clock, 0, ONSET, 1.0) == []
    assert run(clock, ONSET, 160, 3.0) == []  # slow: nothing to time yet
    assert clock.acted("5", "requeue", "dec-1", ONSET, now=160.0)
    assert run(clock, 158, 170, 3.0) == []  # late flushes of the old attempt, still slow
    (done,) = run(clock, 190, 220, 1.05)  # the new attempt, at its old pace (within 10 %)
    assert (done.kind, done.decision_id) == ("requeue", "dec-1")
    assert math.isclose(done.onset_to_healthy_s, 90.0)
    assert math.isclose(done.action_to_healthy_s, 30.0)
    assert not clock.waiting("5")  # timed once
    assert run(clock, 220, 260, 1.0) == []


def test_a_lucky_cycle_is_not_a_healthy_step() -> None:
    clock = RecoveryClock()
    run(clock, 0, ONSET, 1.0)
    clock.acted("5", "advice", "dec-2", ONSET, now=120.0)
    assert run(clock, 130, 130 + 2 * CONFIRM, 1.0) == []  # healthy, not yet confirmed
    assert run(clock, 130 + 2 * CONFIRM, 140, 2.0) == []  # slow again: the run starts over
    (done,) = run(clock, 150, 170, 1.0)
    assert done.kind == "advice"
    assert math.isclose(done.onset_to_healthy_s, 50.0)


def test_the_newest_action_is_the_one_timed() -> None:
    """Advice ignored, then the requeue at its deadline: timed as the requeue."""
    clock = RecoveryClock()
    run(clock, 0, ONSET, 1.0)
    clock.acted("5", "advice", "dec-3", ONSET, now=110.0)
    clock.acted("5", "requeue", "dec-3", ONSET, now=230.0)
    (done,) = run(clock, 240, 260, 1.0)
    assert done.kind == "requeue"
    assert math.isclose(done.action_to_healthy_s, 10.0)


def test_no_pace_before_the_onset_is_not_timed() -> None:
    clock = RecoveryClock()
    assert not clock.acted("5", "requeue", "dec-4", ONSET, now=110.0)  # never seen
    run(clock, 99, 140, 3.0)  # seen only from the onset on
    assert not clock.acted("5", "requeue", "dec-4", ONSET, now=140.0)
    assert not clock.acted("5", "requeue", "dec-4", math.nan, now=140.0)
    assert run(clock, 150, 200, 1.0) == []


def test_a_job_that_never_runs_at_its_pace_again_is_dropped() -> None:
    clock = RecoveryClock()
    run(clock, 0, ONSET, 1.0)
    clock.acted("5", "requeue", "dec-5", ONSET, now=110.0)
    run(clock, 120, 200, 1.5)  # slower on its new nodes
    assert clock.waiting("5")
    clock.feed("5", cycle(110.0 + GIVE_UP_S + 1, 1.5))
    assert not clock.waiting("5")


def test_nan_step_times_and_empty_cycles_are_skipped() -> None:
    clock = RecoveryClock()
    run(clock, 0, ONSET, 1.0)
    clock.acted("5", "requeue", "dec-6", ONSET, now=110.0)
    empty = cycle(120, 1.0).take(cycle(120, 1.0).rank < 0)
    assert clock.feed("5", empty) is None
    broken = cycle(120, 1.0)
    broken.step_s[:] = math.nan
    assert clock.feed("5", broken) is None
    assert clock.waiting("5")


def test_the_pace_kept_is_bounded_and_reaches_back_hours() -> None:
    """Ten hours of a job at 2 s cycles: at most KEEP samples, the oldest from early on."""
    clock = RecoveryClock()
    run(clock, 0, 10 * 3600, 1.0)
    pace = clock._paces["5"]
    assert len(pace.ts) <= KEEP
    assert pace.ts[0] < 3600
    clock.forget("5")
    assert not clock._paces
