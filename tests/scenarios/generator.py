"""Synthetic training jobs with synchronous semantics and known ground truth.

Every rank computes (base x slowdown x noise), loads data (with jitter), then waits in the
all-reduce for the slowest rank: step_s is the same for all ranks, the straggler's compute is
high and its wait low. Checkpoint pauses and global stalls slow every rank together.
Used by the detection tests and ``benchmarks/bench_detection.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from slurm_plugin.model.batch import RecordBatch

GPUS_PER_NODE = 8
Slowdown = Callable[[np.ndarray], np.ndarray]  # steps -> (steps, ranks) multiplicative extra


@dataclass
class Truth:
    """What was injected."""

    kind: str  # straggler | input | hang | sync_stall
    job_id: str
    node: str | None = None
    ranks: list[int] = field(default_factory=list)
    onset_step: int = 0
    shift_sigma: float = 0.0


@dataclass
class JobSpec:
    """One synthetic job."""

    job_id: str
    world: int
    steps: int
    nodes: list[str] | None = None
    start_ts: float = 1_700_000_000.0
    compute_s: float = 0.5
    noise: float = 0.01
    data_s: float = 0.02
    data_jitter: float = 0.3
    data_spike_p: float = 0.01
    data_spike: float = 0.2
    compute_spike_p: float = 1e-4
    compute_spike: float = 0.3
    transfer_s: float = 0.1
    checkpoint_every: int = 200
    checkpoint_s: float = 5.0
    stall_steps: tuple[int, ...] = ()
    seed: int = 0
    compute_slow: dict[int, Slowdown] = field(default_factory=dict)
    data_slow: dict[int, Slowdown] = field(default_factory=dict)
    comm_slow_from: int | None = None
    comm_slow_factor: float = 3.0
    hang_at: int | None = None
    hang_s: float = 900.0
    hang_rank: int = 0
    attempt: int = 0
    #: Per rank, a peer-group label carried by its records (none when empty).
    groups: dict[int, str] = field(default_factory=dict)

    def node_of(self, rank: int) -> str:
        """The node a rank runs on."""
        if self.nodes:
            return self.nodes[rank // GPUS_PER_NODE]
        return f"n{rank // GPUS_PER_NODE:04d}"


def step_change(extra: float, onset: int) -> Slowdown:
    """+extra (fraction) from step ``onset`` on."""
    return lambda steps: np.where(steps >= onset, extra, 0.0)


def pipeline(world: int, offsets: list[float]) -> tuple[dict[int, Slowdown], dict[int, str]]:
    """A pipeline of ``len(offsets)`` equal stages (consecutive ranks, so whole nodes): each
    stage's compute is longer by its offset from the first step (by design: embedding, loss),
    and its ranks carry the label ``stage<i>``."""
    per = world // len(offsets)
    slow: dict[int, Slowdown] = {}
    labels: dict[int, str] = {}
    for rank in range(world):
        stage = min(rank // per, len(offsets) - 1)
        labels[rank] = f"stage{stage}"
        if offsets[stage]:
            slow[rank] = step_change(offsets[stage], 0)
    return slow, labels


def burst(extra: float, onset: int, length: int) -> Slowdown:
    """+extra (fraction) for ``length`` steps from ``onset``, then healthy again."""
    return lambda steps: np.where((steps >= onset) & (steps < onset + length), extra, 0.0)


def drift(extra: float, onset: int, length: int) -> Slowdown:
    """Linear drift from 0 at ``onset`` to +extra ``length`` steps later, then flat."""
    return lambda steps: np.clip((steps - onset) / length, 0.0, 1.0) * extra


def generate(spec: JobSpec) -> RecordBatch:
    """All records of the job (rank-major within each step, in ts order)."""
    rng = np.random.default_rng(spec.seed)
    t, n = spec.steps, spec.world
    steps = np.arange(t)
    slow = np.zeros((t, n))
    for rank, fn in spec.compute_slow.items():
        slow[:, rank] += fn(steps)
    compute = spec.compute_s * (1.0 + slow) * (1.0 + spec.noise * rng.standard_normal((t, n)))
    spikes = rng.random((t, n)) < spec.compute_spike_p
    compute += spikes * spec.compute_s * spec.compute_spike * rng.random((t, n))
    for s in spec.stall_steps:  # a global stall: every rank's compute doubles
        compute[s] *= 2.0
    data = spec.data_s * (1.0 + spec.data_jitter * rng.random((t, n)))
    data += (rng.random((t, n)) < spec.data_spike_p) * spec.compute_s * spec.data_spike
    for rank, fn in spec.data_slow.items():
        data[:, rank] += spec.compute_s * fn(steps)
    transfer = np.full(t, spec.transfer_s)
    if spec.comm_slow_from is not None:
        transfer[spec.comm_slow_from :] *= spec.comm_slow_factor
    ready = compute + data
    step_s = ready.max(axis=1) + transfer
    comm = step_s[:, None] - ready
    pause = np.zeros(t)
    if spec.checkpoint_every:
        pause[spec.checkpoint_every :: spec.checkpoint_every] = spec.checkpoint_s
    if spec.hang_at is not None:
        pause[spec.hang_at] += spec.hang_s
    end = spec.start_ts + np.cumsum(step_s + pause)
    step_total = step_s + pause
    # Ranks report a moment apart; the hang's first rank stops reporting one step earlier.
    ts = end[:, None] + rng.random((t, n)) * 1e-3
    keep = np.ones((t, n), dtype=bool)
    if spec.hang_at is not None:
        keep[spec.hang_at - 1, spec.hang_rank] = False
    ranks = np.broadcast_to(np.arange(n), (t, n))
    rows = np.broadcast_to(steps[:, None], (t, n))
    nodes_by_rank = np.array([spec.node_of(r) for r in range(n)], dtype=object)
    groups_by_rank = np.array([spec.groups.get(r, "") for r in range(n)], dtype=object)
    mask = keep.ravel()
    return RecordBatch(
        rank=ranks.ravel()[mask].astype(np.int64),
        step=rows.ravel()[mask].astype(np.int64),
        attempt=np.full(int(mask.sum()), spec.attempt, dtype=np.int64),
        gpu=(ranks.ravel()[mask] % GPUS_PER_NODE).astype(np.int64),
        ts=ts.ravel()[mask],
        step_s=np.broadcast_to(step_total[:, None], (t, n)).ravel()[mask],
        compute_s=compute.ravel()[mask],
        comm_s=comm.ravel()[mask],
        data_s=data.ravel()[mask],
        node=list(nodes_by_rank[ranks.ravel()[mask]]),
        group=groups_by_rank[ranks.ravel()[mask]] if spec.groups else None,
    )


def write_csv(jobs: list[tuple[str, RecordBatch]], path: str) -> int:
    """Write jobs as one trace CSV in ts order (the backtest's input); returns rows."""
    job_col = np.concatenate([np.full(len(b), j, dtype=object) for j, b in jobs])
    merged = RecordBatch.concat([b for _, b in jobs])
    order = np.argsort(merged.ts, kind="stable")
    nodes = np.asarray(merged.node, dtype=object)
    groups = None if merged.group is None else np.asarray(merged.group, dtype=object)
    with open(path, "w") as out:  # noqa: PTH123 - plain text writer
        out.write(
            "job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s"
            + (",group\n" if groups is not None else "\n")
        )
        lines = (
            f"{job_col[i]},{merged.rank[i]},{nodes[i]},{merged.gpu[i]},{merged.step[i]},"
            f"{merged.ts[i]:.6f},{merged.step_s[i]:.6g},{merged.compute_s[i]:.6g},"
            f"{merged.comm_s[i]:.6g},{merged.data_s[i]:.6g}"
            + (f",{groups[i]}\n" if groups is not None else "\n")
            for i in order.tolist()
        )
        out.writelines(lines)
    return len(order)
