"""Build the service's parts from settings (the only place that wires real backends)."""

from __future__ import annotations

from slurm_plugin.config import Settings
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.scheduler import ScontrolScheduler
from slurm_plugin.telemetry.store import TelemetryStore, connect


def build(settings: Settings) -> tuple[ScontrolScheduler, ServiceState, TelemetryStore]:
    """The scontrol scheduler, the Redis state and the telemetry store."""
    state = ServiceState(
        connect(
            settings.redis_url,
            timeout_s=settings.redis_timeout_s,
            cluster=settings.redis_cluster,
            decode=True,
        )
    )
    store = TelemetryStore(
        connect(
            settings.redis_url, timeout_s=settings.redis_timeout_s, cluster=settings.redis_cluster
        )
    )
    return ScontrolScheduler(settings), state, store
