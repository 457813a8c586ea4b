"""What ``straggler devcluster status`` and ``up`` report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: Node states in which a node is usable.
READY_STATES = frozenset({"idle", "mixed", "allocated", "completing"})


@dataclass(frozen=True)
class DaemonStatus:
    """One daemon of the cluster and whether it runs."""

    name: str
    pid: int | None
    alive: bool


@dataclass(frozen=True)
class ClusterStatus:
    """What ``status`` and ``up`` report."""

    base: str
    daemons: list[DaemonStatus]
    nodes: dict[str, str]
    redis_ok: bool
    env: dict[str, str]
    elapsed_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """All daemons run, Redis answers and every node is usable."""
        return (
            all(d.alive for d in self.daemons)
            and self.redis_ok
            and bool(self.nodes)
            and all(state in READY_STATES for state in self.nodes.values())
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dictionary (``straggler devcluster status --json``)."""
        data = asdict(self)
        data["ready"] = self.ready
        return data
