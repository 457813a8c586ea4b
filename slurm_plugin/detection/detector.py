"""The online detector: batches of step records from many jobs in, events out (pure).

Records may arrive late, out of order, duplicated, from restarted attempts, or not at all for
some ranks. A step of a job is processed once every known rank reported it, or once the job has
moved ``lag_steps`` beyond it; records for steps already processed are counted as late and
dropped. A record with a higher attempt number (Slurm restart count) starts a new detector for
the job: a restarted job runs on other nodes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from slurm_plugin.detection import many
from slurm_plugin.detection.block import Block
from slurm_plugin.detection.events import Event, HangEvent
from slurm_plugin.detection.job import JobDetector
from slurm_plugin.detection.params import DetectionParams
from slurm_plugin.model.batch import RecordBatch

#: Ranks at or above this are dropped as bad records: the detector's arrays are as wide as the
#: highest rank of a job (4,194,304 ranks: 32x the largest job measured; the service's evidence
#: rules bound a job's ranks by its size well before this).
MAX_RANK = 1 << 22
#: Jobs prepared and processed together in :meth:`Detector.advance` between two looks at
#: its deadline.
_CHUNK = 256


@dataclass
class _JobState:
    job_id: str
    pending: list[RecordBatch] = field(default_factory=list)
    #: When the oldest of ``pending`` came (the detector's clock); inf: nothing new pending.
    pending_since: float = math.inf
    detector: JobDetector | None = None
    attempt: int = -1
    last_step: int = -1
    last_ts: float = float("-inf")
    hang_reported_at: float | None = None
    #: Per rank (index), the step and time of its newest record; step -1: none yet.
    rank_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rank_ts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rank_node: dict[int, str] = field(default_factory=dict)
    rank_gpu: dict[int, int] = field(default_factory=dict)
    rank_group: dict[int, str] = field(default_factory=dict)
    #: How many ranks were bound when ``detector`` was built.
    built_with: int = 0
    #: Nodes other jobs saw slow lately (:meth:`Detector.suspect`).
    suspect: frozenset[str] = frozenset()


class Detector:
    """Straggler, hang and sync-stall detection over many jobs."""

    def __init__(
        self, params: DetectionParams | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.params = params or DetectionParams()
        self.clock = clock  # only for advance()'s deadline: detection itself reads no clock
        self._jobs: dict[str, _JobState] = {}
        self.late_records = 0
        self.bad_records = 0

    # -- input ---------------------------------------------------------------------------------
    def add(self, job_id: str, batch: RecordBatch) -> None:
        """Queue records of one job; nothing is computed until :meth:`advance`."""
        if not len(batch):
            return
        ok = (
            (batch.rank >= 0)
            & (batch.rank < MAX_RANK)
            & (batch.step >= 0)
            & np.isfinite(batch.ts)
            & (batch.step_s >= 0)  # False for NaN
            & ~np.isinf(batch.step_s)
        )
        for col in (batch.compute_s, batch.comm_s, batch.data_s):
            ok &= ~((col < 0) | np.isinf(col))  # NaN (not measured) passes
        if not ok.all():
            self.bad_records += int((~ok).sum())
            batch = batch.take(ok)
        state = self._jobs.setdefault(job_id, _JobState(job_id))
        if state.pending:  # what waits past one call is kept in arrays of its own (_own)
            state.pending[-1] = _own(state.pending[-1])
        state.pending.append(batch)
        if state.pending_since == math.inf:
            state.pending_since = self.clock()
        if len(batch):
            state.last_ts = max(state.last_ts, float(batch.ts.max()))
            state.hang_reported_at = None

    def suspect(self, job_id: str, nodes: Iterable[str]) -> None:
        """Nodes of the job that other jobs saw slow lately (node history): an offset only
        they share, learned at the end of the warm-up, is their fault, not the job's
        structure (:mod:`slurm_plugin.detection.structure`). Set before the warm-up ends."""
        state = self._jobs.setdefault(job_id, _JobState(job_id))
        state.suspect = frozenset(nodes)
        if state.detector is not None:
            state.detector.suspect_nodes = state.suspect

    def forget(self, job_id: str) -> None:
        """Drop a finished job's state."""
        self._jobs.pop(job_id, None)

    def structure(self, job_id: str) -> list[dict[str, object]]:
        """What the job's current attempt took for structure at the end of its warm-up."""
        state = self._jobs.get(job_id)
        return list(state.detector.structure) if state and state.detector else []

    def structure_scale(self, job_id: str) -> np.ndarray | None:
        """Per rank of the job's current attempt, its by-design compute factor (None: no
        structure): what the re-check divides out, for a replay that re-checks on the trace."""
        state = self._jobs.get(job_id)
        return state.detector.scale if state and state.detector else None

    def recent_slowdown_pct(
        self, job_id: str, node: str, ranks: Sequence[int] = (), since_step: int | None = None
    ) -> float | None:
        """The re-check of ``node`` on the job's current attempt, from the rows this detector
        holds (:meth:`JobDetector.recent_slowdown_pct`); None: unknown."""
        state = self._jobs.get(job_id)
        if state is None or state.detector is None:
            return None
        return state.detector.recent_slowdown_pct(node, ranks, since_step)

    # -- processing ----------------------------------------------------------------------------
    def advance(
        self, *, final: bool = False, deadline: float | None = None, max_wait_s: float = math.inf
    ) -> list[Event]:
        """Process every complete step of every job; ``final`` processes what is left too.

        With ``deadline`` (on the detector's clock) the jobs whose records have waited longest
        go first, and those not reached by then keep theirs for the next call; records that
        have waited ``max_wait_s`` are processed whatever the deadline (one job always is).
        Jobs go in chunks of ``_CHUNK``, the small ones of one layout together
        (:mod:`slurm_plugin.detection.many`): a job on its own costs nearly as much for one
        step as for ten, stacked it costs a tenth of that."""
        events: list[Event] = []
        states = [s for s in self._jobs.values() if s.pending]
        if deadline is not None:
            states.sort(key=lambda s: s.pending_since)
        for begin in range(0, len(states), _CHUNK):
            chunk = states[begin : begin + _CHUNK]
            now = self.clock()
            past = deadline is not None and now >= deadline
            if past:
                # Oldest first: only those that waited max_wait_s still go (one job always).
                late = [s for s in chunk if now - s.pending_since >= max_wait_s]
                past = len(late) < len(chunk)
                chunk = late or chunk[: 0 if begin else 1]
            events += self._process([(state, self._ready(state, final)) for state in chunk])
            if past:
                break
        return events

    def _process(self, ready: list[tuple[_JobState, Block | None]]) -> list[Event]:
        """Run the detectors over their blocks: the small jobs of one layout together
        (:mod:`slurm_plugin.detection.many`), then each job on which that raised anything
        and every other job one by one. A block in which a job's warm-up ends is run in two
        parts, the warm-up's first (its end learns the job's structure)."""
        work = [
            (state.detector, block)
            for state, block in ready
            if block is not None and state.detector is not None
        ]
        first: list[tuple[JobDetector, Block]] = []
        rest: dict[int, tuple[JobDetector, Block]] = {}
        for i, (det, block) in enumerate(work):
            cut = many.warmup_cut(det, block)
            if cut:
                first.append((det, block.rows(0, cut)))
                rest[i] = (det, block.rows(cut, len(block.steps)))
            else:
                first.append((det, block))
        done = self._stacked(first)
        events: list[Event] = []
        for i, ((det, block), ok) in enumerate(zip(work, done, strict=True)):
            if not ok:  # the whole block, as it came: nothing of its job was touched
                events += det.process(block)
                rest.pop(i, None)
        after = list(rest.values())
        for (det, block), ok in zip(after, self._stacked(after), strict=True):
            if not ok:
                events += det.process(block)
        return events

    @staticmethod
    def _stacked(work: list[tuple[JobDetector, Block]]) -> list[bool]:
        """The stacked pass over ``work``: per job, whether it was done there."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (det, block) in enumerate(work):
            if many.eligible(det, block):
                groups.setdefault(many.group_key(det, block), []).append(i)
        done = [False] * len(work)
        for members in groups.values():
            if len(members) >= many.MIN_GROUP:
                quiet = many.process_quiet(
                    [work[i][0] for i in members], [work[i][1] for i in members]
                )
                for i, ok in zip(members, quiet, strict=True):
                    done[i] = ok
        return done

    def waiting_s(self) -> float:
        """How long the records waiting longest for :meth:`advance` have waited (0: none)."""
        oldest = min((s.pending_since for s in self._jobs.values()), default=math.inf)
        return 0.0 if oldest == math.inf else max(0.0, self.clock() - oldest)

    def advance_job(self, job_id: str, *, final: bool = False) -> list[Event]:
        """:meth:`advance` for one job (a replay closes an attempt before the next)."""
        state = self._jobs.get(job_id)
        return self._advance_job(state, final) if state is not None else []

    def last_step_incomplete(self, job_id: str) -> bool:
        """Some ranks reported a later step than others: the job stopped inside a step."""
        state = self._jobs.get(job_id)
        if state is None:
            return False
        steps = state.rank_step[state.rank_step >= 0]
        return bool(len(steps)) and int(steps.min()) < int(steps.max())

    def _advance_job(self, state: _JobState, final: bool) -> list[Event]:
        return self._process([(state, self._ready(state, final))])

    def _ready(self, state: _JobState, final: bool) -> Block | None:
        """The job's complete steps as a block for its detector (None: none yet); what stays
        pending waits on ranks that have not reported, and goes after the others."""
        block = self._take_ready(state, final)
        state.pending_since = self.clock() if state.pending else math.inf
        return block

    def _take_ready(self, state: _JobState, final: bool) -> Block | None:
        if not state.pending:
            return None
        batch = RecordBatch.concat(state.pending) if len(state.pending) > 1 else state.pending[0]
        state.pending = []
        newest = int(batch.attempt.max())
        if newest > state.attempt:
            state.attempt = newest
            state.detector = None
            state.last_step = -1
            state.rank_step = np.zeros(0, dtype=np.int64)
            state.rank_ts = np.zeros(0)
            # A restarted job runs on other nodes: ranks are bound to nodes anew, so a
            # straggler is attributed to its new node, never to the one just excluded.
            state.rank_node.clear()
            state.rank_gpu.clear()
            state.rank_group.clear()
        keep = (batch.attempt == state.attempt) & (batch.step > state.last_step)
        if not keep.all():
            self.late_records += int((~keep).sum())
            batch = batch.take(keep)
        if not len(batch):
            return None
        self._learn_ranks(state, batch)
        world = len(state.rank_node)
        steps, counts = _step_counts(batch.step)
        complete = counts >= world
        if final:
            complete[:] = True
        else:
            complete |= steps <= steps.max() - self.params.lag_steps
        if not complete.any():
            state.pending = [_own(batch)]
            return None
        # Steps are processed in order: stop at the first incomplete one.
        cut = len(complete) if complete.all() else int(np.argmin(complete))
        ready_steps = steps[:cut]
        if not len(ready_steps):
            state.pending = [_own(batch)]
            return None
        in_ready = batch.step <= ready_steps[-1]
        if in_ready.all():
            ready = batch
        else:
            state.pending = [batch.take(~in_ready)]
            ready = batch.take(in_ready)
        state.last_step = int(ready_steps[-1])
        detector = self._detector(state)
        return self._block(ready, ready_steps, detector.world)

    def _learn_ranks(self, state: _JobState, batch: RecordBatch) -> None:
        """Bind new ranks to their node, GPU and group (from their first record) and note each
        rank's latest step (the step of its newest record)."""
        rank, ts, step = batch.rank, batch.ts, batch.step
        size = int(rank.max()) + 1
        present = np.zeros(size, dtype=bool)
        present[rank] = True
        if len(state.rank_step) < size:
            grow = size - len(state.rank_step)
            state.rank_step = np.concatenate([state.rank_step, np.full(grow, -1, np.int64)])
            state.rank_ts = np.concatenate([state.rank_ts, np.full(grow, -np.inf)])
        # A rank is new when it has no newest record yet (every bound rank has one).
        new = np.flatnonzero(present & (state.rank_step[:size] < 0)).tolist()
        new = [r for r in new if r not in state.rank_node]
        if new:
            first = np.full(size, len(rank))
            np.minimum.at(first, rank, np.arange(len(rank)))
            for r in new:
                index = int(first[r])
                state.rank_node[r] = batch.node[index]
                state.rank_gpu[r] = int(batch.gpu[index])
                if batch.group is not None and batch.group[index]:
                    state.rank_group[r] = str(batch.group[index])
        newest_ts = np.full(size, -np.inf)
        np.maximum.at(newest_ts, rank, ts)
        at_newest = ts == newest_ts[rank]
        newest_step = np.full(size, -1)
        np.maximum.at(newest_step, rank[at_newest], step[at_newest])
        later = present & (newest_step >= state.rank_step[:size])
        state.rank_step[:size][later] = newest_step[later]
        state.rank_ts[:size][later] = newest_ts[later]

    def _detector(self, state: _JobState) -> JobDetector:
        world = max(state.rank_node) + 1
        det = state.detector
        # Rebuilt whenever a rank is bound: one missing from the first records (rank 4 of
        # 0-5) held a place on the first node, and kept it once its records came, so its
        # slowness was blamed on a node it never ran on.
        if det is None or state.built_with < len(state.rank_node):
            names = sorted(set(state.rank_node.values()))
            index = {name: i for i, name in enumerate(names)}
            rank_node = np.zeros(world, dtype=np.int64)
            rank_gpu = np.zeros(world, dtype=np.int64)
            for rank, node in state.rank_node.items():
                rank_node[rank] = index[node]
                rank_gpu[rank] = state.rank_gpu[rank]
            labels = {name: i for i, name in enumerate(sorted(set(state.rank_group.values())))}
            rank_group = np.full(world, -1, dtype=np.int64)
            for rank, label in state.rank_group.items():
                rank_group[rank] = labels[label]
            fresh = JobDetector(
                state.job_id,
                self.params,
                state.attempt,
                rank_node,
                rank_gpu,
                names,
                rank_group=rank_group,
                suspect_nodes=state.suspect,
            )
            if det is not None:  # a rank appeared late: keep the warm-up and the structure
                fresh.adopt(det)
            state.detector = det = fresh
            state.built_with = len(state.rank_node)
        return det

    @staticmethod
    def _block(batch: RecordBatch, steps: np.ndarray, world: int) -> Block:
        rows = np.searchsorted(steps, batch.step)  # steps: sorted, and holds every batch.step
        shape = (len(steps), world)

        def dense(values: np.ndarray) -> np.ndarray:
            out = np.full(shape, np.nan)
            out[rows, batch.rank] = values
            return out

        ts = np.full(len(steps), -np.inf)
        np.maximum.at(ts, rows, batch.ts)
        step_s = np.full(len(steps), np.nan)
        step_s[rows] = batch.step_s  # every rank's step time is the same; any one will do
        return Block(
            steps, ts, step_s, dense(batch.compute_s), dense(batch.comm_s), dense(batch.data_s)
        )

    # -- hangs ---------------------------------------------------------------------------------
    def check_hangs(self, now: float, *, only: Iterable[str] | None = None) -> list[HangEvent]:
        """Jobs without progress for the hang timeout (once per stall); ``only`` limits the
        check to jobs known to be running."""
        events = []
        wanted = set(only) if only is not None else None
        for state in self._jobs.values():
            if wanted is not None and state.job_id not in wanted:
                continue
            stalled = now - state.last_ts
            if stalled < self.params.hang_timeout_s or state.hang_reported_at is not None:
                continue
            seen = np.flatnonzero(state.rank_step >= 0)
            if not len(seen):
                continue
            state.hang_reported_at = now
            steps, times = state.rank_step[seen], state.rank_ts[seen]
            lowest = int(steps.min())
            first = seen[steps == lowest]
            if len(first) == len(seen):  # all at the same step: the earliest to report it
                first = seen[times - float(times.min()) < 1e-3]
            firsts = sorted(int(r) for r in first)[:16]
            events.append(
                HangEvent(
                    job_id=state.job_id,
                    step=lowest,
                    ts=now,
                    stalled_s=round(stalled, 1),
                    first_stopped=firsts,
                    nodes=sorted({state.rank_node[r] for r in firsts}),
                    attempt=max(state.attempt, 0),
                )
            )
        return events


def _own(batch: RecordBatch) -> RecordBatch:
    """``batch`` in arrays of its own: a view of a cycle's decoded columns (the service's
    decoder hands each job a slice) would keep all of them while the records wait."""
    return batch.take(np.arange(len(batch))) if batch.rank.base is not None else batch


def _step_counts(step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct steps (sorted) and how many records each has; a count over the span of
    step numbers where that is small (the usual case), else a sort."""
    low = int(step.min())
    span = int(step.max()) - low + 1
    if span > 4 * len(step) + 1024:
        steps, counts = np.unique(step, return_counts=True)
        return steps, counts
    per_step = np.bincount(step - low, minlength=span)
    offsets = np.flatnonzero(per_step)
    return offsets + low, per_step[offsets]
