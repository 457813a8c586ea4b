"""A real multi-node Slurm cluster plus redis-server on one machine, for tests and the demo."""

from slurm_plugin.devcluster.cluster import DevCluster
from slurm_plugin.devcluster.status import ClusterStatus, DaemonStatus

__all__ = ["ClusterStatus", "DaemonStatus", "DevCluster"]
