"""A real multi-node Slurm cluster plus redis-server on one machine, for tests and the demo."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_plugin.devcluster.cluster import DevCluster
    from slurm_plugin.devcluster.status import ClusterStatus, DaemonStatus

__all__ = ["ClusterStatus", "DaemonStatus", "DevCluster"]


def __getattr__(name: str) -> Any:
    # Lazy: the dev cluster's prolog (``fake_prolog``) starts as fast as the real one.
    if name == "DevCluster":
        from slurm_plugin.devcluster.cluster import DevCluster  # noqa: PLC0415

        return DevCluster
    if name in {"ClusterStatus", "DaemonStatus"}:
        from slurm_plugin.devcluster import status  # noqa: PLC0415

        return getattr(status, name)
    raise AttributeError(name)
