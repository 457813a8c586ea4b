"""The cluster-wide rails: bounds on everything the service does and the rules of the shared
node history. They are the admin's, set in the service's configuration (``[safety]``,
``[persistence]``, ``service.drain_persistent``), never in a policy file a job can pick."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slurm_plugin.policy.history import HistoryParams


class Strict(BaseModel):
    """Frozen; unknown keys, infinities and NaN are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


#: The node history's defaults: the one place they are written (``[persistence]`` shows them in
#: days, with the bounds a settings file may use).
_H = HistoryParams()
_DAY = 86400.0


class PersistencePolicy(Strict):
    """When a node counts as a persistent straggler, and when it is forgiven."""

    incidents: int = Field(_H.incidents, ge=2, le=1000, description="Incidents within the window.")
    distinct_jobs: int = Field(
        _H.distinct_jobs, ge=2, le=1000, description="...from at least this many jobs."
    )
    window_days: float = Field(
        _H.window_s / _DAY, gt=0, le=3650, description="Window for counting incidents, days."
    )
    recent_days: float = Field(
        _H.recent_s / _DAY,
        gt=0,
        le=3650,
        description="How long an incident in another job makes a node's next slowdown believed "
        "sooner (repeat_s, the goodput rule's prior) and never a job's structure, days (the "
        "window when that is shorter: older incidents are forgotten).",
    )
    half_life_days: float = Field(
        _H.half_life_s / _DAY, gt=0, le=3650, description="Decay half-life of incidents, days."
    )
    forgive_after_days: float = Field(
        _H.forgive_after_s / _DAY, gt=0, le=3650, description="Quiet days that clear a node."
    )
    distinct_users: bool = Field(
        False, description="Count distinct users instead of distinct jobs."
    )
    require_corroboration: bool = Field(
        _H.require_corroboration,
        description="Drain only nodes with at least one incident backed by hardware evidence "
        "(sidecar throttle reasons/XIDs/low clocks, or a prolog finding): timing alone, which a "
        "job's user controls, then never drains a node.",
    )

    sustained_s: float = Field(
        _H.sustained_s,
        ge=0,
        le=7 * 86400,
        description="A slowdown is an incident in node history only once it has lasted this "
        "long (or once the job was evicted for it), and once per slowdown: bursts that pass "
        "never mark a node.",
    )

    repeat_s: float = Field(
        _H.repeat_s,
        ge=0,
        le=7 * 86400,
        description="...or this long on a node another job saw slow in an incident within "
        "recent_days (such a node is evicted within seconds of its next slowdown, which would "
        "never last sustained_s).",
    )

    @model_validator(mode="after")
    def _reachable(self) -> PersistencePolicy:
        # The history's own rule, said when the file is read rather than by the service later.
        if self.incidents < self.distinct_jobs:
            raise ValueError(
                f"incidents ({self.incidents}) must be at least distinct_jobs "
                f"({self.distinct_jobs}): fewer incidents can never come from that many jobs"
            )
        return self

    def params(self) -> HistoryParams:
        """The node history's parameters."""
        return HistoryParams(
            sustained_s=self.sustained_s,
            repeat_s=self.repeat_s,
            incidents=self.incidents,
            distinct_jobs=self.distinct_jobs,
            window_s=self.window_days * _DAY,
            recent_s=self.recent_days * _DAY,
            half_life_s=self.half_life_days * _DAY,
            forgive_after_s=self.forgive_after_days * _DAY,
            require_corroboration=self.require_corroboration,
        )


class SafetyPolicy(Strict):
    """Bounds on everything the service does, whatever the detections say."""

    max_evictions_per_hour: int = Field(
        10, ge=0, le=100_000, description="Cluster-wide eviction budget."
    )
    max_partition_drained_fraction: float = Field(
        0.05, ge=0, le=1, description="Never drain beyond this fraction of a partition."
    )
    min_spare_nodes: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Usable nodes that must remain in the partition beyond what the job needs "
        "once the straggler is excluded (a slow job beats one that can never start).",
    )
    max_nodes_per_eviction: int = Field(
        4,
        ge=1,
        le=1000,
        description="Most nodes one requeue excludes: every flagged node of the job whose "
        "exclusion pays goes in the same requeue (one restart, not one per node), up to this.",
    )
    breaker_max_nodes: int = Field(
        5,
        ge=1,
        le=100_000,
        description="Circuit breaker: more distinct straggler nodes than this within "
        "breaker_window_s stops all actions until an admin resumes.",
    )
    breaker_window_s: float = Field(
        600.0, gt=0, le=7 * 86400, description="Window of the circuit breaker."
    )


class ClusterRails(Strict):
    """Everything that bounds the service for all jobs at once."""

    safety: SafetyPolicy = Field(default_factory=SafetyPolicy)
    persistence: PersistencePolicy = Field(default_factory=PersistencePolicy)
    drain_persistent: bool = Field(
        False,
        description="Drain nodes whose history turns persistent (also needs the default "
        'policy\'s mode = "evict", and never in a dry run).',
    )


#: Where a rail sat in a policy file before it became a setting.
RAIL_KEYS = {
    ("safety",): "[safety]",
    ("persistence",): "[persistence]",
    ("actions", "drain_persistent"): "drain_persistent",
}


def rails_in(policy: dict[str, Any]) -> list[str]:
    """The cluster rails a policy's raw data tries to set (they belong in the service's
    configuration)."""
    found = []
    for path, shown in RAIL_KEYS.items():
        node: Any = policy
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            found.append(shown)
    return found
