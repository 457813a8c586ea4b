"""Issue 36, the held-out noise model: healthy ranks that drift slowly (thermals, clocks,
neighbours) are not stragglers, however the CUSUM charts see them; a slow GPU among them is.

The detector reports how far a straggler's smoothed level stands above the other ranks'
spread of levels (``level_z``) and the bar for a job of that many ranks (``level_z_min``);
the decision acts on none under its bar and node history never counts it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from slurm_plugin.detection import Detector, StragglerEvent
from slurm_plugin.detection.attribution import stand_out
from slurm_plugin.policy.decide import is_slowdown
from slurm_plugin.policy.loader import load_policy
from tests.scenarios.generator import JobSpec, Slowdown, generate, step_change

STEPS = 3000
EVICT = load_policy(Path(__file__).resolve().parents[2] / "policies" / "evict.toml")


def _drift(seed: int, std: float, phi: float = 0.98) -> Slowdown:
    """A rank's slow AR(1) drift (stationary standard deviation ``std``), as a slowdown."""
    rng = np.random.default_rng(seed)
    shocks = std * math.sqrt(1.0 - phi * phi) * rng.standard_normal(STEPS)
    series = np.zeros(STEPS)
    series[0] = std * rng.standard_normal()
    for i in range(1, STEPS):
        series[i] = phi * series[i - 1] + shocks[i]
    return lambda steps: series[steps]


def _drifting_job(world: int, fault: dict[int, Slowdown] | None = None) -> list[StragglerEvent]:
    slow = {rank: _drift(100 + rank, 0.03) for rank in range(world)}
    for rank, extra in (fault or {}).items():
        drift_of = slow[rank]
        slow[rank] = lambda steps, d=drift_of, f=extra: d(steps) + f(steps)  # type: ignore[misc]
    spec = JobSpec("9", world, STEPS, compute_s=1.0, noise=0.01, seed=4, compute_slow=slow)
    det = Detector()
    det.add(spec.job_id, generate(spec))
    return [e for e in det.advance(final=True) if isinstance(e, StragglerEvent)]


def test_healthy_ranks_that_drift_are_reported_but_never_acted_on() -> None:
    """16 healthy ranks, each drifting by ~3 % over ~50 steps: the charts flag the slowest
    of them now and then with slowdowns and job losses above the policy's minimums (what
    evicted healthy nodes in the held-out months), and every such report blends in."""
    policy = EVICT
    reports = [e for e in _drifting_job(16) if e.cause == "compute"]
    passing_before = [
        e
        for e in reports
        if e.slowdown_pct >= policy.detection.min_slowdown_pct
        and (e.job_loss_pct or 0.0) >= policy.detection.min_job_loss_pct
    ]
    assert passing_before, "the drift must look like a straggler to the charts"
    assert all(e.level_z is not None and e.level_z_min is not None for e in reports)
    assert all(e.blends_in for e in passing_before), [
        (e.step, e.level_z, e.level_z_min) for e in passing_before if not e.blends_in
    ]
    assert not any(is_slowdown(e, policy) for e in reports)


def test_a_slow_gpu_among_drifting_ranks_stands_out() -> None:
    """The same job with one GPU +20 % from step 1500: it clears the bar within a few
    hundred steps and is a slowdown the policy acts on; no other node ever does."""
    reports = _drifting_job(16, {5: step_change(0.20, 1500)})
    faulty = [e for e in reports if e.step >= 1500 and 5 in e.ranks and not e.blends_in]
    assert faulty
    assert faulty[0].step <= 1500 + 300
    assert is_slowdown(faulty[0], EVICT)
    assert faulty[0].level_z is not None
    assert faulty[0].level_z_min is not None
    assert faulty[0].level_z >= faulty[0].level_z_min
    others = [e for e in reports if 5 not in e.ranks and is_slowdown(e, EVICT)]
    assert not others


def test_the_bar_grows_with_ranks_and_widens_for_few() -> None:
    """The bar is the normal quantile 1 - alpha / ranks, widened for a spread from few ranks;
    too few other ranks give no bar, and identical others make any excess stand out."""
    rng = np.random.default_rng(1)
    bars = []
    for world in (8, 64, 4096):
        level = 0.01 * rng.standard_normal(world)
        z, bar = stand_out(level, [0], 0.001)
        assert z is not None
        assert bar is not None
        bars.append(bar)
    assert bars[0] > bars[1]  # eight ranks: the spread itself is uncertain
    _, pooled = stand_out(0.01 * rng.standard_normal(8), [0], 0.001, pooled=4.0)
    assert pooled is not None
    assert pooled < bars[0]  # ... less so once the smoothed spread took in many steps
    assert 4.5 < bars[2] < 5.5  # 4,096 ranks: the normal quantile 1 - 0.001 / 4096 ~ 5.0
    assert stand_out(np.zeros(4), [0], 0.001) == (None, None)
    level = np.zeros(16)
    level[3] = 0.05
    z, _ = stand_out(level, [3], 0.001)
    assert z == math.inf
    # The spread smoothed over the job's steps bounds a lucky tight row from below.
    level = 0.001 * rng.standard_normal(64)
    level[7] = 0.03
    tight, _ = stand_out(level, [7], 0.001)
    floored, _ = stand_out(level, [7], 0.001, spread_floor=0.02)
    assert tight is not None
    assert floored is not None
    assert tight > 10 > floored


def test_a_whole_slow_node_of_a_two_node_job_stands_out() -> None:
    """Half the ranks slow (a whole node of a two-node job, +90 % from the first step): the
    spread of levels is taken within nodes, so the slow half never widens it, and the node
    clears its bar from its first reports (it blended in, and its node was never marked)."""
    slow = {rank: step_change(0.9, 0) for rank in range(8, 16)}
    spec = JobSpec("8", 16, 600, compute_s=1.0, noise=0.02, seed=5, compute_slow=slow)
    det = Detector()
    det.add(spec.job_id, generate(spec))
    reports = [e for e in det.advance(final=True) if isinstance(e, StragglerEvent)]
    assert reports
    assert all(e.node == "n0001" for e in reports)
    assert all(not e.blends_in for e in reports), [(e.step, e.level_z) for e in reports]
    assert is_slowdown(reports[0], EVICT)
