"""The rows a detector attributes an alarm from: a block's rows of per-rank deviations and
times, preceded by the tail of the blocks before it (the last ``attribution_steps`` rows)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from slurm_plugin.detection.params import F64


@dataclass
class Window:
    """Rows of per-rank deviations (relative excess over the median, scores) and their times,
    for attributing an alarm; ``offset`` is the row where the current block starts."""

    excess_compute: F64
    excess_data: F64
    z: F64
    #: Each rank's raw compute plus data loading (what it brings to the collective), the
    #: same had it computed as its peers, and each step's time: the what-if of the job
    #: without a node's slowdown.
    ready: F64
    healthy: F64
    step: F64
    ts: F64
    #: Each row's step number (the re-check looks at rows from the step a node was flagged).
    number: F64
    #: Each rank's collective wait (the last rank's is the transfer: ``transfer_excess``).
    comm: F64
    #: Each rank's level: its relative excess compute smoothed over ``level_halflife_steps``.
    level: F64
    #: Per row, the widest spread of levels within nodes the job has shown lately
    #: (``JobDetector._levels``), and how many half-lives of live steps the levels have seen.
    level_spread: F64
    level_age: F64
    #: Per row, the median rank's compute (structure divided out): times a rank's offset,
    #: what it computes "as its peers" in ``healthy``.
    median: F64
    offset: int = 0


#: The per-row fields of a :class:`Window` (all but ``offset``), in order.
ROWS: tuple[str, ...] = tuple(f.name for f in fields(Window) if f.name != "offset")


def join(tail: Window | None, block: Window, keep: int) -> tuple[Window, Window]:
    """``block`` preceded by ``tail`` (when it has the same ranks), its ``offset`` the row
    where the block starts; and the new tail, the joined rows' last ``keep``."""
    if tail is not None and tail.z.shape[1] == block.z.shape[1]:
        both: dict[str, Any] = {
            n: np.concatenate([getattr(tail, n), getattr(block, n)]) for n in ROWS
        }
        joined = replace(block, **both)
    else:
        joined = block
    joined.offset = joined.z.shape[0] - block.z.shape[0]
    return joined, Window(*(getattr(joined, n)[-keep:] for n in ROWS))
