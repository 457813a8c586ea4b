"""Replay a trace through the detector, the decision engine and node history, as the service
would (pure).

Several jobs are replayed together in ts order, so node history carries across them; hangs are
looked for at each chunk boundary, for jobs whose records go on later in the trace, and at the
end for a job whose records stop inside a step. Each straggler's ``action`` is what
:func:`decide` answers on the trace's own clock (:mod:`slurm_plugin.replay`: time limits and
checkpoints from the trace's companions, waits resolved at the job's checkpoint, the policy's
limits and the evictions the replay itself decided).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slurm_plugin.detection import Detector, Event, RecordBatch, StragglerEvent
from slurm_plugin.model.cluster import MAX_RANKS_PER_NODE
from slurm_plugin.policy.decide import is_node_slow
from slurm_plugin.policy.history import (
    HistoryParams,
    Incident,
    NodeHistory,
    other_jobs,
    record_incident,
    slow_elsewhere,
)
from slurm_plugin.policy.lifecycle import Candidate, Evict, peers_of
from slurm_plugin.policy.rails import PersistencePolicy
from slurm_plugin.policy.schema import Policy
from slurm_plugin.replay import Replay
from slurm_plugin.trace import Trace
from slurm_plugin.trace_meta import TraceContext

CHUNK = 131_072


@dataclass
class BacktestResult:
    """Detections (in ts order) and the nodes that ended up persistent."""

    detections: list[dict[str, Any]] = field(default_factory=list)
    persistent_nodes: list[str] = field(default_factory=list)
    records: int = 0
    late_records: int = 0
    #: Records whose rank is beyond what the job's nodes can hold (the service's evidence
    #: rule, ``rank_out_of_range``): dropped before detection.
    out_of_range: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON form."""
        return {"detections": self.detections, "persistent_nodes": self.persistent_nodes}


def _peers(
    events: list[Event],
    i: int,
    cycle_s: float,
    policy: Policy,
    histories: dict[str, NodeHistory],
    params: HistoryParams,
) -> Callable[[], tuple[Candidate, ...]]:
    """:func:`~slurm_plugin.policy.lifecycle.peers_of` ``events[i]`` among the events of its
    service cycle (those at its very time, and after it within ``cycle_s``; ``events`` in ts
    order), each node with its incidents then (asked only of an eviction)."""

    def peers() -> tuple[Candidate, ...]:
        event = events[i]
        if not isinstance(event, StragglerEvent):
            return ()
        start = i
        while start > 0 and events[start - 1].ts == event.ts:
            start -= 1
        later = itertools.islice(events, start, None)
        cycle = itertools.takewhile(lambda e: e.ts < event.ts + cycle_s, later)

        def incidents(node: str) -> int:
            history = histories.get(node, NodeHistory(node))
            return other_jobs(history, event.job_id, event.ts, params)

        return peers_of(event, cycle, policy, incidents)

    return peers


def _detection(
    event: Event,
    policy: Policy,
    replay: Replay,
    node_incidents: int = 0,
    peers: Callable[[], tuple[Candidate, ...]] = lambda: (),
) -> dict[str, Any]:
    data = event.to_dict()
    if isinstance(event, StragglerEvent):
        rank = event.ranks[0] if event.ranks else None
        row: dict[str, Any] = {
            "job_id": event.job_id,
            "node": event.node,
            "rank": rank,
            "gpu": event.gpu,
            "step": event.step,
            "ts": event.ts,
            "cause": event.cause,
            "cusum_ratio": event.cusum_ratio,
        }
    else:
        nodes = data.get("nodes") or [None]
        firsts = data.get("first_stopped") or [None]
        row = {
            "job_id": event.job_id,
            "node": nodes[0],
            "rank": firsts[0],
            "gpu": None,
            "step": event.step,
            "ts": event.ts,
            "cause": event.kind,
            "cusum_ratio": None,
        }
    if isinstance(event, StragglerEvent):
        replay.decide(event, row, node_incidents, peers)
    else:
        row["action"] = "none" if policy.actions.mode == "off" else "report"
    row["kind"] = event.kind
    row["details"] = {k: v for k, v in data.items() if k not in row}
    return row


def run_backtest(
    trace: Trace,
    policy: Policy,
    persistence: PersistencePolicy | None = None,
    *,
    context: TraceContext | None = None,
) -> BacktestResult:
    """Replay ``trace`` under ``policy``, node history under ``persistence`` (the service's
    [persistence] setting; its defaults when None), the jobs' time limits and checkpoints
    from ``context`` (the trace's companions; assumed absent when None)."""
    detector = Detector(policy.detection.params())
    hist_params = (persistence or PersistencePolicy()).params()
    histories: dict[str, NodeHistory] = {}
    result = BacktestResult(records=len(trace))
    trace, result.out_of_range = _in_range(trace)
    if not len(trace):
        return result
    job_codes, names = trace.job_code, trace.job_names
    attempts = infer_attempts(job_codes, trace.rank, trace.step)
    restarted = bool(attempts.any())
    last_ts = np.full(len(names), -np.inf)
    np.maximum.at(last_ts, job_codes, trace.ts)
    events: list[Event] = []
    scales: dict[int, np.ndarray | None] = {}  # per straggler event: its job's structure then
    bounds = _chunk_bounds(job_codes, trace.ts, policy.detection.hang_timeout_s)
    node_names = np.asarray(trace.node_names, dtype=object)
    groups = np.asarray(trace.group_names, dtype=object) if trace.labelled else None
    # Node history as detection goes (the decisions' own is rebuilt below, event by event):
    # a job's detector learns which of its nodes other jobs saw slow before it started.
    seen: dict[str, NodeHistory] = {}
    started: set[tuple[int, int]] = set()
    for begin, end in itertools.pairwise(bounds):
        now = float(trace.ts[begin])
        events += detector.check_hangs(
            now, only=[names[j] for j in np.flatnonzero(last_ts > now).tolist()]
        )
        chunk_jobs = job_codes[begin:end]
        found: list[Event] = []
        for code in np.flatnonzero(np.bincount(chunk_jobs)).tolist():
            in_job = begin + np.flatnonzero(chunk_jobs == code)
            # A restart inside the chunk: each attempt is replayed, and closed, in turn.
            for attempt in np.flatnonzero(np.bincount(attempts[in_job])).tolist():
                idx = in_job[attempts[in_job] == attempt] if restarted else in_job
                if (code, attempt) not in started:  # an attempt runs on nodes of its own
                    started.add((code, attempt))
                    on = node_names[np.unique(trace.node_code[idx])].tolist()
                    detector.suspect(
                        names[code], _slow_before(seen, on, names[code], now, hist_params)
                    )
                detector.add(
                    names[code],
                    _batch(trace, idx, attempts, node_names, groups),
                )
                if attempt != attempts[in_job].max():
                    closed = detector.advance_job(names[code], final=True)
                    found += _noting(detector, scales, closed)
        found += _noting(detector, scales, detector.advance(final=end == len(trace)))
        events += _incidents(seen, found, policy, hist_params)
    events += _hangs_at_the_end(detector, names, last_ts, float(trace.ts[-1]), policy)
    events.sort(key=lambda e: e.ts)
    replay = Replay(
        policy,
        trace,
        context or TraceContext(),
        scales=scales,
        on_evict=functools.partial(_evicted, histories, params=hist_params),
    )
    for i, event in enumerate(events):
        replay.until(event.ts, before=True)
        past = 0
        if isinstance(event, StragglerEvent):
            history = histories.get(event.node, NodeHistory(event.node))
            past = other_jobs(history, event.job_id, event.ts, hist_params)
        peers = _peers(events, i, replay.cycle_s, policy, histories, hist_params)
        result.detections.append(_detection(event, policy, replay, past, peers))
        _incident(histories, event, policy, hist_params)
    replay.until(np.inf)
    replay.end()
    result.persistent_nodes = sorted(n for n, h in histories.items() if h.state == "persistent")
    result.late_records = detector.late_records
    return result


def _slow_before(
    seen: dict[str, NodeHistory], nodes: list[str], job: str, now: float, params: HistoryParams
) -> list[str]:
    """The job's nodes that other jobs saw slow before ``now`` (what its detector is told)."""
    return slow_elsewhere([seen[n] for n in nodes if n in seen], job, now, params)


def _incidents(
    histories: dict[str, NodeHistory], found: list[Event], policy: Policy, params: HistoryParams
) -> list[Event]:
    """``found`` (one chunk's events), each slowdown recorded in ts order; returned as is."""
    for event in sorted(found, key=lambda e: e.ts):
        _incident(histories, event, policy, params)
    return found


def _incident(
    histories: dict[str, NodeHistory], event: Event, policy: Policy, params: HistoryParams
) -> None:
    """A straggler whose node is slow under ``policy`` into its node's history, as the
    service's node rails record it."""
    if isinstance(event, StragglerEvent) and is_node_slow(event, policy):
        _record(histories, event, event.ts, params)


def _evicted(
    histories: dict[str, NodeHistory],
    effect: Evict,
    now: float,
    *,
    params: HistoryParams,
) -> None:
    """An eviction carried out into its nodes' history, as the service records it
    (:meth:`~slurm_plugin.policy.lifecycle.Evict.event_on`)."""
    for node in effect.nodes:
        _record(histories, effect.event_on(node), now, params, evicted=True)


def _record(
    histories: dict[str, NodeHistory],
    event: StragglerEvent,
    ts: float,
    params: HistoryParams,
    *,
    evicted: bool = False,
) -> None:
    node = event.node
    histories[node] = record_incident(
        histories.get(node, NodeHistory(node)),
        Incident(
            event.job_id,
            ts,
            event.slowdown_pct,
            event.cause,
            since_ts=event.since_ts,
            lasted_s=event.lasted_s,
            evicted=evicted,
        ),
        params,
        distinct_users=False,
    ).history


def _noting(
    detector: Detector, scales: dict[int, np.ndarray | None], events: list[Event]
) -> list[Event]:
    """``events``, each straggler's job's structure as its detector holds it when the event
    comes (the service's re-check divides the same out: a by-design offset is no slowdown)."""
    for event in events:
        if isinstance(event, StragglerEvent):
            scales[id(event)] = detector.structure_scale(event.job_id)
    return events


def _in_range(trace: Trace) -> tuple[Trace, int]:
    """``trace`` without the records whose rank is at or beyond the job's nodes in the trace x
    ``MAX_RANKS_PER_NODE``, as the service's evidence rules drop them; and how many."""
    if not len(trace) or int(trace.rank.max()) < MAX_RANKS_PER_NODE:
        return trace, 0  # every job has a node: nothing can be out of range
    pairs = np.unique(trace.job_code.astype(np.int64) * len(trace.node_names) + trace.node_code)
    nodes_per_job = np.bincount(pairs // len(trace.node_names), minlength=len(trace.job_names))
    ok = trace.rank < nodes_per_job[trace.job_code] * MAX_RANKS_PER_NODE
    if ok.all():
        return trace, 0
    return trace.take(ok), int((~ok).sum())


def _batch(
    trace: Trace,
    idx: np.ndarray,
    attempts: np.ndarray,
    node_names: np.ndarray,
    group_names: np.ndarray | None,
) -> RecordBatch:
    return RecordBatch(
        rank=trace.rank[idx],
        step=trace.step[idx],
        attempt=attempts[idx],
        gpu=trace.gpu[idx],
        ts=trace.ts[idx],
        step_s=trace.step_s[idx],
        compute_s=trace.compute_s[idx],
        comm_s=trace.comm_s[idx],
        data_s=trace.data_s[idx],
        node=node_names[trace.node_code[idx]],
        group=None if group_names is None else group_names[trace.group_code[idx]],
    )


def _hangs_at_the_end(
    detector: Detector, names: list[str], last_ts: np.ndarray, end: float, policy: Policy
) -> list[Event]:
    """A job whose records stop inside a step (some ranks never reported it) while the trace
    goes on past the hang timeout hung: reported when the service would have seen it."""
    timeout = policy.detection.hang_timeout_s
    events: list[Event] = []
    for name, last in zip(names, last_ts.tolist(), strict=True):
        if end - last >= timeout and detector.last_step_incomplete(name):
            events += detector.check_hangs(last + timeout, only=[name])
    return events


def _chunk_bounds(job_codes: np.ndarray, ts: np.ndarray, hang_timeout_s: float) -> list[int]:
    """Chunk starts: every CHUNK records, and wherever a job resumes after a silence longer
    than the hang timeout (so the hang check runs inside the silence)."""
    starts = set(range(0, len(ts), CHUNK))
    order = _stable_order(job_codes)
    gap = np.r_[
        False,
        (job_codes[order][1:] == job_codes[order][:-1]) & (np.diff(ts[order]) >= hang_timeout_s),
    ]
    starts.update(order[gap].tolist())
    return [*sorted(starts), len(ts)]


def infer_attempts(job_codes: np.ndarray, rank: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Attempts are not in the trace format: when a rank's step number goes back (the job was
    restarted and resumed from a checkpoint), that rank's records start a new attempt.
    ``job_codes``, ``rank`` and ``step`` must be in ts order."""
    n = len(step)
    attempts = np.zeros(n, dtype=np.int64)
    if not n:
        return attempts
    width = int(rank.max()) + 1
    if width * (int(job_codes.max()) + 1) < 1 << 62:  # (job, rank) as one integer key
        key = job_codes.astype(np.int64) * width + rank
        order = _stable_order(key)  # by (job, rank), each rank's records still in ts order
        k = key[order]
        same = np.r_[False, k[1:] == k[:-1]]
    else:  # ranks too large to pack (a hostile trace): sort by both
        order = np.lexsort((np.arange(n), rank, job_codes))
        j, r = job_codes[order], rank[order]
        same = np.r_[False, (j[1:] == j[:-1]) & (r[1:] == r[:-1])]
    s = step[order]
    back = same & np.r_[False, s[1:] < s[:-1]]
    if not back.any():
        return attempts
    counts = np.cumsum(back)
    group_start = np.flatnonzero(~same)
    base = np.repeat(counts[group_start] - back[group_start], np.diff(np.r_[group_start, n]))
    attempts[order] = counts - base
    return attempts


def _stable_order(key: np.ndarray) -> np.ndarray:
    """The stable sort of non-negative integer keys; keys that fit in 16 bits take numpy's
    radix sort (several times faster on a million records than a comparison sort)."""
    if len(key) and int(key.max()) < 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")
