"""CUSUM chart banks: per rank, per node, and the downward charts that tell a shift is over."""

from __future__ import annotations

import numpy as np

from slurm_plugin.detection.params import F64, cusum_thresholds
from slurm_plugin.detection.stats import cusum

#: A chart never holds more than this many thresholds of evidence: over it while a shift
#: lasts, back under it within a few steps once the shift is over.
CAP = 2.0


#: Steps between false "the slowdown ended" of a chart that watches a shift go away (a false
#: end only splits an episode: it costs far less than a false alarm, so it may come sooner).
END_ARL = 1e4


def node_references(ks: list[F64], ranks: F64, arl: float) -> tuple[list[F64], list[F64]]:
    """The node charts' references and thresholds per row and node. A node of ``n`` ranks
    slowed by a shift of d rank-spreads moves its z-score by d sqrt(n): its reference is the
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


def bank(scores: F64, ks: list[F64], hs: list[F64], live: np.ndarray, state: F64) -> F64:
    """Run every chart over the block; return per row and column the largest S/h.
    References and thresholds are per row (one value for every column) or per row and
    column."""
    ratio = np.zeros_like(scores)
    for i, (k, h) in enumerate(zip(ks, hs, strict=True)):
        k2, h2 = (k, h) if k.ndim == 2 else (k[:, None], h[:, None])
        inc = np.where(live[:, None], scores - k2, 0.0)
        s = cusum(inc, state[i], CAP * h2)
        if len(s):
            state[i] = s[-1]
        ratio = np.maximum(ratio, s / np.where(h2 > 0, h2, np.inf))
    return ratio
