"""In-job telemetry: key schema, records, Redis store, the StepReporter and the node sidecar."""

from slurm_plugin.telemetry.records import StepRecord
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.telemetry.store import TelemetryStore

__all__ = ["StepRecord", "StepReporter", "TelemetryStore"]
