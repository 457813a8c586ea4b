"""slurm-straggler: find the slow rank of a GPU training job and evict it from the Slurm job."""

from slurm_plugin._version import __version__
from slurm_plugin.telemetry.reporter import StepReporter

__all__ = ["StepReporter", "__version__"]
