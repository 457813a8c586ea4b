"""Complete steps of one job attempt as dense matrices: what the per-job detector reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slurm_plugin.detection.params import F64
from slurm_plugin.detection.stats import row_median


def what_if(b: Block, med_c: F64, scale: np.ndarray | None) -> tuple[F64, F64, F64]:
    """Each rank's raw ready time (compute and data loading), its ready time had it computed
    as its peers (the step's median, times its by-design offset), and each step's time."""
    data = np.where(np.isfinite(b.data), b.data, 0.0)
    typical = med_c[:, None] * (scale[None, :] if scale is not None else 1.0)
    step = b.step_s if b.step_s.ndim == 1 else row_median(b.step_s)
    return b.compute + data, data + typical, step


#: Rows a detector processes at a time (longer blocks are cut).
MAX_ROWS = 1024


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
