"""Policy files (TOML) as validated pydantic models; every field documented, typos rejected.

A policy holds only job-level knobs (``[detection]``, ``[actions]``); the cluster-wide rails
(``[safety]``, ``[persistence]``, ``service.drain_persistent``) are the service's settings
(:mod:`slurm_plugin.policy.rails`), never a job's choice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from slurm_plugin.detection.params import DetectionParams
from slurm_plugin.policy.rails import Strict

#: The detector's defaults: the one place they are written (a policy's ``[detection]`` shows
#: them, with the bounds a policy file may use).
_D = DetectionParams()


class DetectionPolicy(Strict):
    """How sensitive detection is."""

    min_slowdown_pct: float = Field(
        _D.min_slowdown_pct,
        gt=0,
        le=1000,
        description="Smallest compute slowdown of a rank worth acting on, %.",
    )
    min_job_loss_pct: float = Field(
        _D.min_job_loss_pct,
        ge=0,
        le=100,
        description="Smallest share of the job's step time a compute straggler must cost it "
        "(the what-if of its recent steps without the node), %: a rank slower than its peers "
        "that the job never waits for (others are slower still, as under MoE routing) is "
        "neither acted on nor counted in node history.",
    )
    outlier_alpha: float = Field(
        _D.outlier_alpha,
        gt=0,
        lt=1,
        description="A compute straggler's level over its recent steps must stand out from "
        "the job's rank-to-rank spread of levels by the normal quantile 1 - outlier_alpha / "
        "ranks (the chance that a job's least favourable healthy rank clears it at one "
        "look): under slow per-rank drift the slowest of many healthy ranks is no fault, and "
        "evicting it swaps in a node that drifts as much. Lower is stricter.",
    )
    false_alarm_arl: float = Field(
        _D.false_alarm_arl,
        gt=10,
        description="Rank-steps between false alarms (default: one a month on 16,384 GPUs at "
        "one step per second).",
    )
    warmup_steps: int = Field(
        _D.warmup_steps, ge=0, le=100_000, description="Steps ignored after each (re)start."
    )
    warmup_s: float = Field(
        _D.warmup_s,
        gt=0,
        le=86400,
        description="The warm-up also ends after this many seconds of steps (at least 3 "
        "steps), so jobs with long steps are watched within minutes.",
    )
    hang_timeout_s: float = Field(
        _D.hang_timeout_s, gt=0, le=86400, description="No progress this long is a hang."
    )
    input_min_slowdown_pct: float = Field(
        _D.input_min_slowdown_pct,
        gt=0,
        le=10_000,
        description="Smallest data-loading excess (% of compute) to report.",
    )
    sync_stall_min_rise_pct: float = Field(
        _D.sync_stall_min_rise_pct,
        gt=0,
        le=10_000,
        description="Job-wide wait rise (% of step time) that is a sync stall.",
    )

    clip: float = Field(
        _D.clip,
        gt=0,
        le=50,
        description="Z-scores are clipped to +-clip sigma: one step's outlier never alarms alone. "
        "Higher values detect huge slowdowns a step sooner but alarm on spikes.",
    )
    charts: int = Field(
        _D.charts, ge=1, le=6, description="CUSUM charts per rank (references k, 2k, 4k...)."
    )

    def params(self) -> DetectionParams:
        """The detector's parameters."""
        return DetectionParams(**self.model_dump())


class ActionPolicy(Strict):
    """What the service does about a detection."""

    mode: Literal["off", "observe", "evict"] = Field(
        "observe",
        description="off: nothing; observe: record only (nothing written to Slurm); evict: "
        "note it on the job (notify) and requeue the job without the straggler node.",
    )
    notify: Literal["off", "log", "comment"] = Field(
        "comment",
        description="How a job hears about detections: its AdminComment (comment), the service "
        "log only (log), or not at all (off).",
    )
    max_requeues: int = Field(2, ge=0, le=100, description="Most evictions of one job.")
    recovery: Literal["requeue", "advice"] = Field(
        "requeue",
        description="requeue: an eviction requeues the job without the nodes; advice: the job "
        "is first advised to leave them itself (`straggler advice JOB`, a launcher that acts "
        "on it, such as torchrun with a spare node), and requeued as with requeue only if it "
        "has not reported leaving them within advice_deadline_s.",
    )
    advice_deadline_s: float = Field(
        120.0,
        ge=5,
        le=86400,
        description="How long a job advised to leave nodes has to report it left them before "
        "it is requeued without them (recovery = advice).",
    )
    cooldown_s: float = Field(
        900.0,
        ge=0,
        le=30 * 86400,
        description="Seconds after an eviction before the same job is evicted again.",
    )
    when: Literal["now", "after_checkpoint"] = Field(
        "after_checkpoint",
        description="now, or right after the job's next checkpoint_end event (no work lost) if "
        "the job reports checkpoints.",
    )
    max_wait_s: float = Field(
        900.0,
        ge=0,
        le=7 * 86400,
        description="Longest wait for a checkpoint before evicting anyway.",
    )
    restart_cost_s: float = Field(
        180.0,
        ge=0,
        le=86400,
        description="Seconds a requeue costs beyond lost work: Slurm's requeue delay "
        "(SchedulerParameters requeue_delay from 25.11, else AuthInfo cred_expire, 120 s by "
        "default) plus start-up.",
    )
    transient_s: float = Field(
        30.0,
        gt=0,
        le=86400,
        description="Mean length of a slowdown that passes by itself (a page-cache flush, a "
        "daemon, a checkpoint writer), s. A slowdown that has lasted a few times this long is "
        "taken for one that lasts; a younger one is expected to pass (goodput rule).",
    )
    episode_s: float = Field(
        0.0,
        ge=0,
        le=7 * 86400,
        description="Median length of a fail-slow episode (a GPU throttling, a congested link, "
        "a noisy neighbour: tens of minutes, then it ends by itself), s. 0: no such kind, a "
        "slowdown that outlived transient_s is taken for one that lasts.",
    )
    episode_share: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of the slowdowns that pass by themselves which are fail-slow "
        "episodes (episode_s) rather than bursts (transient_s).",
    )
    persistent_prior: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Chance that a new slowdown on a node no other job saw slow lasts for the "
        "rest of the job (a fault, not a burst). Every other job that saw the node slow within "
        "the service's [persistence] recent_days raises it.",
    )
    min_lasting_p: float = Field(
        0.6,
        ge=0,
        le=1,
        description="Evict only a slowdown at least this likely to last for the rest of the "
        "job (given its age and the node's past): a fail-slow episode that may still end by "
        "itself is left alone however much it would pay on average.",
    )
    doubt_requeues: float = Field(
        1.0,
        ge=0,
        le=1000,
        description="Waive min_lasting_p when waiting until the slowdown is that likely would "
        "cost the job more than this many requeues (its share of the job's time over the wait): "
        "a node that makes the job several times slower is evicted although it might pass.",
    )
    assume_remaining_s: float = Field(
        3600.0,
        gt=0,
        le=365 * 86400,
        description="Remaining run assumed when the job has no time limit (at least as long "
        "as it has run so far: a job that ran for a day is not taken to end within the hour).",
    )
    no_limit_horizon_s: float = Field(
        7 * 86400.0,
        gt=0,
        le=365 * 86400,
        description="The longest a job without a time limit is taken to run in all: its "
        "remaining run is what a job of its age is expected to run on (heavy-tailed run "
        "lengths), at least assume_remaining_s.",
    )
    risk_sd: float = Field(
        0.5,
        ge=0,
        le=10,
        description="Evict only when the expected saving exceeds the requeue's cost by this many "
        "standard deviations of the saving (how long the slowdown goes on is uncertain: it may "
        "pass within minutes or last the job). 0: the expected saving alone decides.",
    )
    assume_checkpoint_s: float | None = Field(
        None,
        gt=0,
        le=7 * 86400,
        description="The site's usual checkpoint interval, s, for a job that reports no "
        "checkpoints: a requeue is then taken to lose half of it on average (never more than "
        "the job has run). Unset: such a job loses all its work since it started.",
    )


class Policy(Strict):
    """A named straggler policy."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="Policy name.")
    description: str = Field("", description="What the policy is for.")
    detection: DetectionPolicy = Field(default_factory=DetectionPolicy)
    actions: ActionPolicy = Field(default_factory=ActionPolicy)
