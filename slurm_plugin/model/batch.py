"""Step records as columns: what the service decodes a stream into and the detector reads.

One row per (rank, step); NaN for a phase that was not measured. Building it from record
objects (``from_records``) is for tests, the backtest and small inputs; the service decodes
stream entries straight into columns (``model.columns.decode_entries``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from slurm_plugin.model.records import StepRecord

_COLUMNS = ("rank", "step", "attempt", "gpu", "ts", "step_s", "compute_s", "comm_s", "data_s")


@dataclass
class RecordBatch:
    """Step records of one job as columns (NaN for a phase that was not measured)."""

    rank: np.ndarray
    step: np.ndarray
    attempt: np.ndarray
    gpu: np.ndarray
    ts: np.ndarray
    step_s: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray
    data_s: np.ndarray
    node: Sequence[str] | np.ndarray
    #: Per record, the rank's peer-group label ("" = none); None when no record has one.
    group: Sequence[str] | np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rank)

    def take(self, index: np.ndarray | slice) -> RecordBatch:
        """The records at ``index`` (boolean mask, positions, or a slice: views)."""
        nodes = np.asarray(self.node, dtype=object)[index]
        groups = None if self.group is None else np.asarray(self.group, dtype=object)[index]
        return _batch({c: getattr(self, c)[index] for c in _COLUMNS}, nodes, groups)

    @staticmethod
    def concat(batches: Sequence[RecordBatch]) -> RecordBatch:
        """One batch of all records."""
        nodes = np.concatenate([np.asarray(b.node, dtype=object) for b in batches])
        groups = None
        if any(b.group is not None for b in batches):
            groups = np.concatenate(
                [
                    np.asarray(b.group, dtype=object)
                    if b.group is not None
                    else np.full(len(b), "", dtype=object)
                    for b in batches
                ]
            )
        return _batch(
            {c: np.concatenate([getattr(b, c) for b in batches]) for c in _COLUMNS}, nodes, groups
        )

    def to_records(self, job_id: str) -> list[StepRecord]:
        """Record objects of ``job_id`` (export and the backtest read records)."""
        groups = self.group if self.group is not None else [""] * len(self)

        def opt(value: float) -> float | None:
            return None if math.isnan(value) else value  # NaN: not measured

        return [
            StepRecord(
                job_id=job_id,
                rank=int(rank),
                node=str(node),
                gpu=int(gpu),
                step=int(step),
                ts=float(ts),
                step_s=float(step_s),
                compute_s=opt(float(compute)),
                comm_s=opt(float(comm)),
                data_s=opt(float(data)),
                attempt=int(attempt),
                group=str(group),
            )
            for rank, node, gpu, step, ts, step_s, compute, comm, data, attempt, group in zip(
                self.rank,
                self.node,
                self.gpu,
                self.step,
                self.ts,
                self.step_s,
                self.compute_s,
                self.comm_s,
                self.data_s,
                self.attempt,
                groups,
                strict=True,
            )
        ]

    @staticmethod
    def from_records(records: Iterable[StepRecord]) -> RecordBatch:
        """Columns from record objects (all of one job)."""
        rows = list(records)
        nan = float("nan")

        def col(name: str, dtype: type) -> np.ndarray:
            values = [getattr(r, name) for r in rows]
            if dtype is float:
                values = [nan if v is None else v for v in values]
            return np.asarray(values, dtype=np.int64 if dtype is int else np.float64)

        return RecordBatch(
            col("rank", int),
            col("step", int),
            col("attempt", int),
            col("gpu", int),
            col("ts", float),
            col("step_s", float),
            col("compute_s", float),
            col("comm_s", float),
            col("data_s", float),
            node=[r.node for r in rows],
            group=[r.group for r in rows] if any(r.group for r in rows) else None,
        )


def _batch(
    columns: dict[str, np.ndarray], nodes: np.ndarray, groups: np.ndarray | None = None
) -> RecordBatch:
    return RecordBatch(
        rank=columns["rank"],
        step=columns["step"],
        attempt=columns["attempt"],
        gpu=columns["gpu"],
        ts=columns["ts"],
        step_s=columns["step_s"],
        compute_s=columns["compute_s"],
        comm_s=columns["comm_s"],
        data_s=columns["data_s"],
        node=nodes,
        group=groups,
    )
