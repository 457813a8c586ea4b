"""Is a node still slow? A short, independent look at the job's newest steps before an
eviction, so a burst that is already over (a page-cache flush, a checkpoint writer) never
costs a requeue."""

from __future__ import annotations

import warnings
from collections.abc import Collection

import numpy as np


def rows_of(
    step: np.ndarray, rank: np.ndarray, compute: np.ndarray, scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Records (flat arrays, one entry per rank and step) as a detector holds its rows: one
    row per step (ascending), one column per rank, each cell the rank's compute with its
    by-design factor (``scale``) divided out, as excess over the step's median (NaN: not
    reported). Returns the rows, their step numbers and ``scale`` widened to the columns (1 for
    a rank the detector did not know), for :func:`tail_slowdown_pct`: the replay's re-check
    is the service's, on the trace."""
    numbers, row = np.unique(step, return_inverse=True)
    width = int(rank.max()) + 1 if len(rank) else 0
    if scale is not None and len(scale):
        width = max(width, len(scale))
        scale = rank_factor(scale, np.arange(width))
        compute = compute / scale[rank]
    cells = np.full((len(numbers), width), np.nan)
    cells[row, rank] = compute
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank reported
        med = np.nanmedian(cells, axis=1) if width else np.zeros(len(numbers))
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(med[:, None] > 0, cells / med[:, None] - 1.0, np.nan)
    return excess, numbers, scale


#: The newest steps that must also show the node slow: a slowdown that ended a few steps ago
#: still holds the median of the whole window (an episode over for 13 of 20 steps read +2 %).
NEWEST_STEPS = 5


def still_pct(oldest_first: np.ndarray) -> float:
    """The slowdown a window of per-step ratios (oldest first, as ratio - 1) still shows: the
    lesser of its median and the median of its newest :data:`NEWEST_STEPS`. A node is only
    taken as still slow when the whole window and its newest steps both say so."""
    return float(min(np.median(oldest_first), np.median(oldest_first[-NEWEST_STEPS:])))


#: Peers of one structural group looked at by the re-check, at most (an even spread of them):
#: a median over thousands of ranks gains nothing from more.
MAX_PEERS = 4096


def even_spread(ranks: np.ndarray) -> np.ndarray:
    """At most :data:`MAX_PEERS` of ``ranks``, evenly spread over them (every one when fewer)."""
    return ranks[:: max(1, -(-len(ranks) // MAX_PEERS))]


def rank_factor(scale: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Each of ``ranks``' by-design compute factor in ``scale`` (1 for a rank beyond it: one
    the detector did not know)."""
    return np.where(ranks < len(scale), scale[np.minimum(ranks, len(scale) - 1)], 1.0)


def structure_peers(
    scale: np.ndarray | None, own: np.ndarray, others: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``own`` ranks grouped by their by-design compute factor (``scale``, as a detector
    learned it; None: no structure), each group with the ``others`` that share its factor
    (every one of ``others`` when none does). A node of a slower pipeline stage is compared
    with that stage on other nodes: the learned factor is an estimate, and its error (a
    percent or two) must not read as a slowdown that never ends."""
    if scale is None or not len(own) or not len(scale):
        return [(own, others)]
    mine_f, others_f = rank_factor(scale, own), rank_factor(scale, others)
    out = []
    for value in np.unique(mine_f).tolist():
        mine = own[mine_f == value]
        peers = others[others_f == value]
        out.append((mine, peers if len(peers) else others))
    return out


def _others_outnumber(excess: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Per row of ``rows``, whether the job's other ranks reported it at least as often as
    the ranks in question (``cols``) did: only then does the row's median lie with them, and
    the excess over it compare the ranks with their peers (two ranks: with their mean). A job
    whose ranks drift apart by more than the detector's lag has its newest steps processed
    with the fastest ranks alone; there the ranks in question are their own median (+0 %),
    and a node 1.5x slow read as recovered at an advice's deadline. The others are counted
    on an even spread of at most :data:`MAX_PEERS` of them."""
    others = np.setdiff1d(np.arange(excess.shape[1]), cols)
    if not len(others):
        return np.zeros(len(rows), dtype=bool)
    stride = max(1, -(-len(others) // MAX_PEERS))
    present = np.isfinite(excess[np.ix_(rows, others[::stride])]).sum(axis=1) * stride
    own = np.isfinite(excess[np.ix_(rows, cols)]).sum(axis=1)
    out: np.ndarray = (present > 0) & (present >= own)
    return out


def tail_slowdown_pct(
    excess: np.ndarray,
    numbers: np.ndarray,
    on_node: np.ndarray,
    ranks: Collection[int] = (),
    since_step: int | None = None,
    steps: int = 20,
    scale: np.ndarray | None = None,
) -> float | None:
    """The same look from a detector's own newest rows (``excess``: each rank's compute over
    the row's median, structure taken out; ``numbers``: the rows' step numbers): the node's
    straggling ``ranks`` (of ``on_node``; all of them when empty), over the newest ``steps``
    rows from ``since_step`` on, as the median over rows of their median excess over peers
    on other nodes of their structural group (:func:`structure_peers`; ``scale`` as the
    detector learned it, None: the row's median is the peers' level), in %. Cheap at any
    world size (a few rows of the ranks in question, at most :data:`MAX_PEERS` peers). None
    when no such row shows them: unknown, which is never "recovered"."""
    cols = np.intersect1d(on_node, np.asarray(list(ranks), dtype=np.int64)) if ranks else on_node
    rows = np.arange(len(numbers)) if since_step is None else np.flatnonzero(numbers >= since_step)
    if not len(cols) or not len(rows):
        return None
    rows = rows[-4 * steps :]  # the newest, of which those that compare
    rows = rows[_others_outnumber(excess, rows, cols)][-steps:]
    if not len(rows):
        return None
    picked = excess[np.ix_(rows, cols)]  # only those cells: no copy of whole rows
    if scale is not None and len(scale) == excess.shape[1]:
        others = np.setdiff1d(np.arange(excess.shape[1]), on_node)
        level = np.zeros_like(picked)
        for mine, peers in structure_peers(scale, cols, others):
            if not len(peers):
                continue
            spread = even_spread(peers)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a row none of them showed
                base = np.nanmedian(excess[np.ix_(rows, spread)], axis=1)
            level[:, np.searchsorted(cols, mine)] = np.where(np.isfinite(base), base, 0.0)[:, None]
        picked = (1.0 + picked) / (1.0 + level) - 1.0  # over the group's level, as a ratio
    shown = np.isfinite(picked).any(axis=1)
    if not shown.any():
        return None
    return still_pct(np.nanmedian(picked[shown], axis=1)) * 100.0
