"""Is a node still slow? A short, independent look at the job's newest steps before an
eviction, so a burst that is already over (a page-cache flush, a checkpoint writer) never
costs a requeue."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

from slurm_plugin.model.records import StepRecord


def recent_slowdown_pct(
    records: Iterable[StepRecord],
    node: str,
    ranks: Collection[int] = (),
    steps: int = 20,
    since_step: int | None = None,
) -> float | None:
    """How much longer the straggling ranks (``ranks`` on ``node``; all of the node's ranks
    when empty) computed than the ranks on other nodes, in %, over the newest ``steps`` steps
    of the newest attempt that show both (a slow node's own reports may lag behind its peers'),
    from ``since_step`` on (the step the node was flagged at: a window reaching back before a
    recent shift would measure the healthy past). The median over those steps of the per-step
    ratio of medians; None when no step shows both."""
    usable = [
        r
        for r in records
        if r.compute_s is not None and (since_step is None or r.step >= since_step)
    ]
    if not usable:
        return None
    attempt = max(r.attempt for r in usable)
    by_step: dict[int, tuple[list[float], list[float]]] = {}
    for r in usable:
        if r.attempt != attempt:
            continue
        mine, peers = by_step.setdefault(r.step, ([], []))
        if r.node != node:
            peers.append(float(r.compute_s or 0.0))
        elif not ranks or r.rank in ranks:
            mine.append(float(r.compute_s or 0.0))
    ratios = []
    for step in sorted(by_step, reverse=True):
        mine, peers = by_step[step]
        peer = float(np.median(peers)) if peers else 0.0
        if mine and peer > 0:
            ratios.append(float(np.median(mine)) / peer)
            if len(ratios) == steps:
                break
    return (float(np.median(ratios)) - 1.0) * 100.0 if ratios else None


def tail_slowdown_pct(
    excess: np.ndarray,
    numbers: np.ndarray,
    on_node: np.ndarray,
    ranks: Collection[int] = (),
    since_step: int | None = None,
    steps: int = 20,
) -> float | None:
    """The same look from a detector's own newest rows (``excess``: each rank's compute over
    the row's median, structure taken out; ``numbers``: the rows' step numbers): the node's
    straggling ``ranks`` (of ``on_node``; all of them when empty), over the newest ``steps``
    rows from ``since_step`` on, as the median over rows of their median excess, in %. Cheap
    at any world size (a few rows of the ranks in question). None when no such row shows
    them: unknown, which is never "recovered"."""
    cols = np.intersect1d(on_node, np.asarray(list(ranks), dtype=np.int64)) if ranks else on_node
    rows = np.arange(len(numbers)) if since_step is None else np.flatnonzero(numbers >= since_step)
    if not len(cols) or not len(rows):
        return None
    picked = excess[np.ix_(rows[-steps:], cols)]  # only those cells: no copy of whole rows
    shown = np.isfinite(picked).any(axis=1)
    if not shown.any():
        return None
    per_row = np.nanmedian(picked[shown], axis=1)
    return float(np.median(per_row) * 100.0)
