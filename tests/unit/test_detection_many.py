"""Many small jobs in one pass (detection/many.py) against the per-job detector: the same
sequences through both give the same events and leave the same state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from slurm_plugin.detection import many, window
from slurm_plugin.detection.detector import Detector
from slurm_plugin.detection.job import JobDetector
from slurm_plugin.model.batch import RecordBatch

CYCLES = 70


def _job(
    rng: np.random.Generator, nodes: int, per_node: int, kind: str
) -> Callable[[int, int], RecordBatch]:
    """Steps ``first .. first + count - 1`` of one job: ``kind`` says what goes wrong."""
    ranks = nodes * per_node
    design = np.ones(ranks)
    if kind == "structure":
        design[:per_node] = 1.25  # the first node's ranks do more work by design

    def steps(first: int, count: int) -> RecordBatch:
        rank = np.tile(np.arange(ranks), count)
        step = np.repeat(np.arange(first, first + count), ranks)
        size = len(rank)
        compute = 0.5 * design[rank] * (1 + 0.02 * rng.standard_normal(size))
        comm = 0.2 + 0.01 * rng.standard_normal(size)
        data = 0.05 + 0.002 * rng.standard_normal(size)
        late = step >= 90
        if kind == "slow-gpu":
            compute[late & (rank == 1)] *= 1.4
        elif kind == "slow-node":
            compute[late & (rank // per_node == nodes - 1)] *= 1.3
        elif kind == "input":
            data[late & (rank == 2)] += 0.2
        elif kind == "sync":
            comm[late] += 0.3
        elif kind == "gaps":
            compute[rng.random(size) < 0.05] = np.nan
            data[rng.random(size) < 0.05] = np.nan
        elif kind == "no-phases":
            comm[:] = np.nan
            data[:] = np.nan
        return RecordBatch(
            rank=rank,
            step=step,
            attempt=np.zeros(size, dtype=np.int64),
            gpu=rank % per_node,
            ts=1000.0 + step + 0.001 * rank,
            step_s=np.ones(size),
            compute_s=compute,
            comm_s=comm,
            data_s=data,
            node=[f"n{r // per_node}" for r in rank],
        )

    return steps


KINDS = ["healthy", "slow-gpu", "slow-node", "input", "sync", "gaps", "no-phases", "structure"]


def _run(seed: int, batched: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Detector, int]:
    rng = np.random.default_rng(seed)
    layouts = [(1, 8), (2, 8), (1, 4), (3, 4)]
    jobs = {
        f"{kind}-{nodes}x{per_node}": _job(rng, nodes, per_node, kind)
        for kind in KINDS
        for nodes, per_node in layouts
    }
    committed = 0
    real = many.process_quiet

    def counted(dets: list[JobDetector], blocks: list[Any]) -> list[bool]:
        nonlocal committed
        done = real(dets, blocks)
        committed += sum(done)
        return done

    monkeypatch.setattr(many, "MIN_GROUP", 2 if batched else 10**9)
    monkeypatch.setattr(many, "process_quiet", counted)
    det = Detector()
    step = 0
    events = []
    for _cycle in range(CYCLES):
        count = int(rng.integers(1, 4))  # one to three new steps a cycle
        for job_id, steps in jobs.items():
            det.add(job_id, steps(step, count))
        step += count
        events.append(sorted((e.job_id, e.to_dict()) for e in det.advance()))
    return events, det, committed


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=where)
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, nan_ok=True), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _state(job: JobDetector) -> dict[str, Any]:
    tail = job._tail
    episodes = job._episodes
    return {
        "steps_done": job.steps_done,
        "spread": job._spread,
        "rank_s": job._charts.rank_s,
        "node_s": job._charts.node_s,
        "end_rank": job._charts.end_rank,
        "end_node": job._charts.end_node,
        "input_s": job._input_s,
        "level": job._level,
        "level_spread": job._level_spread,
        "level_steps": job._level_steps,
        "flagged": job._flagged,
        "sync": (job._sync._level, job._sync.flagged, job._sync._base),
        "tail": {name: getattr(tail, name) for name in window.ROWS} if tail else None,
        "calm": dict(episodes._calm),
        "calm_ts": dict(episodes._calm_ts),
        "block_ts": episodes._block_ts,
        "open": dict(episodes._open),
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stacked_jobs_raise_the_same_events_and_keep_the_same_state(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone, one_by_one, none = _run(seed, False, monkeypatch)
    stacked, together, committed = _run(seed, True, monkeypatch)
    assert none == 0
    # Most job-cycles went through the stacked pass; the slowed jobs' alarms did not.
    assert committed > len(KINDS) * 4 * (CYCLES - 30) // 2
    raised = {job for cycle in alone for job, _ in cycle}
    assert {"slow-gpu-1x8", "slow-node-2x8", "input-1x8", "sync-1x8"} <= raised
    _same(stacked, alone, "events")
    for job_id, state in one_by_one._jobs.items():
        other = together._jobs[job_id]
        assert state.detector is not None
        assert other.detector is not None
        _same(_state(other.detector), _state(state.detector), job_id)


def test_a_block_that_ends_the_warm_up_goes_to_the_per_job_detector() -> None:
    """The end of the warm-up learns the job's structure: never in the stacked pass. Blocks
    inside the warm-up and after it are stacked."""
    det = Detector()
    steps = _job(np.random.default_rng(0), 1, 8, "healthy")
    det.add("a", steps(0, 4))
    det.advance()
    state = det._jobs["a"]
    job = state.detector
    assert job is not None
    assert job._warm_target == 20
    assert job.steps_done == 4
    det.add("a", steps(4, 5))
    block = det._ready(state, final=False)
    assert block is not None
    assert many.eligible(job, block)
    job.process(block)
    det.add("a", steps(9, 30))
    block = det._ready(state, final=False)
    assert block is not None
    assert not many.eligible(job, block)
    job.process(block)
    assert job.learned
    det.add("a", steps(39, 5))
    block = det._ready(state, final=False)
    assert block is not None
    assert many.eligible(job, block)


def test_records_left_waiting_hold_no_view_of_the_cycles_columns() -> None:
    """The service's decoder hands each job a slice of one cycle's columns; records that wait
    (a rank has not reported the step yet) must not keep those columns alive, and neither may
    a stacked job's tail keep the group's arrays (a job that stops reporting keeps its tail
    until it ends)."""
    steps = _job(np.random.default_rng(0), 1, 8, "healthy")
    whole = RecordBatch.concat([steps(0, 30), steps(30, 1)])
    det = Detector()
    det.add("a", whole.take(slice(0, 8 * 30)))
    det.add("b", whole.take(slice(0, 8 * 30)))
    det.advance()  # both jobs stacked: the warm-up's 20 steps, then the other 10
    tail = det._jobs["a"].detector._tail if det._jobs["a"].detector else None
    assert tail is not None
    assert all(getattr(tail, name).base is None for name in window.ROWS)
    waiting = whole.take(slice(8 * 30, 8 * 30 + 7))  # step 30 of ranks 0-6: incomplete
    det.add("a", waiting)
    det.advance()
    pending = det._jobs["a"].pending
    assert len(pending) == 1
    assert len(pending[0]) == 7
    assert not np.shares_memory(pending[0].compute_s, whole.compute_s)
