"""Onset to the first healthy step, as the service sees it: how long after a slowdown began
(and after our action on it: a requeue, or advice the job acted on) the job ran at its own
pace again. The operators' figure for what a recovery is worth, by recovery kind
(``straggler_recovery_seconds``).

A job's pace is its step time (equal on every rank of a synchronous job: rank-to-rank
differences are in compute and wait, not here). Every cycle's believed records give one
sample per job, the median step time of its newest records; the samples of the last hours are
kept, thinned as they age (at most :data:`KEEP` per job). An action starts the clock: the
bar is the median of the samples before the onset, plus :data:`HEALTHY_PCT`; the first sample
after the action under the bar, followed by :data:`CONFIRM` more under it, is the healthy
step (its time: the earliest record of that cycle). One action per job at a time (the newest
wins: advice ignored, then a requeue, is counted as the requeue); a job that never gets back
under the bar within :data:`GIVE_UP_S` is dropped, uncounted; so is one with no pace known
from before its onset.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from slurm_plugin.model.batch import RecordBatch

Kind = Literal["requeue", "advice"]

#: A step is healthy again when its time is within this much of the job's before the onset
#: (the demo's figure uses the same bar).
HEALTHY_PCT = 10.0
#: ... and the samples of this many cycles after it are too (a lucky cycle is not enough).
CONFIRM = 2
#: Samples kept per job; past it every other is dropped and the spacing doubles.
KEEP = 256
#: The spacing of the kept samples at first (s).
SPACING_S = 5.0
#: Pre-onset samples the bar needs.
MIN_BEFORE = 2
#: An action not followed by a healthy step within this long is dropped, uncounted.
GIVE_UP_S = 6 * 3600.0


@dataclass(frozen=True)
class Recovered:
    """One recovery measured: seconds from the onset and from the action to the healthy step."""

    job_id: str
    kind: Kind
    decision_id: str
    onset_to_healthy_s: float
    action_to_healthy_s: float
    healthy_ts: float


@dataclass
class _Pace:
    ts: array[float] = field(default_factory=lambda: array("d"))
    step_s: array[float] = field(default_factory=lambda: array("d"))
    spacing_s: float = SPACING_S


@dataclass
class _Clock:
    kind: Kind
    decision_id: str
    onset_ts: float
    action_ts: float
    bar_s: float
    #: Healthy samples in a row since the action: (earliest record ts of the first, count).
    first_ts: float = math.nan
    run: int = 0


class RecoveryClock:
    """Per job: its pace over the last hours, and the clock of its newest recovery."""

    def __init__(self) -> None:
        self._paces: dict[str, _Pace] = {}
        self._clocks: dict[str, _Clock] = {}

    def acted(self, job_id: str, kind: Kind, decision_id: str, onset_ts: float, now: float) -> bool:
        """Our action on the job (a requeue, advice) at ``now`` on a slowdown that began at
        ``onset_ts``; False when the job's pace before the onset is unknown (not timed)."""
        pace = self._paces.get(job_id)
        if pace is None or not math.isfinite(onset_ts):
            return False
        before = [s for t, s in zip(pace.ts, pace.step_s, strict=True) if t < onset_ts]
        if len(before) < MIN_BEFORE:
            self._clocks.pop(job_id, None)
            return False
        bar = float(np.median(before)) * (1 + HEALTHY_PCT / 100)
        self._clocks[job_id] = _Clock(kind, decision_id, onset_ts, now, bar)
        return True

    def feed(self, job_id: str, batch: RecordBatch) -> Recovered | None:
        """One cycle's believed records of the job; the recovery it completes, if any."""
        if not len(batch):
            return None
        newest = float(batch.ts.max())
        clock = self._clocks.get(job_id)
        pace = self._paces.get(job_id)
        if clock is None and pace is not None and newest - pace.ts[-1] < pace.spacing_s:
            return None  # the usual cycle: nothing to keep, nothing timed (one max per job)
        finite = np.isfinite(batch.step_s)
        if not finite.any():
            return None
        self._keep(job_id, newest, float(np.median(batch.step_s[finite])))
        return None if clock is None else self._time(job_id, clock, batch, finite, newest)

    def _time(
        self, job_id: str, clock: _Clock, batch: RecordBatch, finite: np.ndarray, newest: float
    ) -> Recovered | None:
        """The running clock fed one cycle (its newest record at ``newest``): the recovery,
        once confirmed; dropped past :data:`GIVE_UP_S`."""
        if newest - clock.action_ts > GIVE_UP_S:
            del self._clocks[job_id]
            return None
        if not self._healthy(clock, batch, finite) or clock.run <= CONFIRM:
            return None
        del self._clocks[job_id]
        return Recovered(
            job_id,
            clock.kind,
            clock.decision_id,
            max(0.0, clock.first_ts - clock.onset_ts),
            max(0.0, clock.first_ts - clock.action_ts),
            clock.first_ts,
        )

    @staticmethod
    def _healthy(clock: _Clock, batch: RecordBatch, finite: np.ndarray) -> bool:
        """This cycle's steps after the action run under the bar (counted in the clock's run;
        a cycle over it starts the run again). False: none after the action, or over it."""
        after = batch.ts > clock.action_ts
        later = batch.step_s[after & finite]
        if not len(later):
            return False
        if float(np.median(later)) > clock.bar_s:
            clock.run, clock.first_ts = 0, math.nan
            return False
        if clock.run == 0:
            clock.first_ts = float(batch.ts[after].min())
        clock.run += 1
        return True

    def _keep(self, job_id: str, ts: float, step_s: float) -> None:
        pace = self._paces.setdefault(job_id, _Pace())
        if len(pace.ts) and ts - pace.ts[-1] < pace.spacing_s:
            return
        pace.ts.append(ts)
        pace.step_s.append(step_s)
        if len(pace.ts) > KEEP:  # every other sample dropped, the spacing doubled
            pace.ts, pace.step_s = pace.ts[1::2], pace.step_s[1::2]
            pace.spacing_s *= 2

    def waiting(self, job_id: str) -> bool:
        """A recovery of the job is being timed."""
        return job_id in self._clocks

    def forget(self, job_id: str) -> None:
        """Drop the job (ended, or its id given to another job)."""
        self._paces.pop(job_id, None)
        self._clocks.pop(job_id, None)

    def forget_all_but(self, running: set[str]) -> None:
        """Drop every job not running."""
        self._paces = {j: p for j, p in self._paces.items() if j in running}
        self._clocks = {j: c for j, c in self._clocks.items() if j in running}
