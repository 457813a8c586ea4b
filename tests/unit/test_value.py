"""GPU-hours for the dashboard: a slowdown's cost counted once per second of it, an eviction's
cost and expected saving, scaled by the job's GPUs (its reporting ranks)."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.policy.decide import Decision
from slurm_plugin.service.value import Value

pytestmark = pytest.mark.unit


class _Counter:
    def __init__(self) -> None:
        self.total = 0.0
        self.by: dict[tuple[Any, ...], float] = {}
        self._labels: tuple[Any, ...] = ()

    def labels(self, **labels: Any) -> _Counter:
        self._labels = tuple(sorted(labels.items()))
        return self

    def inc(self, amount: float = 1.0) -> None:
        self.total += amount
        self.by[self._labels] = self.by.get(self._labels, 0.0) + amount

    def set(self, value: float) -> None:
        self.total = value


class _Metrics:
    def __init__(self) -> None:
        for name in (
            "node_flags",
            "gpu_hours_lost",
            "gpu_hours_spent",
            "gpu_hours_saved",
            "leader",
            "paused",
            "breaker_open",
        ):
            setattr(self, name, _Counter())


def _event(ts: float, loss: float | None = 10.0) -> StragglerEvent:
    return StragglerEvent(
        job_id="7",
        node="node3",
        gpu=None,
        ranks=[4, 5],
        step=100,
        ts=ts,
        cusum_ratio=9.0,
        slowdown_pct=50.0,
        cause="compute",
        scope="node",
        since_ts=1000.0,
        job_loss_pct=loss,
    )


def test_a_slowdown_costs_its_share_of_the_jobs_gpu_time_once() -> None:
    metrics: Any = _Metrics()
    value = Value(metrics)
    value.saw("7", 8)
    value.saw("7", 6)  # a cycle where fewer ranks reported: the GPU count stays 8
    value.straggling(_event(1000.0 + 1800), Decision("evict", "node3"))
    # 1,800 s x 10 % x 8 GPUs = 0.4 GPU-hours.
    assert metrics.gpu_hours_lost.total == pytest.approx(0.4)
    value.straggling(_event(1000.0 + 1800), Decision("wait", "node3"))  # decided again
    assert metrics.gpu_hours_lost.total == pytest.approx(0.4)
    value.straggling(_event(1000.0 + 3600), Decision("evict", "node3"))
    assert metrics.gpu_hours_lost.total == pytest.approx(0.8)
    assert metrics.node_flags.by == {(("cause", "compute"), ("node", "node3")): 3.0}
    # Without the what-if the rank's own slowdown stands in.
    value.forget_all_but([])
    value.straggling(_event(1000.0 + 360, loss=None), Decision("evict", "node3"))
    assert metrics.gpu_hours_lost.total == pytest.approx(0.8 + 360 * 0.5 / 3600)


def test_an_eviction_spends_its_cost_and_saves_its_estimate_only_when_carried_out() -> None:
    metrics: Any = _Metrics()
    value = Value(metrics)
    value.saw("7", 4)
    decision = Decision("evict", "node3", saved_s=900.0, cost_s=180.0)
    value.evicted("7", decision, "failed")
    assert (metrics.gpu_hours_spent.total, metrics.gpu_hours_saved.total) == (0.0, 0.0)
    value.evicted("7", decision, "verified")
    assert metrics.gpu_hours_spent.total == pytest.approx(180 * 4 / 3600)
    assert metrics.gpu_hours_saved.total == pytest.approx(900 * 4 / 3600)


def test_a_job_with_no_known_ranks_counts_as_one_gpu() -> None:
    value = Value(_Metrics())  # type: ignore[arg-type]
    assert value.gpus("unknown") == 1
