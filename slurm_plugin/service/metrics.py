"""Prometheus metrics (the ``metrics`` extra); a silent stand-in when it is not installed."""

from __future__ import annotations

import importlib
from typing import Any

import structlog

from slurm_plugin.errors import ConfigError

log = structlog.get_logger(__name__)


class _Null:
    def labels(self, *_a: Any, **_k: Any) -> _Null:
        return self

    def inc(self, *_a: Any) -> None:
        return None

    def set(self, *_a: Any) -> None:
        return None

    def observe(self, *_a: Any) -> None:
        return None


class Metrics:
    """The service's metrics; every attribute works whether or not prometheus is there."""

    def __init__(self, port: int = 0, address: str = "127.0.0.1") -> None:
        self.enabled = False
        null = _Null()
        self.jobs: Any = null
        self.ranks: Any = null
        self.detections: Any = null
        self.actions: Any = null
        self.cycle_seconds: Any = null
        self.decision_seconds: Any = null
        self.recovery_seconds: Any = null
        self.errors: Any = null
        self.ignored: Any = null
        self.lost: Any = null
        self.missing: Any = null
        self.detect_waiting: Any = null
        self.node_flags: Any = null
        self.gpu_hours_lost: Any = null
        self.gpu_hours_spent: Any = null
        self.gpu_hours_saved: Any = null
        self.leader: Any = null
        self.paused: Any = null
        self.breaker_open: Any = null
        if not port:
            return
        try:
            prom = importlib.import_module("prometheus_client")
        except ImportError:
            log.warning("metrics.unavailable", detail="pip install 'slurm-straggler[metrics]'")
            return
        registry = prom.CollectorRegistry()
        self.jobs = prom.Gauge("straggler_jobs_watched", "Running jobs watched", registry=registry)
        self.ranks = prom.Gauge("straggler_ranks_watched", "Ranks reporting", registry=registry)
        self.detections = prom.Counter(
            "straggler_detections_total", "Detections", ["kind", "cause"], registry=registry
        )
        self.actions = prom.Counter(
            "straggler_actions_total", "Actions", ["action", "outcome"], registry=registry
        )
        self._histograms(prom, registry)
        self.errors = prom.Counter(
            "straggler_errors_total", "Errors", ["system"], registry=registry
        )
        self.ignored = prom.Counter(
            "straggler_records_ignored_total",
            "Telemetry records not believed (evidence rules)",
            ["reason"],
            registry=registry,
        )
        self.lost = prom.Counter(
            "straggler_steps_entries_lost_total",
            "Steps entries (one rank's flush each) trimmed from a job's stream before the "
            "service read them",
            registry=registry,
        )
        self.missing = prom.Counter(
            "straggler_steps_entries_missing_total",
            "Steps entries a rank numbered that never reached its job's stream (lost in a Redis "
            "failover, or dropped by the rank while Redis was away)",
            registry=registry,
        )
        self.detect_waiting = prom.Gauge(
            "straggler_detection_waiting_seconds",
            "How long the records waiting longest for detection have waited (many jobs: each "
            "is processed less often, within a share of the cycle)",
            registry=registry,
        )
        self.node_flags = prom.Counter(
            "straggler_node_flags_total",
            "Slowdowns decided on, by node and cause (compute, comm, data)",
            ["node", "cause"],
            registry=registry,
        )
        self.gpu_hours_lost = prom.Counter(
            "straggler_gpu_hours_lost_total",
            "Job time stragglers cost while they lasted (share of the step time x GPUs)",
            registry=registry,
        )
        self.gpu_hours_spent = prom.Counter(
            "straggler_gpu_hours_spent_total",
            "What evictions cost: restart and work since the last checkpoint, x GPUs",
            registry=registry,
        )
        self.gpu_hours_saved = prom.Counter(
            "straggler_gpu_hours_saved_total",
            "What evictions are expected to save (the goodput rule's estimate), x GPUs",
            registry=registry,
        )
        self.leader = prom.Gauge(
            "straggler_leader", "1 while this instance holds the leader lock", registry=registry
        )
        self.paused = prom.Gauge(
            "straggler_paused", "1 while an admin's pause stops all actions", registry=registry
        )
        self.breaker_open = prom.Gauge(
            "straggler_breaker_open",
            "1 while the circuit breaker stops all actions (too many straggler nodes at once)",
            registry=registry,
        )
        try:
            prom.start_http_server(port, addr=address, registry=registry)
        except OSError as exc:
            raise ConfigError(
                f"metrics endpoint {address}:{port}: {exc.strerror or exc}",
                field="service.metrics_port",
            ) from exc
        self.enabled = True

    def _histograms(self, prom: Any, registry: Any) -> None:
        """The durations: a cycle's, detection to action, a recovery's."""
        self.cycle_seconds = prom.Histogram(
            "straggler_cycle_seconds", "Cycle duration", registry=registry
        )
        self.decision_seconds = prom.Histogram(
            "straggler_decision_seconds", "Detection to action", registry=registry
        )
        self.recovery_seconds = prom.Histogram(
            "straggler_recovery_seconds",
            "From a slowdown's onset (since=onset) and from our action on it (since=action) to "
            "the job's first healthy step after it, by recovery (requeue, advice)",
            ["recovery", "since"],
            buckets=(5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, float("inf")),
            registry=registry,
        )
