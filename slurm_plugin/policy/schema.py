"""Policy files (TOML) as validated pydantic models; every field documented, typos rejected.

This module holds the parts the detector and the backtest use: ``[detection]``,
``[persistence]`` and the action mode.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from slurm_plugin.detection.params import DEFAULT_ARL, DetectionParams
from slurm_plugin.policy.history import HistoryParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DetectionPolicy(_Strict):
    """How sensitive detection is."""

    min_slowdown_pct: float = Field(
        3.0, gt=0, le=1000, description="Smallest compute slowdown of a rank worth acting on, %."
    )
    false_alarm_arl: float = Field(
        DEFAULT_ARL,
        gt=10,
        description="Rank-steps between false alarms (default: one a month on 16,384 GPUs at "
        "one step per second).",
    )
    warmup_steps: int = Field(20, ge=0, description="Steps ignored after each (re)start.")
    hang_timeout_s: float = Field(300.0, gt=0, description="No progress this long is a hang.")
    input_min_slowdown_pct: float = Field(
        10.0, gt=0, description="Smallest data-loading excess (% of compute) to report."
    )
    sync_stall_min_rise_pct: float = Field(
        20.0, gt=0, description="Job-wide wait rise (% of step time) that is a sync stall."
    )

    clip: float = Field(
        6.0,
        gt=0,
        le=50,
        description="Scores are clipped to +-clip sigma: one step's outlier never alarms alone. "
        "Higher values detect huge slowdowns a step sooner but alarm on spikes.",
    )
    charts: int = Field(
        3, ge=1, le=6, description="CUSUM charts per rank (references k, 2k, 4k...)."
    )

    def params(self) -> DetectionParams:
        """The detector's parameters."""
        return DetectionParams(**self.model_dump())


class PersistencePolicy(_Strict):
    """When a node counts as a persistent straggler, and when it is forgiven."""

    incidents: int = Field(3, ge=2, description="Incidents within the window.")
    distinct_jobs: int = Field(2, ge=2, description="...from at least this many jobs.")
    window_days: float = Field(7.0, gt=0, description="Window for counting incidents, days.")
    half_life_days: float = Field(3.0, gt=0, description="Decay half-life of incidents, days.")
    forgive_after_days: float = Field(14.0, gt=0, description="Quiet days that clear a node.")
    distinct_users: bool = Field(
        False, description="Count distinct users instead of distinct jobs."
    )
    require_corroboration: bool = Field(
        False,
        description="Drain only nodes with at least one incident backed by hardware evidence "
        "(sidecar throttle reasons/XIDs/low clocks, or a prolog finding): timing alone, which a "
        "job's user controls, then never drains a node.",
    )

    def params(self) -> HistoryParams:
        """The node history's parameters."""
        day = 86400.0
        return HistoryParams(
            incidents=self.incidents,
            distinct_jobs=self.distinct_jobs,
            window_s=self.window_days * day,
            half_life_s=self.half_life_days * day,
            forgive_after_s=self.forgive_after_days * day,
            require_corroboration=self.require_corroboration,
        )


class ActionPolicy(_Strict):
    """What the service does about a detection."""

    mode: Literal["off", "observe", "evict"] = Field(
        "observe",
        description="off: nothing; observe: record and annotate the job; evict: also requeue "
        "the job without the straggler node.",
    )
    drain_persistent: bool = Field(False, description="Drain nodes that become persistent.")
    notify: Literal["off", "log", "comment"] = Field(
        "comment",
        description="How a job hears about detections: its AdminComment (comment), the service "
        "log only (log), or not at all (off).",
    )
    max_requeues: int = Field(2, ge=0, description="Most evictions of one job.")
    cooldown_s: float = Field(
        900.0, ge=0, description="Seconds after an eviction before the same job is evicted again."
    )
    when: Literal["now", "after_checkpoint"] = Field(
        "after_checkpoint",
        description="now, or right after the job's next checkpoint_end event (no work lost) if "
        "the job reports checkpoints.",
    )
    max_wait_s: float = Field(
        900.0, ge=0, description="Longest wait for a checkpoint before evicting anyway."
    )
    restart_cost_s: float = Field(
        180.0,
        ge=0,
        description="Seconds a requeue costs beyond lost work: Slurm's requeue delay "
        "(AuthInfo cred_expire, 120 s by default) plus start-up.",
    )
    assume_remaining_s: float = Field(
        3600.0, gt=0, description="Remaining run assumed when the job has no time limit."
    )


class SafetyPolicy(_Strict):
    """Bounds on everything the service does, whatever the detections say."""

    max_evictions_per_hour: int = Field(10, ge=0, description="Cluster-wide eviction budget.")
    max_partition_drained_fraction: float = Field(
        0.05, ge=0, le=1, description="Never drain beyond this fraction of a partition."
    )
    min_spare_nodes: int = Field(
        0,
        ge=0,
        description="Usable nodes that must remain in the partition beyond what the job needs "
        "once the straggler is excluded (a slow job beats one that can never start).",
    )
    breaker_max_nodes: int = Field(
        5,
        ge=1,
        description="Circuit breaker: more distinct straggler nodes than this within "
        "breaker_window_s stops all actions until an admin resumes.",
    )
    breaker_window_s: float = Field(600.0, gt=0, description="Window of the circuit breaker.")


class Policy(_Strict):
    """A named straggler policy."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="Policy name.")
    description: str = Field("", description="What the policy is for.")
    detection: DetectionPolicy = Field(default_factory=DetectionPolicy)
    persistence: PersistencePolicy = Field(default_factory=PersistencePolicy)
    actions: ActionPolicy = Field(default_factory=ActionPolicy)
    safety: SafetyPolicy = Field(default_factory=SafetyPolicy)
