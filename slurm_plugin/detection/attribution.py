"""What a job would do without a node: the steps of a straggler's episode, and the share of the
job's step time its ranks cost."""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist

import numpy as np

from slurm_plugin.detection.params import F64
from slurm_plugin.detection.stats import MAD_TO_SIGMA, median_last, row_mad, row_median

#: Fewest other ranks with a level to compare with (fewer: no bar, the event says None).
MIN_REFERENCE_RANKS = 4
#: A MAD's efficiency against the standard deviation under normal data: its ranks' worth.
_MAD_EFFICIENCY = 0.37


def job_loss_pct(
    ready: F64,
    step: F64,
    node_ranks: np.ndarray,
    healthy: F64 | None = None,
    others: np.ndarray | None = None,
    transfer: F64 | None = None,
) -> float | None:
    """The share of the job's step time (%) that the node's ranks cost it over these steps.
    A synchronous step waits for the slowest rank; the what-if puts the node's ranks at
    ``healthy`` (rows x ranks: their data loading as it was, their compute as their peers'),
    or leaves them out when None. Ranks of ``others`` (other nodes slow all along the
    window: stragglers of their own) are taken as healthy on both sides, so two bad nodes in
    one job do not hide each other: each is charged what it costs once the other is dealt
    with. Never the node's own slowdown: among many noisy ranks a slower GPU adds only what
    it exceeds the slowest of the rest by, and a rank slow to load its data is not the node
    computing slowly. ``transfer`` (per step, :func:`transfer_excess`) adds what the node's
    slowness added to the collectives themselves. None when there is nothing to compare with."""
    rest = np.ones(ready.shape[1], dtype=bool)
    rest[node_ranks] = False
    if not rest.any() or not len(ready):
        return None
    base = ready
    if healthy is not None and others is not None and others.any():
        base = np.where(others[None, :] & rest[None, :], healthy, ready)
    everyone = np.fmax.reduce(base, axis=1)
    without = np.fmax.reduce(np.where(rest[None, :], base, np.nan), axis=1)
    if healthy is not None:
        without = np.fmax(without, np.fmax.reduce(healthy[:, node_ranks], axis=1))
    gain = np.where(np.isfinite(everyone) & np.isfinite(without), everyone - without, np.nan)
    if transfer is not None:
        gain = gain + transfer
    ok = np.isfinite(gain) & np.isfinite(step) & (step > 0)
    if not ok.any():
        return None
    return round(100.0 * float(np.sum(np.maximum(gain[ok], 0.0)) / np.sum(step[ok])), 2)


def transfer_excess(comm: F64, node_ranks: np.ndarray, base: float | None) -> F64 | None:
    """Per step, how much longer than in the warm-up the collectives' transfer took, on the
    steps where the node's ranks arrived last (the last rank's wait is the transfer itself):
    a slow node slows its part of the collectives too (a throttled CPU moves gloo's data
    slowly, a flaky NIC sends slowly), which its compute does not show. 0 on other steps;
    None without a warm-up baseline (a node slow from the first step adds nothing here)."""
    if base is None or not len(comm):
        return None
    filled = np.where(np.isfinite(comm), comm, np.inf)
    last = np.argmin(filled, axis=1)
    low = filled[np.arange(len(filled)), last]
    on_node = np.isin(last, node_ranks) & np.isfinite(low)
    return np.where(on_node, np.maximum(0.0, np.where(on_node, low, base) - base), 0.0)


def run_start(scores: F64, k: float) -> int:
    """Index where the CUSUM run that ends at the last z-score began (after its last zero):
    the steps that carry the shift, over which the slowdown is estimated."""
    s, start = 0.0, 0
    for i, value in enumerate(scores.tolist()):
        s = max(0.0, s + value - k)
        if s == 0.0:
            start = i + 1
    return min(start, len(scores) - 1)


def stand_out(
    levels: F64, ranks: list[int], alpha: float, spread_floor: float = 0.0, pooled: float = 1.0
) -> tuple[float | None, float | None]:
    """How far the flagged ``ranks``' level (their mean of ``levels``, each rank's smoothed
    relative excess compute) stands above the job's other ranks', in units of those ranks'
    rank-to-rank spread of levels (robust: 1.4826 x MAD, at least ``spread_floor``: the
    widest spread within nodes the job has shown lately), and the bar a straggler must
    clear among this many ranks: the normal quantile ``1 - alpha / ranks`` (the chance that
    the least favourable healthy rank of the job clears it at one look), widened as
    Student's t for a spread estimated from few ranks (Cornish-Fisher, a MAD worth 37 % of
    its ranks, times ``pooled``: how many rows' worth of ranks the spread has taken in, 1
    to 4).

    Under independent per-step noise the smoothed levels of healthy ranks are tight and a
    slow GPU stands out by far; under slow drift of each rank (thermals, clocks,
    neighbours) they spread as wide as one step's noise, and the slowest of many healthy
    ranks is only the tail of that spread: evicting it swaps in a node whose ranks drift as
    much. (None, None): too few other ranks to tell."""
    if not len(levels) or not ranks:
        return None, None
    flagged = np.zeros(len(levels), dtype=bool)
    flagged[ranks] = True
    ref = levels[~flagged & np.isfinite(levels)]
    own = levels[flagged & np.isfinite(levels)]
    if len(ref) < MIN_REFERENCE_RANKS or not len(own):
        return None, None
    med = float(np.median(ref))
    spread = max(float(np.median(np.abs(ref - med))) * MAD_TO_SIGMA, spread_floor)
    q = NormalDist().inv_cdf(1.0 - alpha / (len(ref) + len(own)))
    df = _MAD_EFFICIENCY * len(ref) * min(4.0, max(1.0, pooled))
    bar = round(q * (1.0 + (q * q + 1.0) / (4.0 * df)), 2)
    if not spread > 0.0:
        return (math.inf if float(own.mean()) > med else 0.0), bar
    return round(float((own.mean() - med) / spread), 2), bar


def level_spread(level: F64, order: np.ndarray, starts: np.ndarray) -> F64:
    """Per row, the rank-to-rank spread of the ranks' levels within a node (1.4826 x MAD
    around the node's median), the median over the nodes of two or more ranks; the spread
    across all ranks when there are none (NaN: no levels). Within nodes, so that whole slow
    nodes (half the ranks of a two-node job) never widen it: the spread of how healthy
    ranks differ, not of how far the stragglers are."""
    rows = level.shape[0]
    ordered = level[:, order]
    bounds = np.r_[starts, level.shape[1]].astype(int)
    sizes = np.diff(bounds)
    if rows and len(sizes) and sizes[0] >= 2 and (sizes == sizes[0]).all():
        # Nodes of equal size (the usual): one vectorised median per row and node.
        grid = ordered.reshape(rows, len(sizes), int(sizes[0]))
        with np.errstate(invalid="ignore"):
            med = median_last(grid)[..., None]
            mad = median_last(np.abs(grid - med)) * MAD_TO_SIGMA
        return row_median(mad)
    spreads = [row_mad(ordered[:, lo:hi]) for lo, hi in itertools.pairwise(bounds) if hi - lo >= 2]
    if not spreads or not rows:
        return row_mad(level)
    return row_median(np.stack(spreads, axis=1))
