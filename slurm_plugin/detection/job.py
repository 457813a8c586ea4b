"""The per-job detector: dense blocks of steps x ranks in, events out (pure, numpy).

Per step each rank's compute time is normalised against the cross-rank median and a robust
spread (1.4826 x MAD, smoothed over steps, with a floor), clipped, and fed to a bank of
one-sided CUSUM charts per rank and per node. The charts' references are multiples of half the
smallest slowdown worth acting on; their thresholds split the target false-alarm ARL. Steps in
which every rank slows down move the median, not the scores, so they cancel. A separate chart
on data-loading time finds input stragglers; a job-level chart on the smallest collective
wait finds sync stalls (:mod:`slurm_plugin.detection.sync`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from slurm_plugin.detection.events import Event, StragglerEvent, SyncStallEvent
from slurm_plugin.detection.params import F64, DetectionParams, cusum_thresholds
from slurm_plugin.detection.stats import (
    MAD_TO_SIGMA,
    cusum,
    ewma,
    row_median,
)
from slurm_plugin.detection.sync import SyncStallChart

#: Threshold of the input (data-loading) chart. Its increments are a rank's excess data time
#: over its peers' median, in units of ``input_min_slowdown_pct``, clipped to [-1, 2], less
#: 0.5: loading twice that minimum crosses it in ~6 steps, at the minimum in ~16.
_INPUT_THRESHOLD = 8.0
#: A chart never holds more than this many thresholds of evidence: over it while a shift
#: lasts, back under it within a few steps once the shift is over.
_CAP = 2.0


def _node_references(ks: list[F64], ranks: F64, arl: float) -> tuple[list[F64], list[F64]]:
    """The node charts' references and thresholds per row and node. A node of ``n`` ranks
    slowed by a shift of d rank-spreads moves its score by d sqrt(n): its reference is the
    ranks' (half the smallest slowdown worth acting on) times sqrt(n), so a node-wide shift
    smaller than that minimum never alarms however many ranks carry it."""
    counts, where = np.unique(ranks, return_inverse=True)
    where = where.reshape(ranks.shape)
    rows = np.arange(ranks.shape[0])[:, None]
    out_k, out_h = [], []
    for k in ks:
        scaled = np.sqrt(counts)[:, None] * k[None, :]  # (counts, rows)
        h = cusum_thresholds(scaled, arl)
        out_k.append(scaled[where, rows])
        out_h.append(h[where, rows])
    return out_k, out_h


#: Steps between false "the slowdown ended" of a chart that watches a shift go away (a false
#: end only splits an episode: it costs far less than a false alarm, so it may come sooner).
_END_ARL = 1e4


def _what_if(b: Block) -> tuple[F64, F64]:
    """Each rank's raw ready time (compute and data loading) and each step's time."""
    ready = b.compute + np.where(np.isfinite(b.data), b.data, 0.0)
    return ready, b.step_s if b.step_s.ndim == 1 else row_median(b.step_s)


def _job_loss_pct(ready: F64, step: F64, node_ranks: np.ndarray) -> float | None:
    """The share of the job's step time (%) that the node's ranks cost it over these steps:
    a synchronous step waits for the slowest rank, so without the node it would end when
    the slowest of the other ranks is ready (a what-if over the steps, never the node's own
    slowdown: among many noisy ranks a slower GPU adds only what it exceeds the slowest of
    the rest by). None when there is nothing to compare with."""
    rest = np.ones(ready.shape[1], dtype=bool)
    rest[node_ranks] = False
    if not rest.any() or not len(ready):
        return None
    everyone = np.fmax.reduce(ready, axis=1)
    without = np.fmax.reduce(np.where(rest[None, :], ready, np.nan), axis=1)
    gain = np.where(np.isfinite(everyone) & np.isfinite(without), everyone - without, np.nan)
    ok = np.isfinite(gain) & np.isfinite(step) & (step > 0)
    if not ok.any():
        return None
    return round(100.0 * float(np.sum(np.maximum(gain[ok], 0.0)) / np.sum(step[ok])), 2)


def _run_start(scores: F64, k: float) -> int:
    """Index where the CUSUM run that ends at the last score began (after its last zero):
    the steps that carry the shift, over which the slowdown is estimated."""
    s, start = 0.0, 0
    for i, value in enumerate(scores.tolist()):
        s = max(0.0, s + value - k)
        if s == 0.0:
            start = i + 1
    return min(start, len(scores) - 1)


_MAX_ROWS = 1024


@dataclass
class Block:
    """Complete steps of one job attempt as dense matrices (rows: steps, columns: ranks)."""

    steps: np.ndarray
    ts: F64
    step_s: F64
    compute: F64
    comm: F64
    data: F64

    def rows(self, begin: int, end: int) -> Block:
        """A slice of the rows."""
        s = slice(begin, end)
        return Block(
            self.steps[s], self.ts[s], self.step_s[s], self.compute[s], self.comm[s], self.data[s]
        )


@dataclass
class _Tail:
    """Rows of per-rank deviations (relative excess over the median, scores) and their times,
    for attributing an alarm; ``offset`` is the row where the current block starts."""

    excess_compute: F64
    excess_data: F64
    z: F64
    #: Each rank's raw compute plus data loading (what it brings to the collective), and
    #: each step's time: the what-if of the job without a node.
    ready: F64
    step: F64
    ts: F64
    offset: int = 0


@dataclass
class JobDetector:
    """Detection state of one attempt of one job."""

    job_id: str
    params: DetectionParams
    attempt: int = 0
    rank_node: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rank_gpu: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    node_names: list[str] = field(default_factory=list)
    steps_done: int = 0
    #: Per rank, the peer group it belongs to (the same work: a pipeline stage...); -1 when
    #: the job gave none. Labelled groups set the structure; without labels it is inferred.
    rank_group: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        n = len(self.rank_node)
        charts = self.params.charts
        self._spread = math.nan
        self._node_spread = math.nan
        self._rank_s = np.zeros((charts, n))
        self._node_s = np.zeros((charts, len(self.node_names)))
        self._end_rank = np.zeros(n)
        self._end_node = np.zeros(len(self.node_names))
        self._input_s = np.zeros(n)
        # (node, kind) -> (step, time) from which its re-arm period counts (its last report).
        self._flagged: dict[tuple[str, str], tuple[int, float]] = {}
        # (node, kind) -> (when its slowdown began, step and time of its last report, and
        # which end chart tells it is over).
        self._episodes: dict[tuple[str, str], tuple[float, int, float, tuple[str, int]]] = {}
        self._tail: _Tail | None = None
        # Per kind, the current block's rows x nodes on which every chart of the node was
        # under its threshold, the block's times; and per kind and node the last such time
        # before the block.
        self._calm: dict[str, np.ndarray] = {}
        self._block_ts = np.zeros(0)
        self._calm_ts: dict[str, F64] = {}
        self._sync = SyncStallChart(self.params)
        self._alpha = 1.0 - 0.5 ** (1.0 / self.params.spread_halflife_steps)
        self._order = np.argsort(self.rank_node, kind="stable")
        nodes_sorted = self.rank_node[self._order]
        self._node_starts = np.flatnonzero(np.r_[True, nodes_sorted[1:] != nodes_sorted[:-1]])
        self._node_of_group = nodes_sorted[self._node_starts] if n else nodes_sorted
        # Structure: per rank, the log of its by-design compute offset, learned at the end of
        # the warm-up; compute is divided by ``_scale`` (exp(offset), None while there is no
        # structure) before anything else.
        self._offset = np.zeros(n)
        self._scale: np.ndarray | None = None
        self._warm_log = np.zeros(n)
        self._warm_log2 = np.zeros(n)
        self._warm_n = np.zeros(n)
        self._warm_target: int | None = None  # steps_done at which the warm-up ends
        self._warm_start = 0  # steps_done at which it began (later after a rank came late)
        self.learned = False
        #: What was taken for structure: offset (%), ranks, nodes; for logs and tests.
        self.structure: list[dict[str, object]] = []

    @property
    def world(self) -> int:
        """Ranks this detector knows."""
        return len(self.rank_node)

    # -- entry point ---------------------------------------------------------------------------
    def process(self, block: Block) -> list[Event]:
        """Feed complete steps (in step order); return the events they raise."""
        events: list[Event] = []
        # Zero medians, empty rows and the like yield NaN/inf, which the code masks out.
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for begin in range(0, len(block.steps), _MAX_ROWS):
                part = block.rows(begin, begin + _MAX_ROWS)
                target = self._warmup_target(part)
                cut = target - self.steps_done
                if not self.learned and 0 < cut < len(part.steps):  # the warm-up ends inside
                    events += self._process(part.rows(0, cut))
                    part = part.rows(cut, len(part.steps))
                if not self.learned and self.steps_done >= target:
                    self._learn_structure()
                events += self._process(part)
                if not self.learned and self.steps_done >= target:
                    self._learn_structure()
        return events

    def adopt(self, older: JobDetector) -> None:
        """Take over from the detector this one replaces (a rank appeared late). The warm-up
        saw only part of the job, so what it learned (structure, baselines) may be wrong: a
        fresh warm-up as long as the first starts here and learns again over every rank."""
        self.steps_done = older.steps_done
        if older._warm_target is not None:
            first = older._warm_target - older._warm_start
            self._warm_start = older.steps_done
            self._warm_target = older.steps_done + first

    # -- warm-up and structure -----------------------------------------------------------------
    def _warmup_target(self, b: Block) -> int:
        """Steps of warm-up: ``warmup_steps``, or fewer when they would take longer than
        ``warmup_s`` (at least 3), judged on the first steps' median time."""
        if self._warm_target is None:
            p = self.params
            step = float(np.nanmedian(b.step_s)) if np.isfinite(b.step_s).any() else math.nan
            target = p.warmup_steps
            span = p.warmup_s / step if math.isfinite(step) and step > 0 else math.inf
            if span < p.warmup_steps:
                target = min(p.warmup_steps, max(3, math.ceil(span)))
            self._warm_target = target
        return self._warm_target

    def _learn_structure(self) -> None:
        """At the end of the warm-up: a labelled peer group's common offset, ranks that share
        a compute offset across several nodes, and a local GPU position that is offset on
        most nodes (each node holds a whole pipeline) are structure, not stragglers: from now
        on each is compared with its own baseline. A lone rank or a single node that is slow
        from the start stays a straggler."""
        self.learned = True
        p = self.params
        n = np.maximum(self._warm_n, 1)
        base = np.where(self._warm_n > 0, self._warm_log / n, np.nan)
        # Noise is each rank's own step-to-step spread (the cross-rank spread would count the
        # structure as noise). An offset shared by ranks on several nodes is a mean over all
        # their warm-up steps: it must stand above four times that mean's error.
        own = np.sqrt(np.maximum(self._warm_log2 / n - base**2, 0.0))
        jitter = float(np.nanmedian(own)) if np.isfinite(own).any() else 0.0
        floor = p.spread_floor_pct / 100.0
        shared = max(floor, 4.0 * max(jitter, floor) / math.sqrt(float(np.nanmax(n))))
        groups: list[np.ndarray] = []
        labels = self.rank_group if len(self.rank_group) == self.world else np.full(self.world, -1)
        inferred = labels < 0
        for label in np.unique(labels[labels >= 0]).tolist():
            members = np.flatnonzero((labels == label) & np.isfinite(base))
            if len(members) >= 3:
                groups.append(members)  # labelled: always compared within the group
            else:  # too small a group to compare within: its structure is inferred
                inferred[labels == label] = True
        unlabelled = np.flatnonzero(inferred & np.isfinite(base) & (np.abs(base) > shared))
        groups += self._shared_offsets(unlabelled, base, shared)
        for members in groups:
            offset = float(np.median(base[members]))
            labelled = not bool(inferred[members[0]])
            if abs(offset) <= (floor if labelled else shared):
                continue
            self._offset[members] = offset
            self.structure.append(
                {
                    "offset_pct": round(math.expm1(offset) * 100.0, 1),
                    "ranks": len(members),
                    "nodes": sorted({self.node_names[i] for i in self.rank_node[members]}),
                    "rank_ids": [int(r) for r in members[:32]],
                }
            )
        self._scale = np.exp(self._offset) if self.structure else None
        self._spread = math.nan  # the spread seen so far included the structure

    def _shared_offsets(self, candidates: np.ndarray, base: F64, shared: float) -> list[np.ndarray]:
        """Clusters of ``candidates`` with one offset (sorted by offset, split at gaps) that
        cover whole nodes (most of a node's ranks) on at least ``structure_min_nodes`` nodes,
        or one local GPU position on most of the job's nodes (and at least as many)."""
        p = self.params
        order = candidates[np.argsort(base[candidates], kind="stable")]
        if not len(order):
            return []
        values = base[order]
        gaps = np.diff(values) > np.maximum(2.0 * shared, 0.25 * np.abs(values[1:]))
        per_node = np.bincount(self.rank_node, minlength=len(self.node_names))
        job_nodes = int(np.count_nonzero(per_node))
        found: list[np.ndarray] = []
        for cluster in np.split(order, np.flatnonzero(gaps) + 1):
            if len(cluster) < 2:
                continue
            # A by-design offset covers nodes (a pipeline stage, another GPU model): a node
            # counts when most of its ranks share it, never for one rank that happens to.
            inside = np.bincount(self.rank_node[cluster], minlength=len(per_node))
            nodes = np.flatnonzero(2 * inside > per_node)
            rest = cluster
            if len(nodes) >= p.structure_min_nodes:
                whole = np.isin(self.rank_node[cluster], nodes)
                found.append(cluster[whole])
                rest = cluster[~whole]
            if len(self.rank_gpu) != self.world:
                continue
            # A local GPU position offset on most nodes: the stage each node holds there.
            gpus = self.rank_gpu[rest]
            for gpu in np.unique(gpus).tolist():
                at = rest[gpus == gpu]
                spread = len(np.unique(self.rank_node[at]))
                if spread >= max(p.structure_min_nodes, (job_nodes + 1) // 2):
                    # The position on every node (some ranks' estimates fell under the
                    # threshold by chance; their node holds the same stage there).
                    found.append(np.flatnonzero((self.rank_gpu == gpu) & np.isfinite(base)))
        return found

    def _process(self, b: Block) -> list[Event]:
        p = self.params
        rows = len(b.steps)
        c = b.compute / self._scale[None, :] if self._scale is not None else b.compute
        med_c = row_median(c)
        valid_rows = (np.sum(np.isfinite(c), axis=1) >= p.min_world_size) & (med_c > 0)
        # Relative deviations: slowdowns are relative, and a step where every rank slows
        # down by the same factor (checkpoint, global stall) changes nothing here.
        rel = c / med_c[:, None] - 1.0
        mad = row_median(np.abs(rel)) * MAD_TO_SIGMA
        smooth = ewma(np.where(valid_rows, mad, np.nan), self._alpha, self._spread)
        if rows and np.isfinite(smooth[-1]):
            self._spread = float(smooth[-1])
        # This step's own spread also bounds the scale from below: a burst of extra noise
        # on every rank must not look like many stragglers.
        spread = np.fmax(np.fmax(smooth, mad), p.spread_floor_pct / 100.0)
        spread = np.where(valid_rows, spread, np.nan)
        z = np.clip(rel / spread[:, None], -p.clip, p.clip)
        z = np.where(np.isfinite(z), z, 0.0)

        warm_rows = max(0, min(rows, (self._warm_target or 0) - self.steps_done))
        live = valid_rows.copy()
        live[:warm_rows] = False
        self.steps_done += rows
        if warm_rows and not self.learned:
            log_ratio = np.log(c[:warm_rows] / med_c[:warm_rows, None])
            ok = np.isfinite(log_ratio) & valid_rows[:warm_rows, None]
            self._warm_log += np.where(ok, log_ratio, 0.0).sum(axis=0)
            self._warm_log2 += np.where(ok, log_ratio**2, 0.0).sum(axis=0)
            self._warm_n += ok.sum(axis=0)

        # The bank's smallest reference, in units of each rank's spread: half the smallest
        # slowdown worth acting on; the other charts double it. At most half the clip: a
        # chart whose reference reaches the clip never alarms, however slow the rank (a
        # policy's 40 % minimum on ranks with 1 % noise would never see a node 2x slow).
        k_base = np.clip(0.5 * p.min_slowdown_pct / 100.0 / spread, 0.1, 0.5 * p.clip)
        k_base = np.where(live, k_base, 1.0)
        arl = p.false_alarm_arl * p.charts
        ks = [k_base * 2.0**i for i in range(p.charts)]
        hs = [cusum_thresholds(k, arl) for k in ks]

        # A chart raises an alarm only on a step its rank (or a rank of its node) measured: a
        # rank gone silent while its chart is high is not reported with nothing to show.
        rank_hit = self._charts(z, ks, hs, live, self._rank_s)
        rank_hit = np.where(np.isfinite(c), rank_hit, 0.0)
        node_hit, ended = self._node_charts(z, c, ks, live, arl)

        med_d = row_median(b.data)
        excess_c = (c - med_c[:, None]) / med_c[:, None]
        excess_d = (b.data - med_d[:, None]) / med_c[:, None]
        input_inc = np.clip(excess_d / (p.input_min_slowdown_pct / 100.0), -1.0, 2.0)
        input_inc = np.where(np.isfinite(input_inc) & live[:, None], input_inc - 0.5, 0.0)
        input_s = cusum(input_inc, self._input_s)
        self._input_s = input_s[-1] if rows else self._input_s
        input_hit = (input_s > _INPUT_THRESHOLD) & np.isfinite(b.data)

        window = self._window(_Tail(excess_c, excess_d, z, *_what_if(b), b.ts))
        self._block_ts, self._calm = (
            b.ts,
            {**ended, "input:node": self._calm_rows(input_s / _INPUT_THRESHOLD)},
        )
        events: list[Event] = []
        events += self._straggler_events(b, rank_hit, node_hit, input_hit, k_base, window)
        self._keep_calm()
        warm_done = self.steps_done >= (self._warm_target or 0)
        stall = self._sync.process(b.comm, b.step_s, med_c, warm_rows, valid_rows, warm_done)
        if stall is not None:
            step, ts, rise_pct = int(b.steps[stall[0]]), float(b.ts[stall[0]]), stall[1]
            events.append(SyncStallEvent(self.job_id, step, ts, rise_pct, self.attempt))
        return events

    # -- CUSUM banks -------------------------------------------------------------------------
    @staticmethod
    def _charts(scores: F64, ks: list[F64], hs: list[F64], live: np.ndarray, state: F64) -> F64:
        """Run every chart over the block; return per row and column the largest S/h.
        References and thresholds are per row (one value for every column) or per row and
        column."""
        ratio = np.zeros_like(scores)
        for i, (k, h) in enumerate(zip(ks, hs, strict=True)):
            k2, h2 = (k, h) if k.ndim == 2 else (k[:, None], h[:, None])
            inc = np.where(live[:, None], scores - k2, 0.0)
            s = cusum(inc, state[i], _CAP * h2)
            if len(s):
                state[i] = s[-1]
            ratio = np.maximum(ratio, s / np.where(h2 > 0, h2, np.inf))
        return ratio

    def _node_charts(
        self, z: F64, c: F64, ks: list[F64], live: np.ndarray, arl: float
    ) -> tuple[F64, dict[str, np.ndarray]]:
        """The node charts' S/h per row and node (0 where no rank of the node measured), and
        whether each rank's and node's slowdown, if any, has ended (:meth:`_ended`)."""
        node_z, node_measured, node_n = self._node_scores(z, c)
        node_ks, node_hs = _node_references(ks, node_n, arl)
        node_hit = self._charts(node_z, node_ks, node_hs, live, self._node_s)
        end_k, end_h = _node_references(ks[:1], node_n, _END_ARL)
        ended = self._ended(z, ks[0], node_z, end_k[0], end_h[0], live)
        return np.where(node_measured, node_hit, 0.0), ended

    def _ended(
        self, z: F64, k: F64, node_z: F64, node_k: F64, node_h: F64, live: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Per row and rank, and per row and node: back under half the smallest slowdown
        worth acting on. Downward CUSUMs (increments k - score) against a threshold
        for ``_END_ARL``: a shift that ended is seen as over within about h/k steps, however
        long it lasted, where the alarm charts, holding evidence up to their cap, drain for
        much longer in noisy jobs."""
        h = cusum_thresholds(k, _END_ARL)[:, None]
        # Capped at twice the threshold: one noisy step of a healthy rank never makes the
        # node look slow again.
        d = cusum(np.where(live[:, None], k[:, None] - z, 0.0), self._end_rank, _CAP * h)
        dn = cusum(np.where(live[:, None], node_k - node_z, 0.0), self._end_node, _CAP * node_h)
        if len(d):
            self._end_rank, self._end_node = d[-1], dn[-1]
        return {
            "compute:rank": d >= h * (1.0 - 1e-9),
            "compute:node": dn >= node_h * (1.0 - 1e-9),
        }

    def _node_scores(self, z: F64, c: F64) -> tuple[F64, np.ndarray, F64]:
        """Per node: sum of its ranks' scores / sqrt(reporting ranks) (N(0,1) when healthy,
        divided by the inflation when its ranks move together), whether any of its ranks
        reported the step, and how many did."""
        shape = (z.shape[0], len(self.node_names))
        if not len(self.node_names) or not z.shape[1]:
            return np.zeros(shape), np.zeros(shape, dtype=bool), np.ones(shape)
        zs = z[:, self._order]
        present = np.isfinite(c[:, self._order]).astype(np.float64)
        sums = np.add.reduceat(zs, self._node_starts, axis=1)
        counts = np.add.reduceat(present, self._node_starts, axis=1)
        scores = sums / np.sqrt(np.maximum(counts, 1.0))
        out = np.zeros(shape)
        out[:, self._node_of_group] = scores / self._node_inflation(scores)[:, None]
        measured = np.zeros(shape, dtype=bool)
        measured[:, self._node_of_group] = counts > 0
        reporting = np.ones(shape)
        reporting[:, self._node_of_group] = np.maximum(counts, 1.0)
        return out, measured, reporting

    def _node_inflation(self, scores: F64) -> F64:
        """Per row, how much wider the node scores spread across nodes than independent
        ranks would make them (at least 1). A node's ranks that share one load each step (a
        tensor-parallel group's sequence lengths) move together: they are one witness, not
        eight. A robust spread across at least four nodes, smoothed over steps like the
        ranks' spread, so a single slow node never widens it."""
        rows = scores.shape[0]
        if scores.shape[1] < 4 or not rows:
            return np.ones(rows)
        med = row_median(scores)
        wide = row_median(np.abs(scores - med[:, None])) * MAD_TO_SIGMA
        smooth = ewma(wide, self._alpha, self._node_spread)
        if np.isfinite(smooth[-1]):
            self._node_spread = float(smooth[-1])
        return np.where(np.isfinite(smooth), np.maximum(1.0, np.fmax(smooth, wide)), 1.0)

    # -- attribution ---------------------------------------------------------------------------
    def _window(self, block: _Tail) -> _Tail:
        """Block rows preceded by the tail of earlier blocks; keeps the new tail."""
        keep = self.params.attribution_steps
        names = [f.name for f in fields(_Tail) if f.name != "offset"]
        if self._tail is not None and self._tail.z.shape[1] == block.z.shape[1]:
            rows: dict[str, Any] = {
                n: np.concatenate([getattr(self._tail, n), getattr(block, n)]) for n in names
            }
            joined = replace(block, **rows)
        else:
            joined = block
        joined.offset = joined.z.shape[0] - block.z.shape[0]
        self._tail = _Tail(*(getattr(joined, n)[-keep:] for n in names))
        return joined

    def _straggler_events(
        self,
        b: Block,
        rank_hit: F64,
        node_hit: F64,
        input_hit: np.ndarray,
        k_base: F64,
        window: _Tail,
    ) -> list[Event]:
        p = self.params
        # Per chart (kind, rank or None for a node chart, node index): the rows where it is
        # over its threshold. A chart is reported at its first such row, and again at its first
        # such row a re-arm period after the node's last report, also within one block (a
        # replay feeds a thousand steps at once; the service a few).
        charts: list[tuple[str, int | None, int, F64, np.ndarray]] = []
        sources = (
            ("compute", rank_hit, False),
            ("compute", node_hit, True),
            ("input", np.where(input_hit, 1.0, 0.0), False),
        )
        for kind, hits, is_node in sources:
            rows, cols = np.nonzero(hits >= 1.0)
            order = np.argsort(cols, kind="stable")  # by column, rows ascending within
            rows, cols = rows[order], cols[order]
            if not len(cols):
                continue
            for start, stop in itertools.pairwise(
                np.flatnonzero(np.r_[True, cols[1:] != cols[:-1], True]).tolist()
            ):
                col = int(cols[start])
                node_of = col if is_node else int(self.rank_node[col])
                charts.append(
                    (kind, None if is_node else col, node_of, hits[:, col], rows[start:stop])
                )
        queue = [
            (int(hit_rows[0]), kind, -float(scores[hit_rows[0]]), i)
            for i, (kind, _, _, scores, hit_rows) in enumerate(charts)
        ]
        heapq.heapify(queue)
        events: list[Event] = []
        while queue:
            row, kind, neg_score, i = heapq.heappop(queue)
            _, rank, node_index, scores, hit_rows = charts[i]
            node = self.node_names[node_index]
            reported = self._flagged.get((node, kind))
            due = reported is None or self._rearmed(reported, int(b.steps[row]), float(b.ts[row]))
            event = (
                self._attribute(b, row, kind, rank, node_index, -neg_score, k_base, window)
                if due
                else None
            )
            if event is not None and math.isfinite(event.slowdown_pct):  # else nothing to show
                event = self._same_episode(event, kind)
                minimum = p.min_slowdown_pct if kind == "compute" else p.input_min_slowdown_pct
                # Flagged early in a shift, the estimate (a mean since the shift began) can
                # still be below the minimum: look again soon rather than a re-arm period later.
                soon = 0.9 if event.slowdown_pct < minimum else 0.0
                reported = (
                    event.step - int(soon * p.rearm_steps),
                    event.ts - soon * p.rearm_s,
                )
                self._flagged[(node, kind)] = reported
                events.append(event)
            # This chart's next chance: its first hit a re-arm period after the last report.
            later = hit_rows[hit_rows > row]
            if len(later) and reported is not None:
                later = later[self._rearmed(reported, b.steps[later], b.ts[later])]
            if len(later):
                heapq.heappush(queue, (int(later[0]), kind, -float(scores[later[0]]), i))
        return events

    def _rearmed(self, reported: tuple[int, float], step: Any, ts: Any) -> Any:
        """A re-arm period (steps or seconds, whichever first) has passed since ``reported``."""
        p = self.params
        return (step - reported[0] >= p.rearm_steps) | (ts - reported[1] >= p.rearm_s)

    def _calm_rows(self, rank_ratio: F64) -> np.ndarray:
        """Per row and node: every rank's input chart is under its threshold, so a data
        loading excess there, if any, has ended."""
        shape = (rank_ratio.shape[0], len(self.node_names))
        if not len(self.node_names) or not rank_ratio.shape[1]:
            return np.ones(shape, dtype=bool)
        highest = np.maximum.reduceat(rank_ratio[:, self._order], self._node_starts, axis=1)
        most = np.zeros(shape)
        most[:, self._node_of_group] = highest
        calm: np.ndarray = most < 1.0
        return calm

    def _keep_calm(self) -> None:
        """After a block: each node's last calm step, for the blocks to come."""
        rows = len(self._block_ts)
        for kind, calm in self._calm.items():
            if rows:
                last = rows - 1 - np.argmax(calm[::-1], axis=0)
                was = self._calm_ts.get(kind, np.full(calm.shape[1], -np.inf))
                self._calm_ts[kind] = np.where(calm.any(axis=0), self._block_ts[last], was)

    def _watch(self, event: StragglerEvent, kind: str) -> tuple[str, int]:
        """What tells that ``event``'s slowdown ended: its rank's end chart (one GPU), its
        node's (node-wide), or the node's input charts."""
        if kind == "input":
            return "input:node", self.node_names.index(event.node)
        if event.scope == "gpu" and event.ranks:
            return "compute:rank", int(event.ranks[0])
        return "compute:node", self.node_names.index(event.node)

    def _ended_between(self, watch: tuple[str, int], after: float, before: float) -> bool:
        """The slowdown ``watch`` follows ended after ``after`` and before ``before``."""
        key, index = watch
        calm = self._calm.get(key)
        if calm is None or index >= calm.shape[1]:
            return False
        ts = self._block_ts
        if bool(np.any(calm[:, index] & (ts > after) & (ts < before))):
            return True
        earlier = self._calm_ts.get(key)  # up to the end of the previous block
        return earlier is not None and float(earlier[index]) > after

    def _same_episode(self, event: StragglerEvent, kind: str) -> StragglerEvent:
        """A node reported again within two re-arm periods of its last report, with no step
        in between on which that report's slowdown was seen to have ended, is the same
        slowdown going on: it began when that one began (how long a slowdown has lasted is
        what tells a passing burst from a lasting fault). A slowdown that ended is over: the
        next one is a new episode, with its own age."""
        key = (event.node, kind)
        previous = self._episodes.get(key)
        since = event.since_ts
        p = self.params
        if (
            previous is not None
            and (
                event.step - previous[1] <= 2 * p.rearm_steps
                or event.ts - previous[2] <= 2 * p.rearm_s
            )
            and not self._ended_between(previous[3], previous[2], event.ts)
        ):
            since = previous[0] if since is None else min(previous[0], since)
        start = since if since is not None else event.ts
        self._episodes[key] = (start, event.step, event.ts, self._watch(event, kind))
        return replace(event, since_ts=since) if since != event.since_ts else event

    def _attribute(
        self,
        b: Block,
        row: int,
        kind: str,
        rank: int | None,
        node_index: int,
        score: float,
        k_base: F64,
        window: _Tail,
    ) -> StragglerEvent:
        """Build the event: which ranks, node-wide or one GPU, how much slower."""
        keep = self.params.attribution_steps
        at = window.offset + row
        lo, hi = max(0, at - keep + 1), at + 1
        node_ranks = np.flatnonzero(self.rank_node == node_index)
        own = [rank] if rank is not None else node_ranks
        # The steps that carry the shift: since the alarming CUSUM run began.
        lo += _run_start(window.z[lo:hi][:, own].mean(axis=1), float(k_base[row]))
        excess = window.excess_data if kind == "input" else window.excess_compute
        mean_z = window.z[lo:hi][:, node_ranks].mean(axis=0)
        # Only ranks that measured the alarming step can be named.
        mean_z = np.where(np.isfinite(excess[at, node_ranks]), mean_z, -np.inf)
        deviating = node_ranks[mean_z > k_base[row]]
        node_wide = (
            kind == "compute"
            and len(node_ranks) >= 2
            and len(deviating) / len(node_ranks) >= self.params.node_fraction
        )
        if node_wide:
            ranks = [int(x) for x in deviating]
        elif rank is not None:
            ranks = [rank]
        else:
            ranks = [int(node_ranks[int(np.argmax(mean_z))])]
        slowdown = float(np.nanmean(excess[lo:hi][:, ranks])) * 100.0
        job_loss = _job_loss_pct(window.ready[lo:hi], window.step[lo:hi], node_ranks)
        # It began when the step before its first slow one ended.
        since = float(window.ts[lo - 1] if lo > 0 else window.ts[lo])
        return StragglerEvent(
            job_id=self.job_id,
            node=self.node_names[node_index],
            gpu=None if node_wide else int(self.rank_gpu[ranks[0]]),
            ranks=ranks,
            step=int(b.steps[row]),
            ts=float(b.ts[row]),
            score=round(score, 3),
            slowdown_pct=round(slowdown, 2),
            cause="input" if kind == "input" else "compute",
            scope="node" if node_wide else "gpu",
            attempt=self.attempt,
            since_ts=since if math.isfinite(since) else None,
            job_loss_pct=job_loss,
        )
