"""CUSUM chart banks: per rank, per node, and the downward charts that tell a shift is over."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slurm_plugin.detection.params import F64, cusum_thresholds
from slurm_plugin.detection.stats import cusum

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
