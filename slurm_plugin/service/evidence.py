"""Evidence rules: which telemetry records the service believes, and what corroborates them.

A job's user controls what its ranks publish. So records only count when they fit what Slurm
says about the job: the node is one of the job's nodes, the rank is below the job's nodes x
``MAX_RANKS_PER_NODE``, the attempt is not in the future, a record of Slurm's current attempt
is not stamped before that attempt started (a reused job id's leftovers), and a rank stays on
the node it was first seen on within an attempt. Everything else is dropped and
counted by reason. Hardware evidence (sidecar GPU samples, the prolog's findings) is outside the
job's control and is attached to every straggler decision.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
import structlog

from slurm_plugin.errors import StragglerError
from slurm_plugin.model import keys
from slurm_plugin.model.cluster import MAX_RANKS_PER_NODE, JobInfo
from slurm_plugin.store.nodes import LAST_CHECK, SIDECAR

if TYPE_CHECKING:
    from slurm_plugin.service.state import ServiceState
    from slurm_plugin.store.telemetry_store import TelemetryStore

log = structlog.get_logger(__name__)

#: Throttle reasons that say the GPU itself is being slowed (not idle, not app clocks).
SLOWING_THROTTLES = frozenset(
    {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)
#: A GPU running below this share of its max SM clock under load is evidence.
LOW_CLOCK_SHARE = 0.7
#: A record of the job's current attempt stamped this long before Slurm says the attempt
#: started is not this run's (nodes' clocks and Slurm's may differ by a few seconds).
START_SLACK_S = 30.0


def _ranks_allowed(job: JobInfo) -> int:
    """Ranks a job may claim: its nodes x ``MAX_RANKS_PER_NODE``."""
    return max(1, job.node_count, len(job.nodes)) * MAX_RANKS_PER_NODE


@dataclass
class _JobView:
    attempt: int = -1
    rank_nodes: dict[int, str] = field(default_factory=dict)
    #: The job re-formed its ranks inside this attempt (it left nodes on advice: torch
    #: elastic numbers the ranks anew): a rank seen on another node is bound there.
    regroup: bool = False

    #: Per rank, the index in ``nodes`` of the node it is bound to (-2: not bound), for
    #: the nodes, bindings and attempt of the key (a running job's cycles share them).
    _expect: tuple[tuple[object, ...], np.ndarray] | None = None

    def all_bound(self, rank: np.ndarray, node_code: np.ndarray, nodes: Sequence[str]) -> bool:
        """Every record's rank is already bound, to the node the record names (the common
        cycle of a running job: nothing to bind, nothing moved)."""
        bound = self.rank_nodes
        # Bindings only grow within an attempt, except when the job regrouped (not kept).
        key = (tuple(nodes), len(bound), self.attempt)
        if self.regroup or self._expect is None or self._expect[0] != key:
            codes = {name: i for i, name in enumerate(nodes)}
            expect = np.full(max(bound, default=-1) + 1, -2, dtype=np.int64)
            for r, node in bound.items():
                expect[r] = codes.get(node, -3)
            self._expect = (key, expect)
        expect = self._expect[1]
        if int(rank.max()) >= len(expect):
            return False
        return bool((expect[rank] == node_code).all())


def _before_start(job: JobInfo, attempt: np.ndarray, ts: np.ndarray | None) -> np.ndarray:
    """Records of Slurm's current attempt stamped before it started (``START_SLACK_S``
    allowed): a reused job id's leftover telemetry, of a job the service never saw end."""
    if ts is None or job.start_time is None or not math.isfinite(job.start_time):
        return np.zeros(len(attempt), dtype=bool)
    early: np.ndarray = (attempt == job.restarts) & (ts < job.start_time - START_SLACK_S)
    return early


@dataclass
class EvidenceFilter:
    """Keeps, per running job, the rank -> node binding of its current attempt."""

    _jobs: dict[str, _JobView] = field(default_factory=dict)

    def judge(
        self,
        job: JobInfo,
        rank: np.ndarray,
        node_code: np.ndarray,
        nodes: Sequence[str],
        attempt: np.ndarray,
        ts: np.ndarray | None = None,
    ) -> tuple[np.ndarray, Counter[str]]:
        """Per record, in stream order (arrays; a record's node is ``nodes[node_code]``, its
        time ``ts``: None, not judged by time): believe it or not; those not believed are
        counted by reason."""
        view = self._jobs.setdefault(job.job_id, _JobView())
        early = _before_start(job, attempt, ts)
        if not early.any() and self._as_expected(view, job, rank, node_code, nodes, attempt):
            return np.ones(len(rank), dtype=bool), Counter()
        job_nodes = set(job.nodes)
        allowed = np.array([n in job_nodes for n in nodes], dtype=bool)
        foreign = ~allowed[node_code] if len(nodes) else np.zeros(len(rank), dtype=bool)
        out_of_range = ~foreign & (rank >= _ranks_allowed(job))
        future = ~foreign & ~out_of_range & (attempt > job.restarts)
        early &= ~foreign & ~out_of_range & ~future
        keep = ~foreign & ~out_of_range & ~future & ~early
        moved = np.zeros(len(rank), dtype=bool)
        rows = np.flatnonzero(keep)
        # The attempt in force at each record: the highest seen so far (a record of an older
        # attempt is believed as it is; within the newest, a rank stays on its first node).
        current = np.maximum.accumulate(np.concatenate(([view.attempt], attempt[rows])))[1:]
        for value in np.unique(current) if len(rows) else []:
            if value > view.attempt:
                view.attempt, view.rank_nodes, view.regroup = int(value), {}, False
            mine = rows[(current == value) & (attempt[rows] == value)]
            moved[mine] = self._moved(view, rank[mine], node_code[mine], nodes)
        keep &= ~moved
        dropped: Counter[str] = Counter()
        for reason, mask in (
            ("foreign_node", foreign),
            ("rank_out_of_range", out_of_range),
            ("future_attempt", future),
            ("before_start", early),
            ("rank_moved", moved),
        ):
            if mask.any():
                dropped[reason] = int(mask.sum())
        return keep, dropped

    @staticmethod
    def _as_expected(
        view: _JobView,
        job: JobInfo,
        rank: np.ndarray,
        node_code: np.ndarray,
        nodes: Sequence[str],
        attempt: np.ndarray,
    ) -> bool:
        """The common cycle, checked cheaply: every record of the attempt in force (which is
        Slurm's), on one of the job's nodes, in range, its rank on the node it is bound to.
        Anything else goes through the rules one by one."""
        if not len(rank) or view.attempt != job.restarts:
            return False
        if int(attempt.min()) != view.attempt or int(attempt.max()) != view.attempt:
            return False
        job_nodes = set(job.nodes)
        if not all(n in job_nodes for n in nodes):
            return False
        if int(rank.max()) >= _ranks_allowed(job):
            return False
        return view.all_bound(rank, node_code, nodes)

    @staticmethod
    def _moved(
        view: _JobView, rank: np.ndarray, node_code: np.ndarray, nodes: Sequence[str]
    ) -> np.ndarray:
        """Which of these records (of the attempt in force, in order) have a rank off the
        node it was first seen on; binds the ranks seen for the first time."""
        if view.regroup:  # the newest record of a rank says where it runs now
            for r, code in zip(rank.tolist(), node_code.tolist(), strict=True):
                view.rank_nodes[r] = nodes[code]
            return np.zeros(len(rank), dtype=bool)
        ranks, first, inverse = np.unique(rank, return_index=True, return_inverse=True)
        codes = {name: i for i, name in enumerate(nodes)}
        bound = np.empty(len(ranks), dtype=np.int64)
        for i, (r, at) in enumerate(zip(ranks.tolist(), first.tolist(), strict=True)):
            node = view.rank_nodes.setdefault(r, nodes[node_code[at]])
            bound[i] = codes.get(node, -1)
        return np.asarray(node_code != bound[inverse])

    def forget(self, job_id: str) -> None:
        """Drop one job."""
        self._jobs.pop(job_id, None)

    def regrouped(self, job_id: str) -> None:
        """The job left nodes inside its allocation on advice and re-forms its ranks: until its
        next attempt a rank may turn up on another of its nodes (bound there, not dropped)."""
        self._jobs.setdefault(job_id, _JobView()).regroup = True

    def forget_all_but(self, running: Iterable[str]) -> None:
        """Drop every job not in ``running``."""
        keep = set(running)
        for job_id in [j for j in self._jobs if j not in keep]:
            del self._jobs[job_id]


def hardware_evidence(
    samples: Sequence[Mapping[str, Any]],
    node: str,
    gpus: Iterable[int] = (),
    last_check: Mapping[str, Any] | None = None,
) -> list[str]:
    """What the sidecar's recent samples and the node's last prolog check say is wrong with
    ``node`` (its GPUs ``gpus``, or all of them when empty); [] when nothing corroborates."""
    wanted = set(gpus)
    found: set[str] = set()
    for sample in samples:
        if sample.get("node") != node:
            continue
        for gpu in sample.get("gpus") or []:
            if not isinstance(gpu, Mapping) or (wanted and gpu.get("index") not in wanted):
                continue
            index = gpu.get("index")
            for reason in set(gpu.get("throttle_reasons") or []) & SLOWING_THROTTLES:
                found.add(f"gpu{index} {reason}")
            for xid in gpu.get("xids") or []:
                found.add(f"gpu{index} xid {xid}")
            low = _low_clock(gpu)
            if low:
                found.add(f"gpu{index} {low}")
    for finding in (last_check or {}).get("findings") or []:
        if isinstance(finding, Mapping) and finding.get("severity") in {"drain", "warn"}:
            found.add(f"prolog {finding.get('check')}: {finding.get('message', '')}")
    return sorted(found)


def _low_clock(gpu: Mapping[str, Any]) -> str:
    """ "sm clock X/Y MHz" when a busy GPU runs below LOW_CLOCK_SHARE of its max clock."""
    clock, top = gpu.get("sm_clock_mhz"), gpu.get("sm_clock_max_mhz")
    if "gpu_idle" in (gpu.get("throttle_reasons") or []):
        return ""
    if not isinstance(clock, int | float) or not isinstance(top, int | float) or top <= 0:
        return ""
    return f"sm clock {clock:.0f}/{top:.0f} MHz" if clock < LOW_CLOCK_SHARE * top else ""


def gather_evidence(
    state: ServiceState,
    store: TelemetryStore,
    job_id: str,
    node: str,
    gpus: Sequence[int],
    now: float,
    max_age_s: float,
) -> tuple[list[str], list[str]]:
    """(trusted, job-reported) hardware evidence about ``node``. Trusted: the root-run node
    sidecar's latest sample, when it is at most ``max_age_s`` from ``now`` (a sidecar that
    stopped a week ago says nothing of the node today), and the prolog's last check;
    job-reported: the job's own gpu stream (an in-job sidecar), which the job's user could
    forge, so it never corroborates, and what a stale sample said, marked so."""
    try:
        raw = state.node(node)
        sample = json.loads(raw[SIDECAR]) if raw.get(SIDECAR) else None
        last_check = json.loads(raw.get(LAST_CHECK) or "{}")
        reported_samples = store.read_json(keys.job_gpu(job_id), count=50)
    except (StragglerError, redis.RedisError, ValueError, TypeError) as exc:
        log.warning("service.evidence_unreadable", job_id=job_id, node=node, error=str(exc))
        return [], []
    if not isinstance(last_check, dict):
        last_check = {}
    fresh, stale = [], []
    if isinstance(sample, dict):
        age = sample_age(sample, now)
        if age is not None and abs(age) <= max_age_s:
            fresh.append(sample)
        else:
            when = "with no time" if age is None else f"{age:.0f} s old"
            found = hardware_evidence([sample], node, gpus)
            stale = [f"stale sidecar sample ({when}, not evidence): {f}" for f in found]
    trusted = hardware_evidence(fresh, node, gpus, last_check)
    return trusted, hardware_evidence(reported_samples, node, gpus) + stale


def sample_age(sample: Mapping[str, Any], now: float) -> float | None:
    """Seconds since the sample was taken; None when it carries no finite time."""
    ts = sample.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        return None
    return now - float(ts)
