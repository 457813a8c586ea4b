"""The lengths of slowdowns that pass by themselves (policy/durations.py): bursts alone, and
bursts with fail-slow episodes (the `episode_s` / `episode_share` knobs)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slurm_plugin.policy.durations import Passing

BURSTS = Passing(30.0)
WITH_EPISODES = Passing(30.0, episode_s=600.0, episode_share=0.2)


def _lasting(lengths: Passing, prior: float, lasted: float) -> float:
    on = lengths.on(lasted)
    return prior / (prior + (1.0 - prior) * on)


def test_bursts_alone_keep_the_closed_forms() -> None:
    """Without the episode kind: survival s / (s + L), what is left (s + L) ln(1 + H / (s + L)),
    the age at which a slowdown is as likely as wanted to last s (w (1 - p) / (p (1 - w)) - 1)."""
    lasted, horizon = 1054.0, 30_000.0
    age = 30.0 + lasted
    assert BURSTS.on(lasted) == pytest.approx(30.0 / age)
    assert BURSTS.left(lasted, horizon) == pytest.approx(age * math.log1p(horizon / age))
    assert BURSTS.square(lasted, horizon) == pytest.approx(
        2.0 * age * (horizon - age * math.log1p(horizon / age))
    )
    assert BURSTS.ends_within(lasted, 500.0) == pytest.approx(500.0 / (age + 500.0))
    assert BURSTS.sure_at(0.05, 0.6) == pytest.approx(30.0 * (0.6 * 0.95 / (0.05 * 0.4) - 1.0))


def test_a_slowdown_of_minutes_is_not_yet_taken_for_a_fault_when_episodes_are_known() -> None:
    """The 4,096-GPU case of the hold-out month: a node slow for 17.5 minutes, no other job saw
    it slow (prior 5 %). Bursts alone make it 66 % likely to last the job; with fail-slow
    episodes of a 10-minute median as a fifth of the passing kind it is 36 % likely, and it
    takes an hour to be 60 % sure."""
    assert _lasting(BURSTS, 0.05, 1054.0) == pytest.approx(0.655, abs=0.005)
    assert _lasting(WITH_EPISODES, 0.05, 1054.0) < 0.4
    sure = WITH_EPISODES.sure_at(0.05, 0.6)
    assert _lasting(WITH_EPISODES, 0.05, sure) == pytest.approx(0.6, abs=1e-6)
    assert sure > 3600.0 > BURSTS.sure_at(0.05, 0.6)


def test_the_mixtures_moments_match_a_sample() -> None:
    """What is left of a passing slowdown still on after L (mean and mean square, within a
    horizon) against a large sample of the mixture conditioned on being on at L."""
    rng = np.random.default_rng(7)
    n = 2_000_000
    scale = np.where(rng.random(n) < 0.2, 600.0, 30.0)
    length = scale * (1.0 / rng.random(n) - 1.0)  # Pareto II, shape 1
    lasted, horizon = 900.0, 7200.0
    left = np.minimum(length[length > lasted] - lasted, horizon)
    assert WITH_EPISODES.left(lasted, horizon) == pytest.approx(left.mean(), rel=0.02)
    assert WITH_EPISODES.square(lasted, horizon) == pytest.approx((left**2).mean(), rel=0.03)
    assert WITH_EPISODES.ends_within(lasted, 600.0) == pytest.approx(
        (left <= 600.0).mean(), abs=0.01
    )
