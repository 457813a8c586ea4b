"""The trace format (CSV) shared by ``straggler export`` and ``straggler backtest``.

Header ``job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s``; ``ts`` is unix seconds
at step end; empty phase cells mean "not measured".
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from typing import TextIO

from slurm_plugin.telemetry.records import StepRecord

TRACE_COLUMNS = (
    "job_id",
    "rank",
    "node",
    "gpu",
    "step",
    "ts",
    "step_s",
    "compute_s",
    "comm_s",
    "data_s",
)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.9g}"


def write_trace(records: Iterable[StepRecord], out: TextIO) -> int:
    """Write records as trace CSV; returns the number of rows."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(TRACE_COLUMNS)
    rows = 0
    for r in records:
        writer.writerow(
            [
                r.job_id,
                r.rank,
                r.node,
                r.gpu,
                r.step,
                f"{r.ts:.6f}",
                _cell(r.step_s),
                _cell(r.compute_s),
                _cell(r.comm_s),
                _cell(r.data_s),
            ]
        )
        rows += 1
    return rows
