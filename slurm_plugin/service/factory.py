"""Build the service's parts from settings (the only place that wires real backends)."""

from __future__ import annotations

from slurm_plugin.config import Settings
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.scheduler import ScontrolScheduler
from slurm_plugin.store.telemetry_store import TelemetryStore, connect_from


def build(settings: Settings) -> tuple[ScontrolScheduler, ServiceState, TelemetryStore]:
    """The scontrol scheduler, the Redis state and the telemetry store."""
    state = ServiceState(
        connect_from(settings, decode=True), retention_s=settings.service.decision_retention_s
    )
    store = TelemetryStore(connect_from(settings))
    return ScontrolScheduler(settings), state, store
