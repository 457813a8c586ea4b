"""The job-level sync-stall chart (pure, numpy): every rank waits longer in the collectives
while compute stays flat, which points at the fabric or the collective, not at a rank.

Per step the smallest collective wait of any rank (the slowest rank waits only for the
transfer itself) is compared with its warm-up baseline, as a share of the warm-up's step
time; a CUSUM over steps whose median compute is within 10 % of its baseline raises one event
per attempt.
"""

from __future__ import annotations

import numpy as np

from slurm_plugin.detection.params import F64, DetectionParams
from slurm_plugin.detection.stats import cusum, row_median


class SyncStallChart:
    """State of the sync-stall chart of one job attempt."""

    def __init__(self, params: DetectionParams) -> None:
        self.params = params
        self._warm: list[F64] = []
        self._base: tuple[float, float, float] | None = None  # wait, compute, step time
        self._level = 0.0
        self.flagged = False

    @property
    def base_wait(self) -> float | None:
        """The warm-up's smallest collective wait per step: the transfer itself (None until
        the warm-up has established it)."""
        return self._base[0] if self._base is not None else None

    def process(
        self,
        comm: F64,
        step_s: F64,
        med_compute: F64,
        warm_rows: int,
        valid_rows: np.ndarray,
        warm_done: bool,
    ) -> tuple[int, float] | None:
        """Feed a block's rows; (row, wait rise in % of the step time) of the stall, once."""
        p = self.params
        if self.flagged or not np.isfinite(comm).any():
            return None
        low_comm = np.fmin.reduce(comm, axis=1)
        med_step = row_median(step_s[:, None]) if step_s.ndim == 1 else row_median(step_s)
        if warm_rows:
            self._warm.append(
                np.c_[low_comm[:warm_rows], med_compute[:warm_rows], med_step[:warm_rows]]
            )
        if self._base is None:
            if not warm_done or not self._warm:
                return None
            base = row_median(np.vstack(self._warm).T)  # per column; NaN when all-NaN
            if not np.all(np.isfinite(base)) or base[2] <= 0:
                return None
            self._base = (float(base[0]), float(base[1]), float(base[2]))
        base_comm, base_compute, base_step = self._base
        live = valid_rows.copy()
        live[:warm_rows] = False
        flat = np.abs(med_compute / base_compute - 1.0) < 0.1
        rise = (low_comm - base_comm) / base_step
        # Increments: the rise in units of the smallest rise that counts, less a half.
        inc = np.clip(rise / (p.sync_stall_min_rise_pct / 100.0), -1.0, 4.0) - 0.5
        inc = np.where(live & flat & np.isfinite(inc), inc, 0.0)
        chart = cusum(inc[:, None], np.array([self._level]))[:, 0]
        if len(chart):
            self._level = float(chart[-1])
        hits = np.flatnonzero(chart > 0.5 * p.sync_stall_steps)
        if not len(hits):
            return None
        self.flagged = True
        row = int(hits[0])
        return row, round(float(rise[row]) * 100.0, 1)
