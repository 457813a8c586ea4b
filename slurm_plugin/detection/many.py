"""Many small jobs in one pass: the per-job detector's arithmetic for a group of jobs of the
same layout, as one set of numpy calls instead of one set per job (pure).

A job of 8 ranks costs the detector ~0.7 ms per call whatever it brings (one step or ten): the
numpy calls, not the arithmetic. Under 2,000 such jobs that is 1.4 s per cycle. Here the jobs
of one layout (the same ranks on the same number of nodes, under four nodes, the same number
of new steps, past their warm-up) are stacked, jobs x steps x ranks, and their charts run
side by side as columns of the same CUSUMs (:func:`process_quiet`).

Only a job whose steps raise nothing is committed from here: a job on which any chart
crosses its threshold, or whose sync chart would alarm, is handed back and goes through
:meth:`JobDetector.process`, which attributes and reports (nothing of its state was touched
here). So this module never builds an event; it is the arithmetic of
:meth:`JobDetector._process` for the steps that end in none, and a test runs the same
sequences through both and compares every state and every event
(``tests/unit/test_detection_many.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from slurm_plugin.detection import window
from slurm_plugin.detection.attribution import level_spread
from slurm_plugin.detection.block import Block
from slurm_plugin.detection.charts import CAP, bank, references
from slurm_plugin.detection.job import _INPUT_THRESHOLD, JobDetector
from slurm_plugin.detection.params import F64
from slurm_plugin.detection.stats import (
    MAD_TO_SIGMA,
    cusum,
    ewma,
    ewma_columns,
    row_median,
)

#: A job of this many nodes or more is never processed here: its node charts' spread across
#: nodes (``JobCharts._node_inflation``) is state this module does not carry, and such a
#: job amortises its own calls.
MAX_NODES = 4
#: Steps per job at most in one pass (the service brings a few per cycle; a replay brings
#: thousands, which go through the per-job detector in its own blocks).
MAX_ROWS = 64
#: Fewer jobs of one layout than this are not worth stacking.
MIN_GROUP = 2


def warmup_cut(det: JobDetector, block: Block) -> int:
    """The rows of ``block`` up to the end of the job's warm-up when it ends inside the
    block (0 otherwise): they go here first, then the job learns its structure, then the
    rest of the block goes."""
    rows = len(block.steps)
    if det.learned or not 0 < rows <= MAX_ROWS:
        return 0
    cut = det._warmup_target(block) - det.steps_done
    return cut if 0 < cut < rows else 0


def eligible(det: JobDetector, block: Block) -> bool:
    """Whether ``det`` may process ``block`` here: a small job, a short block, and either
    past its warm-up or with the warm-up going on up to the block's end at most."""
    rows = len(block.steps)
    if not 0 < rows <= MAX_ROWS:
        return False
    target = det._warmup_target(block)  # set from a job's first block, as process() would
    return (
        (det.steps_done >= target if det.learned else det.steps_done + rows <= target)
        and len(det.node_names) < MAX_NODES
        and det.world > 0
    )


def group_key(det: JobDetector, block: Block) -> tuple[object, ...]:
    """Jobs that can be stacked share this: ranks, their nodes, steps, parameters."""
    return (det.world, det.rank_node.tobytes(), len(block.steps), id(det.params))


def process_quiet(dets: Sequence[JobDetector], blocks: Sequence[Block]) -> list[bool]:
    """Run every job of one group (:func:`group_key`) over its block; commit the state of
    those on which nothing crosses a threshold (True) and leave the others untouched (False:
    the caller gives them to :meth:`JobDetector.process`)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return _process(dets, blocks)


def _process(dets: Sequence[JobDetector], blocks: Sequence[Block]) -> list[bool]:  # noqa: PLR0915
    first = dets[0]
    p = first.params
    jobs, rows, ranks = len(dets), len(blocks[0].steps), first.world
    nodes = len(first.node_names)
    flat = (jobs * rows, ranks)

    compute = np.stack([b.compute for b in blocks])  # jobs x rows x ranks
    scale = np.stack([d._scale if d._scale is not None else np.ones(ranks) for d in dets])
    c = compute / scale[:, None, :]
    med_c = row_median(c.reshape(flat)).reshape(jobs, rows)
    valid = (np.sum(np.isfinite(c), axis=2) >= p.min_world_size) & (med_c > 0)
    rel = c / med_c[:, :, None] - 1.0
    mad = row_median(np.abs(rel).reshape(flat)).reshape(jobs, rows) * MAD_TO_SIGMA
    smooth = _ewma_rows(
        np.where(valid, mad, np.nan), first._alpha, np.array([d._spread for d in dets])
    )
    spread = np.fmax(np.fmax(smooth, mad), p.spread_floor_pct / 100.0)
    spread = np.where(valid, spread, np.nan)
    z = np.clip(rel / spread[:, :, None], -p.clip, p.clip)
    z = np.where(np.isfinite(z), z, 0.0)
    # Rows of the warm-up: not live; what they add to each rank's by-design offset (the
    # structure learned at its end) is summed as JobDetector._warm_up does.
    warm_rows = np.clip(
        np.array([d._warm_target or 0 for d in dets]) - np.array([d.steps_done for d in dets]),
        0,
        rows,
    )
    in_warm = np.arange(rows)[None, :] < warm_rows[:, None]
    live = valid & ~in_warm
    log_ratio = np.log(c / med_c[:, :, None])
    warm_ok = np.isfinite(log_ratio) & (valid & in_warm)[:, :, None]
    warm_log = np.where(warm_ok, log_ratio, 0.0)
    warm_sums = (warm_log.sum(axis=1), (warm_log**2).sum(axis=1), warm_ok.sum(axis=1))

    k_base = np.clip(0.5 * p.min_slowdown_pct / 100.0 / spread, 0.1, 0.5 * p.clip)
    k_base = np.where(live, k_base, 1.0)
    ks = [(k_base * 2.0**i).reshape(-1) for i in range(p.charts)]
    node_z, node_measured, node_n = first._charts.node_scores(z.reshape(flat), c.reshape(flat))
    refs = references(ks, node_n, p.false_alarm_arl * p.charts)

    def wide(values: F64, cols: int) -> F64:
        """jobs x rows x cols -> rows x (jobs x cols): every job's columns side by side."""
        return values.reshape(jobs, rows, cols).transpose(1, 0, 2).reshape(rows, jobs * cols)

    def per_row(values: np.ndarray, cols: int) -> np.ndarray:
        """A value per job and row, repeated over the job's columns (rows x jobs x cols)."""
        return wide(np.repeat(values.reshape(jobs * rows, 1), cols, axis=1), cols)

    live_wide = per_row(live, ranks)
    rank_s = np.concatenate([d._charts.rank_s for d in dets], axis=1)  # charts x (jobs x ranks)
    rank_hit = bank(
        wide(z, ranks),
        [per_row(k, ranks) for k in ks],
        [per_row(h, ranks) for h in refs.rank_h],
        live_wide,
        rank_s,
    )
    rank_hit = np.where(np.isfinite(wide(c, ranks)), rank_hit, 0.0)
    node_live = per_row(live, nodes)
    node_s = np.concatenate([d._charts.node_s for d in dets], axis=1)
    node_hit = bank(
        wide(node_z, nodes),
        [wide(k, nodes) for k in refs.node_k],
        [wide(h, nodes) for h in refs.node_h],
        node_live,
        node_s,
    )
    node_hit = np.where(wide(node_measured, nodes), node_hit, 0.0)

    # The end charts (JobCharts._ended): ranks and nodes as columns of one CUSUM.
    end_h = per_row(refs.end_h, ranks)
    end_node_h = wide(refs.end_node_h, nodes)
    end_inc = np.hstack(
        [per_row(ks[0], ranks) - wide(z, ranks), wide(refs.end_node_k - node_z, nodes)]
    )
    end_start = np.concatenate(
        [
            np.concatenate([d._charts.end_rank for d in dets]),
            np.concatenate([d._charts.end_node for d in dets]),
        ]
    )
    both = cusum(
        np.where(np.hstack([live_wide, node_live]), end_inc, 0.0),
        end_start,
        CAP * np.hstack([end_h, end_node_h]),
    )
    end_d, end_dn = both[:, : jobs * ranks], both[:, jobs * ranks :]
    ended_rank = end_d >= end_h * (1.0 - 1e-9)
    ended_node = end_dn >= end_node_h * (1.0 - 1e-9)

    # The input chart.
    data = np.stack([b.data for b in blocks])
    med_d = row_median(data.reshape(flat)).reshape(jobs, rows)
    excess_c = (c - med_c[:, :, None]) / med_c[:, :, None]
    excess_d = (data - med_d[:, :, None]) / med_c[:, :, None]
    input_inc = np.clip(excess_d / (p.input_min_slowdown_pct / 100.0), -1.0, 2.0)
    input_inc = np.where(np.isfinite(input_inc) & live[:, :, None], input_inc - 0.5, 0.0)
    input_s = cusum(wide(input_inc, ranks), np.concatenate([d._input_s for d in dets]))
    input_hit = (input_s > _INPUT_THRESHOLD) & np.isfinite(wide(data, ranks))

    # The sync-stall chart (SyncStallChart.process), where it runs.
    comm = np.stack([b.comm for b in blocks])
    step_s = np.stack([b.step_s for b in blocks])
    sync_level, sync_hit, sync_runs, sync_warm, sync_base = _sync(
        dets, comm, step_s, med_c, live, warm_rows
    )

    quiet = ~(
        (rank_hit >= 1.0).reshape(rows, jobs, ranks).any(axis=(0, 2))
        | (node_hit >= 1.0).reshape(rows, jobs, nodes).any(axis=(0, 2))
        | input_hit.reshape(rows, jobs, ranks).any(axis=(0, 2))
        | sync_hit
    )
    if not quiet.any():
        return [False] * jobs

    # What the quiet jobs keep: the levels, the tail, the episodes' calm steps.
    level = ewma_columns(
        wide(np.where(live[:, :, None], excess_c, np.nan), ranks),
        first._level_alpha,
        np.concatenate([d._level for d in dets]),
    )
    level = level.reshape(rows, jobs, ranks).transpose(1, 0, 2)  # jobs x rows x ranks
    spread_of_levels = _envelope_rows(
        level_spread(level.reshape(flat), first._order, first._node_starts).reshape(jobs, rows),
        0.5 ** (0.25 / p.level_halflife_steps),
        np.array([d._level_spread for d in dets]),
    )
    age = np.array([d._level_steps for d in dets])[:, None] + np.cumsum(live, axis=1)
    data_filled = np.where(np.isfinite(data), data, 0.0)
    ready = compute + data_filled
    healthy = data_filled + med_c[:, :, None] * scale[:, None, :]
    input_calm = first._episodes.input_calm(
        (input_s / _INPUT_THRESHOLD).reshape(rows, jobs, ranks).transpose(1, 0, 2).reshape(flat)
    ).reshape(jobs, rows, nodes)

    rank_s = rank_s.reshape(p.charts, jobs, ranks)
    node_s = node_s.reshape(p.charts, jobs, nodes)
    input_last = input_s[-1].reshape(jobs, ranks)
    end_last_rank = end_d[-1].reshape(jobs, ranks)
    end_last_node = end_dn[-1].reshape(jobs, nodes)
    ts = np.stack([b.ts for b in blocks])
    # The episodes' calm steps (Episodes.block, close_block), per job and column.
    calm = {
        "compute:rank": ended_rank.reshape(rows, jobs, ranks).transpose(1, 0, 2),
        "compute:node": ended_node.reshape(rows, jobs, nodes).transpose(1, 0, 2),
        "input:node": input_calm,
    }
    calm_ts = {kind: _last_calm(dets, kind, values, ts) for kind, values in calm.items()}
    done: list[bool] = [bool(q) for q in quiet]
    for j, det in enumerate(dets):
        if not done[j]:
            continue
        if math.isfinite(smooth[j, -1]):
            det._spread = float(smooth[j, -1])
        det._charts.rank_s = rank_s[:, j].copy()
        det._charts.node_s = node_s[:, j].copy()
        det._charts.end_rank = end_last_rank[j].copy()
        det._charts.end_node = end_last_node[j].copy()
        det._input_s = input_last[j].copy()
        det._level = level[j, -1].copy()
        det._level_steps = int(age[j, -1])
        if math.isfinite(spread_of_levels[j, -1]):
            det._level_spread = float(spread_of_levels[j, -1])
        if warm_rows[j]:
            det._warm.log[:] += warm_sums[0][j]
            det._warm.log2[:] += warm_sums[1][j]
            det._warm.n[:] += warm_sums[2][j]
        det.steps_done += rows
        if sync_runs[j]:
            det._sync._level = float(sync_level[j])
        if sync_base[j] is not None:
            det._sync._base = sync_base[j]
        warm_sync = sync_warm[j]
        if warm_sync is not None:
            det._sync._warm.append(warm_sync)
        if not det.learned and det.steps_done >= (det._warm_target or 0):
            det._learn_structure()  # the warm-up ended with this block (as process() does)
        episodes = det._episodes
        # (copies, as the tails: a job keeps them until its next block)
        episodes.block(ts[j].copy(), {kind: values[j].copy() for kind, values in calm.items()})
        episodes._calm_ts = {kind: values[j].copy() for kind, values in calm_ts.items()}
    tail = [
        excess_c,
        excess_d,
        z,
        ready,
        healthy,
        step_s,
        ts,
        np.stack([b.steps for b in blocks]).astype(float),
        comm,
        level,
        spread_of_levels,
        age / p.level_halflife_steps,
        med_c,
    ]
    _keep_tails(dets, [j for j in range(jobs) if done[j]], tail, p.attribution_steps)
    return done


def _last_calm(dets: Sequence[JobDetector], kind: str, calm: np.ndarray, ts: F64) -> F64:
    """Per job and column, the time of its last calm step up to this block's end
    (Episodes.close_block for every job at once): jobs x columns."""
    rows = calm.shape[1]
    last = rows - 1 - np.argmax(calm[:, ::-1], axis=1)  # jobs x columns
    was = np.stack([d._episodes._calm_ts.get(kind, np.full(calm.shape[2], -np.inf)) for d in dets])
    return np.where(calm.any(axis=1), np.take_along_axis(ts, last, axis=1), was)


def _keep_tails(
    dets: Sequence[JobDetector], members: list[int], rows: list[np.ndarray], keep: int
) -> None:
    """Each job's tail (JobDetector._window): its last ``keep`` rows of the tail it had and
    this block's (``rows``: the tail's fields, jobs first), for the jobs of ``members``;
    jobs of the same tail length at once."""
    by_length: dict[int, list[int]] = {}
    for j in members:
        tail = dets[j]._tail
        length = tail.z.shape[0] if tail is not None and tail.z.shape[1] == dets[j].world else 0
        by_length.setdefault(length, []).append(j)
    for length, group in by_length.items():
        new = [values[group] for values in rows]
        if length:
            old = [np.stack([getattr(dets[j]._tail, name) for j in group]) for name in window.ROWS]
            new = [np.concatenate([a, b], axis=1) for a, b in zip(old, new, strict=True)]
        kept = [values[:, -keep:] for values in new]
        for i, j in enumerate(group):
            # Copies: a view would hold the whole group's arrays for as long as any one job
            # keeps its tail (a job that stops reporting keeps it until it ends).
            dets[j]._tail = window.Window(*(values[i].copy() for values in kept))


def _sync(
    dets: Sequence[JobDetector],
    comm: F64,
    step_s: F64,
    med_c: F64,
    live: np.ndarray,
    warm_rows: np.ndarray,
) -> tuple[F64, np.ndarray, np.ndarray, list[F64 | None], list[tuple[float, float, float] | None]]:
    """Per job, the sync chart (SyncStallChart.process): its level after the block, whether
    it would alarm, whether it ran, the warm-up rows it keeps for its baseline, and its
    baseline when it is set on this block."""
    jobs, rows = med_c.shape
    p = dets[0].params
    level = np.zeros(jobs)
    hit = np.zeros(jobs, dtype=bool)
    runs = np.zeros(jobs, dtype=bool)
    warm: list[F64 | None] = [None] * jobs
    new_base: list[tuple[float, float, float] | None] = [None] * jobs
    has_comm = np.asarray(np.isfinite(comm).any(axis=(1, 2)))
    base = np.full((jobs, 3), np.nan)
    low_comm = np.fmin.reduce(comm, axis=2)  # jobs x rows
    for j, det in enumerate(dets):
        sync = det._sync
        if sync.flagged or not has_comm[j]:
            continue
        if sync._base is None:
            pieces = list(sync._warm)
            if not det.learned:  # (a warm-up row's median step time: its own, one value)
                if warm_rows[j]:
                    w = int(warm_rows[j])
                    kept = np.c_[low_comm[j, :w], med_c[j, :w], step_s[j, :w]]
                    warm[j] = kept
                    pieces.append(kept)
                if det.steps_done + rows < (det._warm_target or 0):
                    continue  # the warm-up goes on after this block
            if not pieces:
                continue
            found = row_median(np.vstack(pieces).T)  # set on this block, kept if quiet
            if not np.all(np.isfinite(found)) or found[2] <= 0:
                continue
            new_base[j] = (float(found[0]), float(found[1]), float(found[2]))
        runs[j] = True
        base[j] = new_base[j] or sync._base
        level[j] = sync._level
    if not runs.any():
        return level, hit, runs, warm, new_base
    flat = np.abs(med_c / base[:, 1:2] - 1.0) < 0.1
    rise = (low_comm - base[:, 0:1]) / base[:, 2:3]
    inc = np.clip(rise / (p.sync_stall_min_rise_pct / 100.0), -1.0, 4.0) - 0.5
    inc = np.where(live & flat & np.isfinite(inc) & runs[:, None], inc, 0.0)
    chart = cusum(inc.T, level)  # rows x jobs
    hit |= runs & (chart > 0.5 * p.sync_stall_steps).any(axis=0)
    return chart[-1], hit, runs, warm, new_base


def _ewma_rows(values: F64, alpha: float, start: F64) -> F64:
    """:func:`slurm_plugin.detection.stats.ewma` of each row (jobs x steps) from its own
    start: its closed form for every row that has no gap and a start at once, the function
    itself for the others."""
    n = values.shape[1]
    decay = 1.0 - alpha
    idx = np.arange(1, n + 1, dtype=np.float64)
    finite = np.isfinite(values)
    closed = finite.all(axis=1) & np.isfinite(start)
    out = np.empty_like(values)
    if closed.any():
        cum = np.cumsum((decay ** (-idx))[None, :] * values[closed], axis=1)
        out[closed] = decay**idx * (start[closed][:, None] + alpha * cum)
    for j in np.flatnonzero(~closed).tolist():  # a gap or no start yet: the one-row form
        out[j] = ewma(values[j], alpha, float(start[j]))
    return out


def _envelope_rows(values: F64, decay: float, start: F64) -> F64:
    """:func:`slurm_plugin.detection.stats.envelope` of each row from its own start."""
    out = np.empty_like(values)
    state = np.where(np.isfinite(start), start, 0.0)
    for i in range(values.shape[1]):
        state = np.fmax(state * decay, values[:, i])
        out[:, i] = state
    return out
