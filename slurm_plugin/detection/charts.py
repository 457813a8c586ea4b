"""CUSUM chart banks: per rank, per node, and the downward charts that tell a shift is over."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from slurm_plugin.detection.params import F64, DetectionParams, cusum_thresholds
from slurm_plugin.detection.stats import cusum, ewma, row_mad

#: A chart never holds more than this many thresholds of evidence: over it while a shift
#: lasts, back under it within a few steps once the shift is over.
CAP = 2.0


#: Steps between false "the slowdown ended" of a chart that watches a shift go away (a false
#: end only splits an episode: it costs far less than a false alarm, so it may come sooner).
END_ARL = 1e4


@dataclass(frozen=True)
class References:
    """Every chart's references and thresholds for one block, per row: the ranks' charts and
    the nodes' (one per chart), and the two charts that tell a slowdown ended (a rank's, a
    node's)."""

    rank_k: list[F64]
    rank_h: list[F64]
    node_k: list[F64]
    node_h: list[F64]
    end_h: F64
    end_node_k: F64
    end_node_h: F64


def references(ks: list[F64], ranks: F64, arl: float) -> References:
    """The references and thresholds of a block's charts, in one threshold solve (each
    solve costs the same few numpy calls whatever its size). ``ks``: the rank charts'
    references per row; ``ranks``: per row and node, the ranks that reported. A node of ``n``
    ranks slowed by a shift of d rank-spreads moves its z-score by d sqrt(n): its reference is
    the ranks' times sqrt(n), so a node-wide shift smaller than the minimum worth acting on
    never alarms however many ranks carry it. The end charts run on the smallest reference
    against ``END_ARL``."""
    counts, where = np.unique(ranks, return_inverse=True)
    where = where.reshape(ranks.shape)
    rows = np.arange(ranks.shape[0])[:, None]
    scaled = [np.sqrt(counts)[:, None] * k[None, :] for k in ks]  # (counts, rows) each
    parts = [*ks, *scaled, ks[0], scaled[0]]
    arls = [arl] * (2 * len(ks)) + [END_ARL, END_ARL]
    flat = np.concatenate([part.ravel() for part in parts])
    solved = cusum_thresholds(flat, np.repeat(arls, [part.size for part in parts]))
    hs, at = [], 0
    for part in parts:
        hs.append(solved[at : at + part.size].reshape(part.shape))
        at += part.size
    n = len(ks)
    node_k = [k[where, rows] for k in scaled]
    node_h = [h[where, rows] for h in hs[n : 2 * n]]
    return References(
        rank_k=ks,
        rank_h=hs[:n],
        node_k=node_k,
        node_h=node_h,
        end_h=hs[2 * n],
        end_node_k=node_k[0],
        end_node_h=hs[2 * n + 1][where, rows],
    )


def bank(scores: F64, ks: list[F64], hs: list[F64], live: np.ndarray, state: F64) -> F64:
    """Run every chart over the block; return per row and column the largest S/h.
    References and thresholds are per row (one value for every column) or per row and
    column. The charts run side by side as columns of one CUSUM (one call, not one per
    chart: the numpy calls cost more than the arithmetic at a job's size)."""
    rows, cols = scores.shape
    charts = len(ks)
    if not charts:
        return np.zeros_like(scores)
    # (charts, rows, 1) for references per row, (charts, rows, cols) per row and column.
    k, h = np.stack(ks), np.stack(hs)
    if k.ndim == 2:
        k, h = k[:, :, None], h[:, :, None]
    # ``live``: per row, or per row and column (jobs side by side, :mod:`.many`).
    mask = live[None, :, None] if live.ndim == 1 else live[None, :, :]
    inc = np.where(mask, scores[None, :, :] - k, 0.0)  # (charts, rows, cols)
    wide = inc.transpose(1, 0, 2).reshape(rows, charts * cols)
    top = np.broadcast_to(CAP * h, inc.shape).transpose(1, 0, 2).reshape(rows, charts * cols)
    s = cusum(wide, state.reshape(charts * cols), top).reshape(rows, charts, cols)
    if rows:
        state[:] = s[-1]
    ratio = s / np.where(h > 0, h, np.inf).transpose(1, 0, 2)
    out: F64 = np.maximum(ratio.max(axis=1), 0.0)
    return out


@dataclass
class JobCharts:
    """Every CUSUM chart of one job attempt, and their state from block to block: the
    alarm banks per rank and per node, the downward charts that tell a shift ended, and how
    wide the node scores spread. ``order`` sorts the ranks by node; ``node_starts`` are where
    each node's ranks begin in that order and ``node_of_group`` the node of each such run
    (of ``nodes``); ``alpha`` smooths the spread over steps."""

    params: DetectionParams
    order: np.ndarray
    node_starts: np.ndarray
    node_of_group: np.ndarray
    nodes: int
    alpha: float

    def __post_init__(self) -> None:
        ranks, charts = len(self.order), self.params.charts
        # The alarm charts' statistics (charts x ranks, charts x nodes) and the end charts'
        # (per rank, per node) after the last block: what a batch of jobs carries on
        # (detection/many.py); and the node scores' smoothed spread across nodes.
        self.rank_s = np.zeros((charts, ranks))
        self.node_s = np.zeros((charts, self.nodes))
        self.end_rank = np.zeros(ranks)
        self.end_node = np.zeros(self.nodes)
        self.node_spread = math.nan

    def run(
        self, z: F64, c: F64, k_base: F64, live: np.ndarray
    ) -> tuple[F64, F64, dict[str, np.ndarray]]:
        """Every chart over the block: per row, the ranks' and the nodes' largest S/h (0 where
        none of its ranks measured the step), and whether each rank's and node's slowdown,
        if any, has ended (:meth:`_ended`)."""
        p = self.params
        arl = p.false_alarm_arl * p.charts
        ks = [k_base * 2.0**i for i in range(p.charts)]
        node_z, node_measured, node_n = self.node_scores(z, c)
        refs = references(ks, node_n, arl)
        # A chart raises an alarm only on a step its rank (or a rank of its node) measured: a
        # rank gone silent while its chart is high is not reported with nothing to show.
        rank_hit = bank(z, ks, refs.rank_h, live, self.rank_s)
        rank_hit = np.where(np.isfinite(c), rank_hit, 0.0)
        node_hit = bank(node_z, refs.node_k, refs.node_h, live, self.node_s)
        node_hit = np.where(node_measured, node_hit, 0.0)
        return rank_hit, node_hit, self._ended(z, ks[0], node_z, refs, live)

    def _ended(
        self, z: F64, k: F64, node_z: F64, refs: References, live: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Per row and rank, and per row and node: back under half the smallest slowdown
        worth acting on. Downward CUSUMs (increments k - z-score) against a threshold
        for ``END_ARL``: a shift that ended is seen as over within about h/k steps, however
        long it lasted, where the alarm charts, holding evidence up to their cap, drain for
        much longer in noisy jobs."""
        h = refs.end_h[:, None]
        node_k, node_h = refs.end_node_k, refs.end_node_h
        # Capped at twice the threshold: one noisy step of a healthy rank never makes the
        # node look slow again. Ranks and nodes side by side, as columns of one CUSUM.
        ranks = z.shape[1]
        both = cusum(
            np.where(live[:, None], np.hstack([k[:, None] - z, node_k - node_z]), 0.0),
            np.concatenate([self.end_rank, self.end_node]),
            CAP * np.hstack([np.broadcast_to(h, z.shape), node_h]),
        )
        d, dn = both[:, :ranks], both[:, ranks:]
        if len(d):
            self.end_rank, self.end_node = d[-1].copy(), dn[-1].copy()
        return {
            "compute:rank": d >= h * (1.0 - 1e-9),
            "compute:node": dn >= node_h * (1.0 - 1e-9),
        }

    def node_scores(self, z: F64, c: F64) -> tuple[F64, np.ndarray, F64]:
        """Per node: sum of its ranks' scores / sqrt(reporting ranks) (N(0,1) when healthy,
        divided by the inflation when its ranks move together), whether any of its ranks
        reported the step, and how many did."""
        shape = (z.shape[0], self.nodes)
        if not self.nodes or not z.shape[1]:
            return np.zeros(shape), np.zeros(shape, dtype=bool), np.ones(shape)
        zs = z[:, self.order]
        present = np.isfinite(c[:, self.order]).astype(np.float64)
        sums = np.add.reduceat(zs, self.node_starts, axis=1)
        counts = np.add.reduceat(present, self.node_starts, axis=1)
        scores = sums / np.sqrt(np.maximum(counts, 1.0))
        out = np.zeros(shape)
        out[:, self.node_of_group] = scores / self._node_inflation(scores)[:, None]
        measured = np.zeros(shape, dtype=bool)
        measured[:, self.node_of_group] = counts > 0
        reporting = np.ones(shape)
        reporting[:, self.node_of_group] = np.maximum(counts, 1.0)
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
        wide = row_mad(scores)
        smooth = ewma(wide, self.alpha, self.node_spread)
        if np.isfinite(smooth[-1]):
            self.node_spread = float(smooth[-1])
        return np.where(np.isfinite(smooth), np.maximum(1.0, np.fmax(smooth, wide)), 1.0)
