"""Detector parameters and the CUSUM arithmetic behind them (pure).

The false-alarm target is expressed as an average run length (ARL) in rank-steps: the default
is one false alarm a month on a 16,384-GPU cluster at one step per second per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]

SECONDS_PER_MONTH = 30 * 24 * 3600
DEFAULT_ARL = float(SECONDS_PER_MONTH * 16_384)  # rank-steps between false alarms (~4.2e10)
_SIEGMUND = 1.166  # Siegmund's correction of the boundary overshoot for N(0, 1) increments


@dataclass(frozen=True)
class DetectionParams:
    """What the detector looks for and how sure it must be (policy ``[detection]`` values)."""

    min_slowdown_pct: float = 3.0
    #: A compute report whose what-if says the node costs the job less than this share of
    #: its step time (%) is no slowdown of the job: it neither starts nor continues an
    #: episode (and the policy acts on none).
    min_job_loss_pct: float = 0.5
    #: A straggler's level must stand out from the job's rank-to-rank spread of levels by
    #: the normal quantile ``1 - outlier_alpha / ranks`` (attribution.stand_out).
    outlier_alpha: float = 0.001
    #: Each rank's level (its relative excess compute) is smoothed over this many steps'
    #: half-life for that comparison: long against the slow drift of healthy ranks.
    level_halflife_steps: float = 128.0
    false_alarm_arl: float = DEFAULT_ARL
    warmup_steps: int = 20
    #: The warm-up also ends after this many seconds of steps (at least 3 steps): a job of
    #: 30 s steps is watched after a few steps, not after ten minutes.
    warmup_s: float = 60.0
    #: Ranks that share an offset from the warm-up on, across at least this many nodes, are
    #: structure (a pipeline stage, a different SKU), compared with themselves from then on.
    structure_min_nodes: int = 2
    hang_timeout_s: float = 300.0
    clip: float = 6.0
    spread_floor_pct: float = 0.1
    spread_halflife_steps: float = 44.0
    charts: int = 3
    min_world_size: int = 4
    node_fraction: float = 0.5
    input_min_slowdown_pct: float = 10.0
    input_clip: float = 3.0
    sync_stall_min_rise_pct: float = 20.0
    sync_stall_steps: float = 10.0
    lag_steps: int = 3
    attribution_steps: int = 32
    #: A node still flagged is reported again after this many steps or seconds, whichever
    #: comes first (a tenth of either when its estimate was under the minimum): each report
    #: is decided on anew, with how long the slowdown has lasted by then.
    rearm_steps: int = 200
    rearm_s: float = 30.0

    def __post_init__(self) -> None:
        checks = {
            "min_slowdown_pct": self.min_slowdown_pct > 0,
            "min_job_loss_pct": 0 <= self.min_job_loss_pct <= 100,
            "outlier_alpha": 0 < self.outlier_alpha < 1,
            "level_halflife_steps": self.level_halflife_steps > 0,
            "false_alarm_arl": self.false_alarm_arl > 10,
            "warmup_steps": self.warmup_steps >= 0,
            "warmup_s": self.warmup_s > 0,
            "structure_min_nodes": self.structure_min_nodes >= 2,
            "hang_timeout_s": self.hang_timeout_s > 0,
            "clip": self.clip > 0,
            "spread_floor_pct": self.spread_floor_pct > 0,
            "spread_halflife_steps": self.spread_halflife_steps > 0,
            "charts": 1 <= self.charts <= 6,
            "min_world_size": self.min_world_size >= 2,
            "node_fraction": 0 < self.node_fraction <= 1,
            "input_min_slowdown_pct": self.input_min_slowdown_pct > 0,
            "input_clip": self.input_clip > 0,
            "sync_stall_min_rise_pct": self.sync_stall_min_rise_pct > 0,
            "sync_stall_steps": self.sync_stall_steps > 0,
            "lag_steps": self.lag_steps >= 0,
            "attribution_steps": self.attribution_steps >= 1,
            "rearm_steps": self.rearm_steps >= 1,
            "rearm_s": self.rearm_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid detection parameters: {', '.join(bad)}")


def cusum_arl0(k: float, h: float) -> float:
    """Siegmund's in-control ARL of a one-sided CUSUM (reference k, threshold h) on N(0, 1)."""
    b = h + _SIEGMUND
    x = 2.0 * k * b
    return (math.exp(x) - x - 1.0) / (2.0 * k * k)


def cusum_delay(k: float, h: float, shift: float) -> float:
    """Siegmund's out-of-control ARL (expected detection delay) for a mean shift ``shift``."""
    delta = shift - k
    b = h + _SIEGMUND
    if abs(delta) < 1e-9:
        return b * b
    x = 2.0 * delta * b
    return (math.exp(-x) + x - 1.0) / (2.0 * delta * delta)


def cusum_thresholds(k: F64, arl: float | F64) -> F64:
    """The thresholds h whose in-control ARL (Siegmund) equals ``arl`` (one, or one per
    reference) for each reference in ``k``: the one solver, for the detector's charts and the
    benchmarks alike."""
    # Solve e^x - x - 1 = 2 k^2 arl for x = 2 k b by fixed-point iteration (converges in a few
    # steps because arl is large), then h = b - 1.166.
    k = np.asarray(k, dtype=np.float64)
    target = 2.0 * k * k * arl
    x = np.log(target + 1.0)
    for _ in range(50):
        x_next = np.log(target + x + 1.0)
        done = bool(np.all(np.abs(x_next - x) < 1e-12))
        x = x_next
        if done:
            break
    return np.maximum(0.0, x / (2.0 * k) - _SIEGMUND)


def cusum_threshold(k: float, arl: float) -> float:
    """:func:`cusum_thresholds` for one reference value."""
    return float(cusum_thresholds(np.array([k]), arl)[0])


def optimal_delay(shift: float, arl: float) -> float:
    """The CUSUM optimum for a shift of ``shift`` standard deviations at false-alarm ARL
    ``arl``: (2/d^2)(ln(arl d^2 / 2) - 1) steps (Siegmund's approximation)."""
    d2 = shift * shift
    return (2.0 / d2) * (math.log(arl * d2 / 2.0) - 1.0)
