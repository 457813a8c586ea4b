"""The backtest's decisions: :func:`decide` on the trace's clock, as the service decides.

The jobs are what the trace and its companions (:mod:`slurm_plugin.trace_meta`) say: running,
requeueable, started at ``start_ts`` (else at their first record), with a time limit when
``end_limit_ts`` is given, reporting checkpoints when ``checkpoint_end`` events are given. The
cluster is the trace's nodes plus the spare nodes the rails ask for; nothing is paused.

A ``wait`` (``when = after_checkpoint``) is resolved as the service resolves it: at the job's
next checkpoint, or once ``max_wait_s`` has passed, the node is evicted if it is still slow
(the service's re-check, on the trace's newest steps up to then) and the verdict still says so;
a wait still open when the job's records end stays ``wait``. After an eviction the node is
out of the job: later reports of it there are ``none`` (the trace goes on as recorded).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.detection.params import DetectionParams
from slurm_plugin.detection.recheck import rows_of, tail_slowdown_pct
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.decide import ClusterContext, Decision, JobContext
from slurm_plugin.policy.lifecycle import (
    UNKNOWN,
    Advise,
    Candidate,
    Close,
    Effect,
    Evict,
    Joined,
    Missed,
    Rechecking,
    Record,
    Waiting,
    World,
    detected,
    ended,
    tick,
)
from slurm_plugin.policy.rails import SafetyPolicy
from slurm_plugin.policy.schema import Policy
from slurm_plugin.trace import Trace
from slurm_plugin.trace_meta import TraceContext

#: The service's cycle, as the replay assumes it: a re-check with nothing to look at is taken
#: again one cycle later.
CYCLE_S = 2.0


@dataclass
class _Waiting:
    """A job's waiting decision (the lifecycle's state), and its backtest row."""

    state: Waiting
    row: dict[str, Any]
    #: When a re-check had nothing to look at: decided again then (the service's next cycle).
    again_at: float | None = None


@dataclass
class Replay:
    """What the decision engine needs that a trace does not say, and what the replay did."""

    policy: Policy
    trace: Trace
    context: TraceContext = field(default_factory=TraceContext)
    safety: SafetyPolicy = field(default_factory=SafetyPolicy)
    jobs: dict[str, JobInfo] = field(default_factory=dict)
    cluster: tuple[NodeInfo, ...] = ()
    evictions: dict[str, list[float]] = field(default_factory=dict)
    excluded: dict[str, set[str]] = field(default_factory=dict)
    waiting: dict[str, _Waiting] = field(default_factory=dict)
    #: Per job, its first and last record's time.
    first_ts: dict[str, float] = field(default_factory=dict)
    last_ts: dict[str, float] = field(default_factory=dict)
    #: Per job, when a wait ran out without a checkpoint.
    missed: dict[str, float] = field(default_factory=dict)
    #: Per job, the nodes it was advised to leave (recovery = advice).
    advised: dict[str, set[str]] = field(default_factory=dict)
    step_s: dict[str, float] = field(default_factory=dict)
    #: Per straggler event (by ``id``), its job's per-rank by-design compute factor when the
    #: event came (``Detector.structure_scale``; None or absent: no structure).
    scales: dict[int, np.ndarray | None] = field(default_factory=dict)
    #: The service's cycle: a re-check with nothing to look at is taken again one later.
    cycle_s: float = CYCLE_S
    #: Called with each eviction carried out, and when (node history: the backtest's).
    on_evict: Callable[[Evict, float], None] | None = None
    #: Per job, the structure its newest decided event came with (what the re-check uses).
    _scale: dict[str, np.ndarray | None] = field(default_factory=dict)
    #: Per job, the attempt it was requeued from for a slowdown there since its first steps.
    from_start_requeued: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        codes = self.trace.job_code
        last = np.full(len(self.trace.job_names), -np.inf)
        np.maximum.at(last, codes, self.trace.ts)
        self.last_ts = dict(zip(self.trace.job_names, last.tolist(), strict=True))
        first = np.full(len(self.trace.job_names), np.inf)
        np.minimum.at(first, codes, self.trace.ts)
        self.first_ts = dict(zip(self.trace.job_names, first.tolist(), strict=True))
        self._params = DetectionParams(**self.policy.detection.model_dump())

    def _job(self, name: str) -> JobInfo:
        if name not in self.jobs:
            mine = self.trace.job_code == self.trace.job_names.index(name)
            codes = np.flatnonzero(np.bincount(self.trace.node_code[mine])).tolist()
            nodes = tuple(sorted(self.trace.node_names[c] for c in codes))
            facts = self.context.jobs.get(name)
            start = self.first_ts[name]
            if facts is not None and facts.start_ts is not None:
                start = min(start, facts.start_ts)
            limit = None
            if facts is not None and facts.end_limit_ts is not None:
                limit = max(0.0, facts.end_limit_ts - start)
            self.jobs[name] = JobInfo(
                job_id=name,
                name="",
                state="RUNNING",
                reason="",
                nodes=nodes,
                excluded=(),
                restarts=0,
                requeue=True,
                comment="",
                admin_comment="",
                partition="trace",
                node_count=len(nodes),
                user="",
                time_limit_s=limit,
                start_time=start,
            )
        return self.jobs[name]

    def _recent_slowdown_pct(
        self, event: StragglerEvent, now: float, since_step: int, steps: int = 20
    ) -> float | None:
        """The service's re-check before an eviction (:func:`tail_slowdown_pct`, the one
        statistic), on the rows the job's detector would hold at ``now``: the job's records
        of the newest ``4 x steps`` step times up to ``now``, from the step the node was
        flagged at on, as detector rows (:func:`rows_of`, each rank's compute divided by its
        by-design factor as the job's detector learned it, ``scales``). The event's ranks on
        its node, as the service asks it."""
        trace = self.trace
        begin = now - 4 * steps * self._step(event.job_id)
        lo, hi = np.searchsorted(trace.ts, [begin, now], side="right")
        part = slice(int(lo), int(hi))
        in_job = (trace.job_code[part] == trace.job_names.index(event.job_id)) & (
            trace.step[part] >= since_step
        )
        if not in_job.any():
            return None
        rank = trace.rank[part][in_job]
        excess, numbers, scale = rows_of(
            trace.step[part][in_job],
            rank,
            trace.compute_s[part][in_job],
            self._scale.get(event.job_id),
        )
        on_node = trace.node_code[part][in_job] == trace.node_names.index(event.node)
        return tail_slowdown_pct(
            excess, numbers, np.unique(rank[on_node]), event.ranks, since_step, steps, scale
        )

    def _step(self, job_id: str) -> float:
        """The job's typical step time (its first records)."""
        if job_id not in self.step_s:
            mine = self.trace.job_code == self.trace.job_names.index(job_id)
            self.step_s[job_id] = float(np.median(self.trace.step_s[mine][:10_000]))
        return self.step_s[job_id]

    def _cluster(self) -> tuple[NodeInfo, ...]:
        if not self.cluster:
            # The partition is taken to have room for one eviction's nodes (a trace does not
            # say what else it holds).
            room = self.safety.min_spare_nodes + self.safety.max_nodes_per_eviction
            spares = [f"spare-{i}" for i in range(room)]
            names = sorted({*self.trace.node_names, *spares})
            self.cluster = tuple(NodeInfo(n, "idle", (), "", ("trace",)) for n in names)
        return self.cluster

    def _context(self, job_id: str, now: float, node_incidents: int) -> JobContext:
        done = self.evictions.get(job_id, [])
        checkpoints = self.context.checkpoints(job_id)
        known = checkpoints[: bisect.bisect_right(checkpoints, now)]
        waiting = self.waiting.get(job_id)
        missed = self.missed.get(job_id)
        overdue = missed is not None and (not known or known[-1] <= missed)
        return JobContext(
            evictions=len(done),
            last_eviction_ts=done[-1] if done else None,
            last_checkpoint_ts=known[-1] if known else None,
            reports_checkpoints=bool(known) and not overdue,
            checkpoint_period_s=_period(known),
            waiting_since=waiting.state.since if waiting else None,
            node_incidents=node_incidents,
            from_start_requeued=self.from_start_requeued.get(job_id),
        )

    def _world(self, job_id: str, now: float) -> World:
        """The facts of ``now`` for the lifecycle, as the service gathers them."""
        recent = sum(1 for ts in itertools.chain(*self.evictions.values()) if now - ts < 3600)
        cluster = ClusterContext(
            nodes=self._cluster(), evictions_last_hour=recent, safety=self.safety
        )
        job = self._job(job_id)
        gone = tuple(sorted(self.excluded.get(job_id, ())))
        if gone:
            kept = tuple(n for n in job.nodes if n not in gone)
            job = replace(job, nodes=kept, excluded=gone)

        def probe(event: StragglerEvent, since_step: int) -> float | None:
            return self._recent_slowdown_pct(event, now, since_step)

        advised = frozenset(self.advised.get(job_id, ()))
        context = self._context(job_id, now, 0)
        return World(job, self.policy, context, cluster, now, probe, advised=advised)

    def decide(
        self,
        event: StragglerEvent,
        row: dict[str, Any],
        node_incidents: int = 0,
        peers: Callable[[], tuple[Candidate, ...]] = lambda: (),
    ) -> None:
        """Put the service's verdict on ``event`` at its time into its detection ``row`` (a
        wait's row is completed when the wait is resolved); ``node_incidents``: other jobs of
        the trace that saw the node slow before; ``peers``: the job's other nodes flagged
        within the same service cycle (they may go in the same requeue)."""
        self._scale[event.job_id] = self.scales.get(id(event))
        if event.node in self.excluded.get(event.job_id, ()):
            row.update(action="none", reasons=["evicted from the job before"])
            return
        held = self.waiting.get(event.job_id)
        world = replace(self._world(event.job_id, event.ts), peers=peers)
        state, effects, decision = detected(
            held.state if held else None, event, node_incidents, str(id(row)), world
        )
        row.update(_row(decision))
        if held is not None and state is held.state:  # a node already waited on
            row.update(action="wait", reasons=["a decision already waits for this node"])
        for effect in effects:
            if isinstance(effect, Joined) and held is not None:
                row.update(action="wait", reasons=[*decision.reasons, "joined the waiting one"])
                self.waiting[event.job_id] = replace(held, state=effect.waiting)
            elif isinstance(effect, Record):
                row.update(action=effect.decision.action, **effect.extra)
                if effect.state == "waiting" and state is not None:
                    again = event.ts + self.cycle_s if state.waiting_for == "recheck" else None
                    self.waiting[event.job_id] = _Waiting(state, row, again)
            elif isinstance(effect, Close) and held is not None:
                self._carry_out(event.job_id, effect, held.row, event.ts)
            elif isinstance(effect, Advise) and state is not None:
                self._carry_out(event.job_id, effect, row, event.ts)
                self.waiting[event.job_id] = _Waiting(state, row)
            else:
                self._carry_out(event.job_id, effect, row, event.ts)
        if state is None:
            self.waiting.pop(event.job_id, None)

    def _carry_out(self, job_id: str, effect: Effect, row: dict[str, Any], now: float) -> None:
        """One effect of the lifecycle, in memory (``row``: the decision's backtest row)."""
        if isinstance(effect, Evict):
            self.evictions.setdefault(job_id, []).append(now)
            if effect.event.from_start:
                self.from_start_requeued[job_id] = effect.event.attempt
            self.excluded.setdefault(job_id, set()).update(effect.nodes)
            row.update(_row(effect.decision), action="evict", **effect.extra)
            row["nodes"] = list(effect.nodes)
            if effect.after != "detection":
                row.update(node=effect.event.node, acted_ts=now, after=effect.after)
            if self.on_evict is not None:
                self.on_evict(effect, now)
        elif isinstance(effect, Close):
            if effect.abandoned:  # a wait still open when the job's records end stays a wait
                row["note"] = effect.note
            elif effect.note:
                row.update(action="none", note=effect.note)
            else:
                row.update(action="none", reasons=[*row["reasons"], *effect.reasons])
        elif isinstance(effect, Advise):  # a replayed job never acts on it: its deadline
            self.advised.setdefault(job_id, set()).update(effect.nodes)
            row.update(_row(effect.decision), action="advise", **effect.extra)
            row["nodes"] = list(effect.nodes)
        elif isinstance(effect, Missed):
            self.missed[job_id] = effect.now
        elif isinstance(effect, Rechecking):
            row.update(waiting_for="recheck", reasons=[*row["reasons"], UNKNOWN])

    def _due(self, job_id: str, w: _Waiting) -> float:
        """When the waiting decision is next decided again (the trace's clock)."""
        if w.state.waiting_for == "recheck":
            return w.again_at if w.again_at is not None else w.state.since
        if w.state.waiting_for == "resume":  # nothing is ever paused in a replay
            return float("inf")
        if w.state.waiting_for == "advice":
            return w.state.since + self.policy.actions.advice_deadline_s
        checkpoints = self.context.checkpoints(job_id)
        after = checkpoints[bisect.bisect_left(checkpoints, w.state.since) :]
        limit = w.state.since + self.policy.actions.max_wait_s
        return float(min(after[0] if after else np.inf, limit))

    def until(self, now: float, *, before: bool = False) -> None:
        """Resolve every wait whose checkpoint came, or whose ``max_wait_s`` ran out, by
        ``now`` (and before the job's records end); ``before``: only those due before
        ``now``. The service decides a cycle's detections first and its waiting decisions
        after them (a node flagged in the cycle a checkpoint came joins the re-decision), so
        the replay resolves what is due at an event's time after deciding the event."""
        for job_id in list(self.waiting):
            w = self.waiting[job_id]
            due = self._due(job_id, w)
            end = self.last_ts[job_id]
            while due <= end and (due < now if before else due <= now):
                state, effects = tick(w.state, self._world(job_id, due))
                w.row["waited_s"] = round(due - w.state.since, 3)
                for effect in effects:
                    self._carry_out(job_id, effect, w.row, due)
                if state is None:
                    del self.waiting[job_id]
                    break
                w = self.waiting[job_id] = replace(w, state=state, again_at=due + self.cycle_s)
                due = self._due(job_id, w)

    def end(self) -> None:
        """The trace ended: every job's waiting decision is abandoned, as the service
        abandons those of jobs that stopped running (its row stays ``wait``)."""
        for job_id, w in list(self.waiting.items()):
            _, effects = ended(w.state.decision_id)
            for effect in effects:
                self._carry_out(job_id, effect, w.row, self.last_ts[job_id])
            del self.waiting[job_id]


def _row(decision: Decision) -> dict[str, Any]:
    return {
        "action": decision.action,
        "reasons": decision.reasons,
        "saved_s": decision.saved_s,
        "cost_s": decision.cost_s,
        "lasted_s": decision.lasted_s,
        "expected_s": decision.expected_s,
        "lasting_p": decision.lasting_p,
        "inputs": decision.inputs,
    }


def _period(checkpoints: list[float]) -> float | None:
    """The job's checkpoint period as its checkpoints so far show it (None: unknown)."""
    if len(checkpoints) < 2:
        return None
    return float(np.median(np.diff(checkpoints[-8:])))
