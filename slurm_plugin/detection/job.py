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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slurm_plugin.detection import structure
from slurm_plugin.detection.attribution import (
    job_loss_pct,
    level_spread,
    run_start,
    stand_out,
    transfer_excess,
)
from slurm_plugin.detection.block import MAX_ROWS, Block, what_if
from slurm_plugin.detection.charts import JobCharts
from slurm_plugin.detection.episodes import Episodes
from slurm_plugin.detection.events import (
    STAGE_MIN_JOB_NODES,
    Event,
    StragglerEvent,
    SyncStallEvent,
)
from slurm_plugin.detection.params import F64, DetectionParams
from slurm_plugin.detection.recheck import even_spread, tail_slowdown_pct
from slurm_plugin.detection.stats import (
    MAD_TO_SIGMA,
    cusum,
    envelope,
    ewma,
    ewma_columns,
    row_median,
)
from slurm_plugin.detection.structure import Layout, Warmup
from slurm_plugin.detection.sync import SyncStallChart
from slurm_plugin.detection.window import Window, join

#: Threshold of the input (data-loading) chart. Its increments are a rank's excess data time
#: over its peers' median, in units of ``input_min_slowdown_pct``, clipped to [-1, 2], less
#: 0.5: loading twice that minimum crosses it in ~6 steps, at the minimum in ~16.
_INPUT_THRESHOLD = 8.0


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
    #: Nodes other jobs saw slow lately: never this job's structure on their own.
    suspect_nodes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        n = len(self.rank_node)
        self._spread = math.nan
        self._input_s = np.zeros(n)
        # (node, kind) -> (step, time) from which its re-arm period counts (its last report).
        self._flagged: dict[tuple[str, str], tuple[int, float]] = {}
        self._tail: Window | None = None
        self._sync = SyncStallChart(self.params)
        self._alpha = 1.0 - 0.5 ** (1.0 / self.params.spread_halflife_steps)
        self._level_alpha = 1.0 - 0.5 ** (1.0 / self.params.level_halflife_steps)
        self._level = np.zeros(n)
        self._level_spread = math.nan
        self._level_steps = 0
        self._order = np.argsort(self.rank_node, kind="stable")
        nodes_sorted = self.rank_node[self._order]
        self._node_starts = np.flatnonzero(np.r_[True, nodes_sorted[1:] != nodes_sorted[:-1]])
        self._node_of_group = nodes_sorted[self._node_starts] if n else nodes_sorted
        self._charts = JobCharts(
            self.params,
            self._order,
            self._node_starts,
            self._node_of_group,
            len(self.node_names),
            self._alpha,
        )
        self._episodes = Episodes(
            self.params, self.node_names, self._order, self._node_starts, self._node_of_group
        )
        # Structure: per rank, the log of its by-design compute offset, learned at the end of
        # the warm-up; compute is divided by ``_scale`` (exp(offset), None while there is no
        # structure) before anything else.
        self._offset = np.zeros(n)
        self._scale: np.ndarray | None = None
        self._warm = Warmup(np.zeros(n), np.zeros(n), np.zeros(n))
        self._warm_target: int | None = None  # steps_done at which the warm-up ends
        self._warm_start = 0  # steps_done at which it began (later after a rank came late)
        self.learned = False
        #: What was taken for structure: offset (%), ranks, nodes; for logs and tests.
        self.structure: list[dict[str, object]] = []

    @property
    def world(self) -> int:
        """Ranks this detector knows."""
        return len(self.rank_node)

    @property
    def scale(self) -> np.ndarray | None:
        """Per rank, its by-design compute factor (exp of its structural offset) as learned
        at the end of the warm-up; None while nothing was taken for structure."""
        return self._scale

    # -- entry point ---------------------------------------------------------------------------
    def process(self, block: Block) -> list[Event]:
        """Feed complete steps (in step order); return the events they raise."""
        events: list[Event] = []
        # Zero medians, empty rows and the like yield NaN/inf, which the code masks out.
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for begin in range(0, len(block.steps), MAX_ROWS):
                part = block.rows(begin, begin + MAX_ROWS)
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
        """At the end of the warm-up (:mod:`slurm_plugin.detection.structure`)."""
        self.learned = True
        suspect = frozenset(i for i, n in enumerate(self.node_names) if n in self.suspect_nodes)
        layout = Layout(self.rank_node, self.rank_gpu, self.rank_group, self.node_names, suspect)
        self._offset, self.structure = structure.learn(self._warm, layout, self.params)
        self._scale = np.exp(self._offset) if self.structure else None
        self._spread = math.nan  # the spread seen so far included the structure
        self._level[:] = 0.0
        self._level_spread = math.nan
        self._level_steps = 0

    def _warm_up(self, c: F64, med_c: F64, valid_rows: np.ndarray) -> None:
        """Add warm-up rows to each rank's sums of log(compute / the step's median)."""
        log_ratio = np.log(c / med_c[:, None])
        ok = np.isfinite(log_ratio) & valid_rows[:, None]
        self._warm.log[:] += np.where(ok, log_ratio, 0.0).sum(axis=0)
        self._warm.log2[:] += np.where(ok, log_ratio**2, 0.0).sum(axis=0)
        self._warm.n[:] += ok.sum(axis=0)

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
            self._warm_up(c[:warm_rows], med_c[:warm_rows], valid_rows[:warm_rows])

        # The bank's smallest reference, in units of each rank's spread: half the smallest
        # slowdown worth acting on; the other charts double it. At most half the clip: a
        # chart whose reference reaches the clip never alarms, however slow the rank (a
        # policy's 40 % minimum on ranks with 1 % noise would never see a node 2x slow).
        k_base = np.clip(0.5 * p.min_slowdown_pct / 100.0 / spread, 0.1, 0.5 * p.clip)
        k_base = np.where(live, k_base, 1.0)
        rank_hit, node_hit, ended = self._charts.run(z, c, k_base, live)

        med_d = row_median(b.data)
        excess_c = (c - med_c[:, None]) / med_c[:, None]
        excess_d = (b.data - med_d[:, None]) / med_c[:, None]
        input_inc = np.clip(excess_d / (p.input_min_slowdown_pct / 100.0), -1.0, 2.0)
        input_inc = np.where(np.isfinite(input_inc) & live[:, None], input_inc - 0.5, 0.0)
        input_s = cusum(input_inc, self._input_s)
        self._input_s = input_s[-1] if rows else self._input_s
        input_hit = (input_s > _INPUT_THRESHOLD) & np.isfinite(b.data)

        ready = what_if(b, med_c, self._scale)
        level, spread_of_levels, level_age = self._levels(excess_c, live)
        window = self._window(
            Window(
                excess_c,
                excess_d,
                z,
                *ready,
                b.ts,
                b.steps.astype(float),
                b.comm,
                level,
                spread_of_levels,
                level_age,
                med_c,
            )
        )
        input_calm = self._episodes.input_calm(input_s / _INPUT_THRESHOLD)
        self._episodes.block(b.ts, {**ended, "input:node": input_calm})
        events: list[Event] = []
        events += self._straggler_events(b, rank_hit, node_hit, input_hit, k_base, window)
        self._episodes.close_block()
        warm_done = self.steps_done >= (self._warm_target or 0)
        stall = self._sync.process(b.comm, b.step_s, med_c, warm_rows, valid_rows, warm_done)
        if stall is not None:
            step, ts, rise_pct = int(b.steps[stall[0]]), float(b.ts[stall[0]]), stall[1]
            events.append(SyncStallEvent(self.job_id, step, ts, rise_pct, self.attempt))
        return events

    def _levels(self, excess_c: F64, live: np.ndarray) -> tuple[F64, F64, F64]:
        """Per row and rank, each rank's level (its relative excess compute over the live
        rows, smoothed over ``level_halflife_steps``), and per row the widest spread of
        levels within its nodes the job has shown, fading over four of those half-lives
        (:func:`attribution.stand_out` compares with them: a spread that happens to be
        tight among few ranks never makes a drifting rank look like a fault)."""
        level = ewma_columns(
            np.where(live[:, None], excess_c, np.nan), self._level_alpha, self._level
        )
        spread = envelope(
            level_spread(level, self._order, self._node_starts),
            0.5 ** (0.25 / self.params.level_halflife_steps),
            self._level_spread,
        )
        age = self._level_steps + np.cumsum(live)
        if len(level):
            self._level = level[-1].copy()
            self._level_steps = int(age[-1])
            if np.isfinite(spread[-1]):
                self._level_spread = float(spread[-1])
        return level, spread, age / self.params.level_halflife_steps

    # -- attribution ---------------------------------------------------------------------------
    def recent_slowdown_pct(
        self, node: str, ranks: Sequence[int] = (), since_step: int | None = None
    ) -> float | None:
        """The re-check on this detector's newest rows (detection/recheck.py); None: unknown."""
        tail = self._tail
        if tail is None or node not in self.node_names:
            return None
        on_node = np.flatnonzero(self.rank_node == self.node_names.index(node))
        return tail_slowdown_pct(
            tail.excess_compute, tail.number, on_node, ranks, since_step, scale=self._scale
        )

    def _window(self, block: Window) -> Window:
        """Block rows preceded by the tail of earlier blocks; keeps the new tail."""
        joined, self._tail = join(self._tail, block, self.params.attribution_steps)
        return joined

    def _straggler_events(
        self,
        b: Block,
        rank_hit: F64,
        node_hit: F64,
        input_hit: np.ndarray,
        k_base: F64,
        window: Window,
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
                event = self._episodes.same_episode(event, kind)
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

    def _others(self, node_index: int) -> np.ndarray:
        """The ranks on other nodes than ``node_index``, an even spread of them
        (:func:`even_spread`, as the re-check's peers: ~16 ms an event at 16,384 ranks for
        all of them): what a node's ranks are measured against."""
        return even_spread(np.flatnonzero(self.rank_node != node_index))

    @staticmethod
    def _peer_level(excess: F64, others: np.ndarray) -> F64:
        """Per row, the median compute of ``others`` (:meth:`_others`) relative to the job's
        median rank (1.0 for a job on one node, or a row where they measured nothing)."""
        if not len(others):
            return np.ones(len(excess))
        level = row_median(1.0 + excess[:, others])
        return np.where(np.isfinite(level) & (level > 0), level, 1.0)

    def _rearmed(self, reported: tuple[int, float], step: Any, ts: Any) -> Any:
        """A re-arm period (steps or seconds, whichever first) has passed since ``reported``."""
        p = self.params
        return (step - reported[0] >= p.rearm_steps) | (ts - reported[1] >= p.rearm_s)

    def _attribute(
        self,
        b: Block,
        row: int,
        kind: str,
        rank: int | None,
        node_index: int,
        cusum_ratio: float,
        k_base: F64,
        window: Window,
    ) -> StragglerEvent:
        """Build the event: which ranks, node-wide or one GPU, how much slower."""
        keep = self.params.attribution_steps
        at = window.offset + row
        lo, hi = max(0, at - keep + 1), at + 1
        node_ranks = np.flatnonzero(self.rank_node == node_index)
        own = [rank] if rank is not None else node_ranks
        # The steps that carry the shift: since the alarming CUSUM run began.
        lo += run_start(window.z[lo:hi][:, own].mean(axis=1), float(k_base[row]))
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
        # The other nodes' ranks: a compute straggler's peers (an input one has none here).
        peer_ranks = self._others(node_index) if kind == "compute" else node_ranks[:0]
        if kind == "compute":
            # Against the other nodes' ranks: the job's median rank is no healthy peer when
            # the node holds half the ranks (a two-node job's slow node read half its
            # slowdown, and a requeue half its saving).
            peers = self._peer_level(window.excess_compute[lo:hi], peer_ranks)
            slowdown = float(np.nanmean((1.0 + excess[lo:hi][:, ranks]) / peers[:, None] - 1.0))
        else:
            slowdown = float(np.nanmean(excess[lo:hi][:, ranks]))
        slowdown *= 100.0
        healthy = others = transfer = None
        if kind == "compute":
            healthy = window.healthy[lo:hi].copy()
            scale = self._scale[node_ranks] if self._scale is not None else 1.0
            healthy[:, node_ranks] += (peers - 1.0)[:, None] * (window.median[lo:hi, None] * scale)
            # Ranks slow all along the attribution window: stragglers of their own.
            steady = window.z[max(0, at - keep + 1) : hi].mean(axis=0)
            others = steady > 2.0 * float(k_base[row])
            transfer = transfer_excess(window.comm[lo:hi], node_ranks, self._sync.base_wait)
        job_loss = job_loss_pct(
            window.ready[lo:hi], window.step[lo:hi], node_ranks, healthy, others, transfer
        )
        level_z, level_bar = (
            stand_out(
                window.level[at],
                ranks,
                self.params.outlier_alpha,
                float(np.nan_to_num(window.level_spread[at])),
                1.0 + float(window.level_age[at]),
            )
            if kind == "compute"
            else (None, None)
        )
        start, stage = (
            structure.from_start(
                self._warm,
                self._offset,
                self.rank_group,
                ranks,
                node_ranks,
                peer_ranks,
                slowdown,
                few_nodes=len(self._node_of_group) < STAGE_MIN_JOB_NODES,
            )
            if kind == "compute"
            else (False, False)
        )
        # It began when the step before its first slow one ended.
        since = float(window.ts[lo - 1] if lo > 0 else window.ts[lo])
        return StragglerEvent(
            job_id=self.job_id,
            node=self.node_names[node_index],
            gpu=None if node_wide else int(self.rank_gpu[ranks[0]]),
            ranks=ranks,
            step=int(b.steps[row]),
            ts=float(b.ts[row]),
            cusum_ratio=round(cusum_ratio, 3),
            slowdown_pct=round(slowdown, 2),
            cause="input" if kind == "input" else "compute",
            scope="node" if node_wide else "gpu",
            attempt=self.attempt,
            since_ts=since if math.isfinite(since) else None,
            job_loss_pct=job_loss,
            level_z=level_z,
            level_z_min=level_bar,
            from_start=start,
            maybe_a_stage=stage,
        )
