"""slurm-straggler: find the slow rank of a GPU training job and evict it from the Slurm job."""

from slurm_plugin._version import __version__

__all__ = ["__version__"]
