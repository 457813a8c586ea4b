"""slurm-straggler: find the slow rank of a GPU training job and evict it from the Slurm job.

``from slurm_plugin import StepReporter`` is the in-job API. It is loaded lazily so that the
pure parts of the package (detection, policy) import without Redis.
"""

from typing import TYPE_CHECKING, Any

from slurm_plugin._version import __version__

if TYPE_CHECKING:
    from slurm_plugin.telemetry.reporter import StepReporter

__all__ = ["StepReporter", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "StepReporter":
        from slurm_plugin.telemetry.reporter import StepReporter  # noqa: PLC0415

        return StepReporter
    raise AttributeError(f"module 'slurm_plugin' has no attribute {name!r}")
