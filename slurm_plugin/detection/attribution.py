"""What a job would do without a node: the steps of a straggler's episode, and the share of the
job's step time its ranks cost."""

from __future__ import annotations

import numpy as np

from slurm_plugin.detection.params import F64


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
