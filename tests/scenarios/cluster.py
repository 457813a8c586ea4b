"""A simulated cluster month with ground truth: what ``benchmarks/bench_cluster.py`` scores the
backtest's decisions against, and what the decision tests draw their classes from.

A cluster of 2,048 nodes x 8 GPUs (16,384 GPUs) runs a month of synchronous training jobs.
Each job is simulated step by step for a window at its start (its trace: what ``straggler
export`` would give), and its economics (true end, time limit, checkpoints, restart cost) are
known for its whole life, so an eviction decided in the window is scored on what it really
saved and cost. Every rank computes (base x structure x fault x noise), loads data, then waits
for the slowest rank: the step is the slowest rank's ready time plus the transfer.

The distributions are shaped after public measurements (ranges, not fitted values):

- **Job sizes** are heavy-tailed: most jobs are small, most GPU-hours are in large jobs (Jeon
  et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads",
  USENIX ATC 2019, Philly; Hu et al., "Characterization and Prediction of Deep Learning
  Workloads in Large-Scale GPU Datacenters", SC 2021, Helios; Kokolis et al., "Revisiting
  Reliability in Large-Scale Machine Learning Research Clusters", 2024, Meta). Here P(size)
  ~ size^-0.6 over 8..4,096 GPUs; larger jobs run larger models, with longer steps (0.5-30 s).
- **Slow ranks** come as persistent hardware faults (a GPU or a node slow until the job
  ends), fail-slow episodes that end by themselves after minutes to an hour, and transient
  bursts of seconds to a minute or two (Wu et al., "FALCON: Pinpointing and Mitigating
  Stragglers for Large-Scale Hybrid-Parallel Training", 2024: fail-slows are frequent, mostly
  transient, some lasting hours; Gunawi et al., "Fail-Slow at Scale", USENIX FAST 2018).
- **By-design imbalance** is the commonest straggling in large jobs: pipeline stages
  (the first and last compute longer; a two-node job lays 2, 4 or 8 stages over the GPUs
  of its two nodes, so a stage fills a node or some of its GPUs), sequence-length imbalance
  shared by a tensor-parallel group, MoE expert load that moves between ranks step to step,
  and mixed GPU models (Lin et al., "Understanding Stragglers in Large Model Training Using
  What-if Analysis", OSDI 2025).
  It is never a fault, and evicting for it never pays.
- **Noise**, two models: ``gauss`` (the one the policy was tuned on): ~0.5-3 % per-step
  compute jitter, rare spikes up to +30 %; ``heavy`` (held out, never tuned on): per-rank
  jitter with heavy tails (Student's t, 3 degrees of freedom, the same spread), a slow AR(1)
  drift of each rank (coefficient 0.98: thermals, clocks, neighbours), and a jitter of the
  whole step that every rank shares (~2 %: the fabric, the input pipeline). Data loading
  jitters in both.

The truth of every slowdown is measured, not assumed: the generator recomputes every step
without that slowdown and records the job's loss (its what-if), as a share of wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from slurm_plugin.trace import Trace
from slurm_plugin.trace_meta import JobFacts, TraceContext

GPUS_PER_NODE = 8
NODES = 2048
MONTH_S = 30 * 86400.0
T0 = 1_780_000_000.0
SIZES = np.array([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
#: Kinds of slowdown that are faults of a node or GPU (what an eviction can fix).
FAULTS = ("persistent", "fail_slow", "burst")
#: A slowdown lasting this long is sustained (bursts are shorter, fail-slow episodes longer).
SUSTAINED_S = 600.0


@dataclass
class Slowdown:
    """One injected slowdown and what it truly cost the job."""

    kind: str  # persistent | fail_slow | burst | input | hang | sync_stall
    node: str | None
    ranks: tuple[int, ...]
    extra: float  # the ranks' compute (or data) slower by this fraction
    onset_ts: float
    #: When it ends (may be past the trace, up to the job's end; inf: until the job ends).
    end_ts: float
    #: The share of the job's wall time it wastes while on (the what-if over the trace).
    loss_frac: float = 0.0

    @property
    def fault(self) -> bool:
        """A compute fault of a node or GPU (what excluding the node fixes)."""
        return self.kind in FAULTS

    def sustained(self, job: JobTruth) -> bool:
        """A fault that lasts at least ``SUSTAINED_S`` (within the job's life)."""
        return self.fault and min(self.end_ts, job.end_ts) - self.onset_ts >= SUSTAINED_S


@dataclass
class JobTruth:
    """One job: its trace window and its whole life."""

    job_id: str
    world: int
    nodes: list[str]
    start_ts: float
    trace_end_ts: float
    end_ts: float  # when it truly ends
    limit_ts: float | None  # its time limit (None: none)
    step_s: float
    checkpoint_s: float  # checkpoint period (it always checkpoints)
    reports_checkpoints: bool
    restart_s: float  # what a requeue truly costs beyond lost work
    structure: str
    labelled: bool
    slowdowns: list[Slowdown] = field(default_factory=list)
    #: When each checkpoint in the trace ended (later ones follow every ``checkpoint_s``).
    checkpoints: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def last_checkpoint(self, ts: float) -> float:
        """The end of the last checkpoint at or before ``ts`` (the start when none)."""
        known = self.checkpoints[self.checkpoints <= ts]
        last = float(known[-1]) if len(known) else self.start_ts
        if ts > self.trace_end_ts:
            last = max(last, last + math.floor((ts - last) / self.checkpoint_s) * self.checkpoint_s)
        return last

    def next_checkpoint(self, ts: float) -> float:
        """The end of the first checkpoint after ``ts``."""
        later = self.checkpoints[self.checkpoints > ts]
        return float(later[0]) if len(later) else self.last_checkpoint(ts) + self.checkpoint_s

    def gpu_hours(self, seconds: float) -> float:
        """Seconds of the whole job as GPU-hours."""
        return seconds * self.world / 3600.0


@dataclass
class Month:
    """The month: jobs with their truth, the trace and its companions, the bad nodes."""

    jobs: list[JobTruth]
    trace: Trace
    context: TraceContext
    bad_nodes: set[str]

    def healthy_nodes(self) -> set[str]:
        """Nodes with no persistent fault and no sustained fail-slow episode."""
        bad = set(self.bad_nodes)
        for job in self.jobs:
            bad |= {s.node for s in job.slowdowns if s.node and s.sustained(job)}
        return {f"n{i:04d}" for i in range(NODES)} - bad


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


@dataclass
class _Plan:
    """A job before it is simulated."""

    job: JobTruth
    steps: int
    noise: float
    faults: list[tuple[str, tuple[int, ...], float, int, int]]  # kind, ranks, extra, on, off
    restart_at: int | None = None
    #: A healthy node with bursts (a noisy daemon) that this job runs on.
    flaky: str | None = None


class _Builder:
    """Draws the month's jobs (sizes, nodes, structure, faults) from one seed."""

    def __init__(self, seed: int, jobs: int, scale: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.count = jobs
        self.scale = scale
        weights = SIZES.astype(float) ** -0.6
        self.size_p = weights / weights.sum()
        # About 0.5 % of nodes carry a hardware fault from a random day of the month on.
        bad = self.rng.choice(NODES, size=max(2, NODES // 200), replace=False)
        self.bad_since = {f"n{int(n):04d}": float(self.rng.uniform(0, 0.7)) for n in bad}

    def plans(self) -> list[_Plan]:
        starts = np.sort(self.rng.uniform(0, MONTH_S * 0.95, size=self.count))
        plans = [self._plan(i, float(T0 + s)) for i, s in enumerate(starts)]
        # Every bad node is in at least two jobs after it went bad: persistence must find it.
        for node, since in self.bad_since.items():
            later = [
                p
                for p in plans
                if p.job.start_ts >= T0 + since * MONTH_S - 3600
                and not set(p.job.nodes) & set(self.bad_since)
            ]
            for k in self.rng.permutation(len(later))[:3].tolist():
                nodes = later[k].job.nodes
                nodes[int(self.rng.integers(len(nodes)))] = node
        # Healthy nodes with bursts in two or three jobs each: bursts never make a node
        # persistent.
        healthy = [f"n{i:04d}" for i in range(NODES) if f"n{i:04d}" not in self.bad_since]
        for node in self.rng.choice(healthy, size=4, replace=False).tolist():
            picks = self.rng.choice(len(plans), size=3, replace=False).tolist()
            for k in picks:
                plan = plans[k]
                if plan.flaky is None and not set(plan.job.nodes) & set(self.bad_since):
                    plan.job.nodes[int(self.rng.integers(len(plan.job.nodes)))] = node
                    plan.flaky = node
        for plan in plans:
            self._faults(plan)
        return plans

    def _plan(self, i: int, start: float) -> _Plan:
        rng = self.rng
        world = int(rng.choice(SIZES, p=self.size_p))
        nodes = [f"n{int(n):04d}" for n in rng.choice(NODES, world // GPUS_PER_NODE, False)]
        step = min(30.0, max(0.5, _loguniform(rng, 0.5, 4.0) * (world / 8) ** 0.3))
        window = rng.uniform(30, 75) * 60.0 * self.scale
        steps = int(min(max(60, window / step), 2400))
        life = max(steps * step * 1.5, _loguniform(rng, 3 * 3600, 72 * 3600))
        limit = None if rng.random() < 0.2 else start + life * rng.uniform(1.0, 1.5)
        roll = rng.random()
        structure = (
            "none"
            if roll < 0.35
            else "pipeline"
            if roll < 0.5
            else "gpu_position"
            if roll < 0.6
            else "moe"
            if roll < 0.7
            else "seq_len"
            if roll < 0.8
            else "mixed_gpus"
            if roll < 0.9
            else "first_stage"
        )
        # Structure spread over nodes needs at least two nodes of each kind: a single node slow
        # from the first step is indistinguishable from a faulty one (and is treated as one).
        # A two-node pipeline lays its stages over the GPUs of both nodes instead.
        small = world < 4 * GPUS_PER_NODE
        if small and structure in {"mixed_gpus", "first_stage"}:
            structure = "none"
        elif small and structure == "pipeline":
            structure = "pipeline" if world == 2 * GPUS_PER_NODE else "none"
        job = JobTruth(
            job_id=f"{100_000 + i}",
            world=world,
            nodes=nodes,
            start_ts=start,
            trace_end_ts=start,
            end_ts=start + life,
            limit_ts=limit,
            step_s=step,
            checkpoint_s=rng.uniform(10, 60) * 60.0,
            reports_checkpoints=rng.random() < 0.7,
            restart_s=rng.uniform(150, 300),
            structure=structure,
            labelled=bool(rng.random() < 0.5),
        )
        restart_at = int(steps * rng.uniform(0.4, 0.7)) if rng.random() < 0.05 else None
        return _Plan(job, steps, rng.uniform(0.005, 0.03), [], restart_at)

    def _faults(self, plan: _Plan) -> None:
        rng, job, t = self.rng, plan.job, plan.steps
        per = GPUS_PER_NODE

        def ranks_of(node_index: int, whole: bool) -> tuple[int, ...]:
            if whole:
                return tuple(range(node_index * per, node_index * per + per))
            return (node_index * per + int(rng.integers(per)),)

        for i, node in enumerate(job.nodes):
            since = self.bad_since.get(node)
            if since is None or job.start_ts < T0 + since * MONTH_S - 3600:
                continue
            first = job.start_ts < T0 + since * MONTH_S  # it goes bad during this job
            onset = int(rng.uniform(0.2, 0.5) * t) if first else 0
            whole = bool(rng.random() < 0.4)
            extra = rng.uniform(0.1, 1.0) if whole else rng.uniform(0.05, 0.4)
            plan.faults.append(("persistent", ranks_of(i, whole), extra, onset, 1 << 30))
        if plan.flaky is not None:
            i = job.nodes.index(plan.flaky)
            at = int(rng.uniform(0.2, 0.6) * t)
            extra = rng.uniform(0.5, 1.5)
            length = max(1, int(rng.uniform(15, 60) / (job.step_s * (1 + extra))))
            plan.faults.append(("burst", ranks_of(i, True), extra, at, at + length))
        if rng.random() < 0.15:  # a fail-slow episode that ends by itself
            i = int(rng.integers(len(job.nodes)))
            whole = bool(rng.random() < 0.5)
            onset = int(rng.uniform(0.15, 0.6) * t)
            length = max(3, int(_loguniform(rng, 180, 3600) / job.step_s))
            extra = rng.uniform(0.1, 0.8)
            plan.faults.append(("fail_slow", ranks_of(i, whole), extra, onset, onset + length))
        if rng.random() < 0.3:  # transient bursts, sometimes twice on one node
            i = int(rng.integers(len(job.nodes)))
            at = int(rng.uniform(0.15, 0.5) * t)
            for _ in range(int(rng.integers(1, 4))):
                extra = rng.uniform(0.3, 2.0)  # 5-90 s of wall time, steps slowed by it
                length = max(1, int(rng.uniform(5, 90) / (job.step_s * (1 + extra))))
                whole = bool(rng.random() < 0.6)
                plan.faults.append(("burst", ranks_of(i, whole), extra, at, at + length))
                at += length + max(2, int(rng.uniform(40, 300) / job.step_s))
        if rng.random() < 0.05:
            r = int(rng.integers(job.world))
            plan.faults.append(("input", (r,), rng.uniform(0.5, 2.0), int(0.3 * t), 1 << 30))
        if rng.random() < 0.03:
            plan.faults.append(("hang", (0,), 0.0, int(0.6 * t), int(0.6 * t) + 1))
        if rng.random() < 0.03:
            plan.faults.append(("sync_stall", (), 2.0, int(0.5 * t), 1 << 30))


def _structure(
    rng: np.random.Generator, job: JobTruth, t: int
) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
    """(per-step x rank compute factor, per-rank static factor or None, group labels)."""
    n = job.world
    nodes = n // GPUS_PER_NODE
    local = np.arange(n) % GPUS_PER_NODE
    node_of = np.arange(n) // GPUS_PER_NODE
    dynamic: np.ndarray = np.ones((t, n))
    static: np.ndarray = np.ones(n)
    labels = [""] * n
    kind = job.structure
    if kind == "pipeline" and nodes == 2:  # 2, 4 or 8 stages over the GPUs of two nodes
        # Drawn from the job's own generator: the month's other jobs keep their draws.
        own = np.random.default_rng([int(job.job_id), int(job.start_ts)])
        stages = int(own.choice([2, 4, 8]))
        stage = np.arange(n) * stages // n
        offsets = own.uniform(0.0, 0.3, size=stages)
        offsets[0] = 0.0
        static = 1.0 + offsets[stage]
        labels = [f"stage{s}" for s in stage]
    elif kind == "pipeline":
        stages = int(min(nodes // 2, rng.choice([2, 4, 8])))  # at least 2 nodes a stage
        stage = node_of * stages // nodes
        offsets = rng.uniform(0.0, 0.3, size=stages)
        offsets[0] = 0.0
        static = 1.0 + offsets[stage]
        labels = [f"stage{s}" for s in stage]
    elif (
        kind == "gpu_position" and nodes >= 2
    ):  # each node holds a whole pipeline: last stage on GPU 7
        offsets = np.zeros(GPUS_PER_NODE)
        offsets[-1] = rng.uniform(0.08, 0.25)
        offsets[0] = rng.uniform(0.0, 0.08)
        static = 1.0 + offsets[local]
        labels = [f"pp{g}" for g in local]
    elif kind == "moe":  # expert load that moves between ranks every step
        dynamic = rng.lognormal(0.0, rng.uniform(0.04, 0.12), size=(t, n))
        labels = ["moe"] * n
    elif kind == "seq_len":  # a node's tensor-parallel group shares each step's sequence load
        shared = rng.lognormal(0.0, rng.uniform(0.03, 0.1), size=(t, nodes))
        dynamic = shared[:, node_of]
        labels = ["tp"] * n
    elif kind == "mixed_gpus":  # half the nodes are another GPU model
        other = rng.random(nodes) < 0.5
        other[:2], other[-2:] = False, True  # at least two nodes of each model
        small = rng.random() < 0.5
        static = 1.0 + other[node_of] * (rng.uniform(0.01, 0.03) if small else 0.25)
        labels = ["sku_b" if other[k] else "sku_a" for k in node_of]
    elif kind == "first_stage":  # a labelled first pipeline stage, slightly longer
        first = node_of < max(2, nodes // 4)
        static = 1.0 + first * rng.uniform(0.01, 0.03)
        labels = ["stage0" if f else "stage1" for f in first]
    return dynamic, (static if kind not in {"none", "moe", "seq_len"} else None), labels


#: The noise models (module docstring): the one tuned on first.
NOISE_MODELS = ("gauss", "heavy")


def _noise(
    rng: np.random.Generator,
    spread: float,
    t: int,
    n: int,
    held_out: np.random.Generator | None = None,
) -> np.ndarray:
    """Each rank's multiplicative compute noise over ``t`` steps: ``gauss`` from ``rng``, or
    ``heavy`` from ``held_out`` (``rng`` draws the same either way, so the month's structure
    and every other draw stay those of the ``gauss`` month)."""
    noise: np.ndarray = 1.0 + spread * rng.standard_normal((t, n))
    if held_out is None:
        return noise
    rng = held_out
    heavy = spread / np.sqrt(3.0) * rng.standard_t(3, (t, n))  # the same variance
    shocks = 0.2 * spread * rng.standard_normal((t, n))
    drift = np.zeros((t, n))
    for i in range(1, t):
        drift[i] = 0.98 * drift[i - 1] + shocks[i]
    shared = np.exp(0.02 * rng.standard_normal(t))[:, None]
    heavy_noise: np.ndarray = np.maximum(0.2, 1.0 + heavy + drift) * shared
    return heavy_noise


def _simulate(  # noqa: PLR0915 - one job's steps and their truth, read top to bottom
    plan: _Plan, rng: np.random.Generator, held_out: np.random.Generator | None = None
) -> dict[str, np.ndarray]:
    """The job's records (steps x ranks), and each slowdown's truth."""
    job, t, n = plan.job, plan.steps, plan.job.world
    dynamic, static, labels = _structure(rng, job, t)
    factor = dynamic * (static if static is not None else 1.0)
    base = job.step_s * 0.7
    noise = _noise(rng, plan.noise, t, n, held_out)
    spikes = (rng.random((t, n)) < 1e-4) * 0.3 * rng.random((t, n))
    healthy = base * factor * noise + base * spikes
    data = 0.03 * job.step_s * (1.0 + 0.3 * rng.random((t, n)))
    steps = np.arange(t)
    extras = []
    compute = healthy.copy()
    transfer = np.full(t, 0.25 * job.step_s)
    pause = np.zeros(t)
    hang_rank = None
    for kind, ranks, extra, on, off in plan.faults:
        on_rows = (steps >= on) & (steps < off)
        if kind in FAULTS:
            add = np.zeros((t, n))
            add[np.ix_(on_rows, np.asarray(ranks, dtype=int))] = extra
            extras.append(add)
            compute += healthy * add
        elif kind == "input":
            data[np.ix_(on_rows, np.asarray(ranks, dtype=int))] += extra * base
        elif kind == "hang":
            pause[on] += 900.0
            hang_rank = (on, ranks[0])
        elif kind == "sync_stall":
            transfer[on_rows] *= 1.0 + extra
    ready = compute + data
    step_s = ready.max(axis=1) + transfer
    every = max(1, round(job.checkpoint_s / job.step_s))
    pause[every::every] += 0.02 * job.checkpoint_s  # writing a checkpoint stalls every rank
    ends = job.start_ts + np.cumsum(step_s + pause)
    if plan.restart_at is not None:  # restarted from its last checkpoint after 2 minutes
        ends = ends + np.where(steps >= plan.restart_at, 120.0, 0.0)
    starts = ends - step_s - pause
    job.trace_end_ts = float(ends[-1])
    job.checkpoints = ends[every::every]
    # The truth of each slowdown: the step without it, as a share of wall time while it is on.
    for (kind, ranks, extra, on, off), add in zip(
        [f for f in plan.faults if f[0] in FAULTS], extras, strict=True
    ):
        without = (compute - healthy * add + data).max(axis=1) + transfer
        rows = slice(on, min(off, t))
        lost = float((step_s - without)[rows].sum())
        wall = float((step_s + pause)[rows].sum())
        onset = float(starts[min(on, t - 1)])
        end = (
            float(ends[off - 1])
            if off <= t
            else min(job.end_ts, job.trace_end_ts + (off - t) * job.step_s)
        )
        node = job.nodes[ranks[0] // GPUS_PER_NODE]
        job.slowdowns.append(
            Slowdown(kind, node, ranks, extra, onset, end, lost / wall if wall > 0 else 0.0)
        )
    for kind, ranks, extra, on, off in plan.faults:
        if kind not in FAULTS and on < t:
            where = job.nodes[ranks[0] // GPUS_PER_NODE] if ranks else None
            end = float(ends[off - 1]) if off <= t else job.end_ts
            job.slowdowns.append(Slowdown(kind, where, ranks, extra, float(starts[on]), end))
    comm = step_s[:, None] - ready
    step_no = np.broadcast_to(steps[:, None], (t, n)).copy()
    ts = np.broadcast_to(ends[:, None], (t, n)) + rng.random((t, n)) * 1e-3
    if plan.restart_at is not None:  # it resumes from its last checkpoint's step
        step_no[plan.restart_at :] -= plan.restart_at - plan.restart_at // every * every
    keep = np.ones((t, n), dtype=bool)
    if hang_rank is not None:
        keep[hang_rank[0] - 1, hang_rank[1]] = False
    full = np.broadcast_to((step_s + pause)[:, None], (t, n))
    rank = np.broadcast_to(np.arange(n), (t, n))
    return {
        "rank": rank[keep],
        "step": step_no[keep],
        "ts": ts[keep],
        "step_s": full[keep],
        "compute_s": compute[keep],
        "comm_s": comm[keep],
        "data_s": data[keep],
        "node_index": (rank // GPUS_PER_NODE)[keep],
        "labels": labels,
    }


def cluster_month(
    seed: int = 0, jobs: int = 120, scale: float = 1.0, noise: str = "gauss"
) -> Month:
    """A month of ``jobs`` jobs on the 16,384-GPU cluster; ``scale`` shortens the traces;
    ``noise`` one of :data:`NOISE_MODELS` (the same jobs and faults under either)."""
    if noise not in NOISE_MODELS:
        raise ValueError(f"noise model {noise!r}: one of {', '.join(NOISE_MODELS)}")
    builder = _Builder(seed, jobs, scale)
    held_out = np.random.default_rng([seed, 7919]) if noise == "heavy" else None
    plans = builder.plans()
    node_names = [f"n{i:04d}" for i in range(NODES)]
    node_code = {n: i for i, n in enumerate(node_names)}
    columns: dict[str, list[np.ndarray]] = {k: [] for k in _ARRAYS}
    group_code: dict[str, int] = {"": 0}
    job_codes, group_codes, node_codes = [], [], []
    for code, plan in enumerate(plans):
        rec = _simulate(plan, builder.rng, held_out)
        for key in _ARRAYS:
            columns[key].append(rec[key])
        codes = np.array([node_code[n] for n in plan.job.nodes])
        node_codes.append(codes[rec["node_index"]])
        job_codes.append(np.full(len(rec["ts"]), code))
        labels = rec["labels"]  # per rank
        per_rank = np.array([group_code.setdefault(g, len(group_code)) for g in labels])
        group_codes.append(per_rank[rec["rank"]] if plan.job.labelled else 0 * rec["rank"])
    merged = {k: np.concatenate(v) for k, v in columns.items()}
    order = np.argsort(merged["ts"], kind="stable")
    ordered_groups = sorted(group_code)
    remap = np.array([ordered_groups.index(g) for g in group_code])
    trace = Trace(
        job_code=np.concatenate(job_codes)[order],
        job_names=[p.job.job_id for p in plans],
        node_code=np.concatenate(node_codes)[order],
        node_names=node_names,
        group_code=remap[np.concatenate(group_codes)[order]],
        group_names=ordered_groups,
        rank=merged["rank"][order].astype(np.int64),
        gpu=(merged["rank"][order] % GPUS_PER_NODE).astype(np.int64),
        step=merged["step"][order].astype(np.int64),
        ts=merged["ts"][order],
        step_s=merged["step_s"][order],
        compute_s=merged["compute_s"][order],
        comm_s=merged["comm_s"][order],
        data_s=merged["data_s"][order],
    )
    context = TraceContext(
        jobs={p.job.job_id: JobFacts(p.job.start_ts, p.job.limit_ts) for p in plans},
        events={
            p.job.job_id: [(float(ts), "checkpoint_end") for ts in p.job.checkpoints]
            for p in plans
            if p.job.reports_checkpoints
        },
    )
    return Month([p.job for p in plans], trace, context, set(builder.bad_since))


_ARRAYS = ("rank", "step", "ts", "step_s", "compute_s", "comm_s", "data_s")
