"""The decision engine (pure): given a detection, the job, the cluster and the policy, what
to do and why. Every reason and both goodput numbers go into the decision record."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.rails import SafetyPolicy
from slurm_plugin.policy.schema import Policy

Action = Literal["evict", "wait", "annotate", "none"]


@dataclass(frozen=True)
class JobContext:
    """What the service knows about a job beyond Slurm's view."""

    evictions: int = 0
    last_eviction_ts: float | None = None
    last_checkpoint_ts: float | None = None
    reports_checkpoints: bool = False
    waiting_since: float | None = None
    #: Other jobs that saw the event's node slow within the persistence window (its past).
    node_incidents: int = 0


@dataclass(frozen=True)
class ClusterContext:
    """Cluster-wide state the safety rails need."""

    nodes: tuple[NodeInfo, ...] = ()
    evictions_last_hour: int = 0
    paused: bool = False
    breaker_open: bool = False
    dry_run: bool = False
    #: The cluster-wide rails (the service's [safety] settings).
    safety: SafetyPolicy = field(default_factory=SafetyPolicy)


@dataclass(frozen=True)
class Decision:
    """The verdict on one detection."""

    action: Action
    node: str
    reasons: list[str] = field(default_factory=list)
    saved_s: float | None = None
    cost_s: float | None = None
    #: Only an admin's pause or the open circuit breaker stands in the way: act once lifted.
    on_hold: bool = False
    #: How long the slowdown had lasted, and how much longer it is expected to (goodput).
    lasted_s: float | None = None
    expected_s: float | None = None
    #: The chance that it lasts for the rest of the job, given its age and the node's past.
    lasting_p: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass(frozen=True)
class Outlook:
    """How much longer a slowdown is expected to last."""

    lasted_s: float
    expected_s: float
    lasting_p: float
    #: What is left of the job (its time limit, or the policy's assumption).
    remaining_s: float


def outlook(
    event: StragglerEvent, job: JobInfo, ctx: JobContext, policy: Policy, now: float
) -> Outlook:
    """Expected remaining duration of the slowdown. Two kinds of slowdown: one that lasts for
    the rest of the job (a fault; prior ``persistent_prior``, raised by each other job that saw
    the node slow: ``1 - (1 - prior) / (1 + incidents)``) and a burst that passes, its length
    exponential with mean ``transient_s``. Having lasted ``L`` seconds, a burst is still on
    with probability ``exp(-L / transient_s)``, so the chance that it is a lasting one grows
    with ``L`` (Bayes); a burst still on lasts ``transient_s`` more on average."""
    actions = policy.actions
    remaining = job_remaining_s(job, policy, now)
    lasted = max(0.0, now - event.since_ts) if event.since_ts is not None else 0.0
    prior = 1.0 - (1.0 - actions.persistent_prior) / (1.0 + max(0, ctx.node_incidents))
    burst_on = math.exp(-lasted / actions.transient_s)
    lasting = prior / (prior + (1.0 - prior) * burst_on)
    expected = lasting * remaining + (1.0 - lasting) * min(actions.transient_s, remaining)
    return Outlook(lasted, expected, lasting, remaining)


def _not_sure_yet(event: StragglerEvent, ahead: Outlook, cost: float, policy: Policy) -> str | None:
    """Why evicting now is premature although it pays on average, or None. Waiting one
    ``transient_s`` more costs the slowdown's share of the slow time in that window (all of
    it if the slowdown lasts, until it passes if a burst); evicting now wastes the requeue if
    the slowdown would have passed within it. While the second is larger, wait and decide
    again at the node's next report."""
    mean = policy.actions.transient_s
    window = min(mean, ahead.remaining_s)
    share = _share(event)
    lasting = ahead.lasting_p
    ends = 1.0 - math.exp(-window / mean)  # a burst still on ends within the window
    slow_time = lasting * window + (1.0 - lasting) * mean * ends
    waiting = share * slow_time
    passes = (1.0 - lasting) * ends
    if cost * passes <= waiting:
        return None
    return (
        f"not sure yet: waiting {window:.0f} s more costs {waiting:.0f} s if it lasts; "
        f"evicting now wastes the {cost:.0f} s requeue if it passes ({passes:.0%} likely)"
    )


def _share(event: StragglerEvent) -> float:
    """The share of the job's time the slowdown wastes (+100 % slower: half of it)."""
    slowdown = max(0.0, event.slowdown_pct) / 100.0
    return slowdown / (1.0 + slowdown)


def job_remaining_s(job: JobInfo, policy: Policy, now: float) -> float:
    """The job's remaining run: to its time limit, or the policy's assumption without one."""
    if job.time_limit_s is not None and job.start_time is not None:
        return max(0.0, job.start_time + job.time_limit_s - now)
    return policy.actions.assume_remaining_s


def goodput(
    event: StragglerEvent, job: JobInfo, ctx: JobContext, policy: Policy, now: float, ahead: Outlook
) -> tuple[float, float]:
    """(expected seconds saved by evicting, seconds the restart costs): the slowdown's share
    of the time ``ahead`` expects it to go on, against the restart and the work since the
    last checkpoint."""
    saved = ahead.expected_s * _share(event)
    since = ctx.last_checkpoint_ts if ctx.last_checkpoint_ts is not None else job.start_time
    lost = max(0.0, now - since) if since is not None else 0.0
    return saved, policy.actions.restart_cost_s + lost


def _usable_after_exclusion(job: JobInfo, node: str, nodes: tuple[NodeInfo, ...]) -> int:
    excluded = {*job.excluded, node}
    return sum(
        1 for n in nodes if job.partition in n.partitions and n.usable and n.name not in excluded
    )


def _blockers(
    event: StragglerEvent,
    job: JobInfo,
    policy: Policy,
    ctx: JobContext,
    cluster: ClusterContext,
    now: float,
) -> list[str]:
    """Every reason not to evict now (empty: evicting is allowed)."""
    node = event.node
    reasons: list[str] = []
    if policy.actions.mode == "observe":
        reasons.append("policy observes only")
    if not job.requeue:
        reasons.append("job is not requeueable (--no-requeue)")
    if not job.running:
        reasons.append(f"job is {job.state.lower()}, not running")
    if ctx.evictions >= policy.actions.max_requeues:
        reasons.append(f"already evicted {ctx.evictions} times (max {policy.actions.max_requeues})")
    if ctx.last_eviction_ts is not None and now - ctx.last_eviction_ts < policy.actions.cooldown_s:
        reasons.append(f"cooldown: last eviction {now - ctx.last_eviction_ts:.0f} s ago")
    safety = cluster.safety
    needed = job.node_count + safety.min_spare_nodes
    left = _usable_after_exclusion(job, node, cluster.nodes)
    if left < needed:
        reasons.append(
            f"excluding {node} would leave {left} usable nodes in partition "
            f"{job.partition}; the job needs {needed}"
        )
    if cluster.evictions_last_hour >= safety.max_evictions_per_hour:
        reasons.append(f"eviction budget spent ({cluster.evictions_last_hour} in the last hour)")
    return reasons


def _switches(cluster: ClusterContext) -> list[str]:
    """The admin's switches that hold every action back."""
    reasons = []
    if cluster.paused:
        reasons.append("service paused by an admin")
    if cluster.breaker_open:
        reasons.append("circuit breaker open: too many straggler nodes at once")
    return reasons


def minimum_slowdown_pct(event: StragglerEvent, policy: Policy) -> float:
    """The smallest slowdown of this event's cause that counts: a compute slowdown of
    ``min_slowdown_pct``, a data-loading excess of ``input_min_slowdown_pct``."""
    detection = policy.detection
    return (
        detection.min_slowdown_pct if event.cause == "compute" else detection.input_min_slowdown_pct
    )


def is_slowdown(event: StragglerEvent, policy: Policy) -> bool:
    """Slower than its peers by at least the policy's minimum. Anything else (a speed-up, a
    slowdown too small to matter) never enters node history, an annotation or a decision."""
    return event.slowdown_pct >= minimum_slowdown_pct(event, policy)


def _not_acted_on(event: StragglerEvent, policy: Policy) -> str | None:
    """Why an event leads to nothing at all (not even an annotation), or None."""
    if policy.actions.mode == "off":
        return "policy is off"
    if not is_slowdown(event, policy):
        return (
            f"estimated slowdown {event.slowdown_pct:.1f}% is below the policy's "
            f"minimum of {minimum_slowdown_pct(event, policy):g}%"
        )
    return None


def decide(
    event: StragglerEvent,
    job: JobInfo,
    policy: Policy,
    ctx: JobContext,
    cluster: ClusterContext,
    now: float,
) -> Decision:
    """What to do about ``event`` on ``job`` under ``policy``."""
    node = event.node
    ignored = _not_acted_on(event, policy)
    if ignored is not None:
        return Decision("none", node, [ignored])
    # Observe writes nothing to Slurm, not even a note: the decision is recorded in Redis only.
    note: Action = "none" if policy.actions.mode == "observe" else "annotate"
    if event.cause != "compute":
        return Decision(note, node, ["input-bound (slow data loading): report only"])
    if node not in job.nodes:
        return Decision("none", node, [f"{node} is not one of the job's nodes"])
    ahead = outlook(event, job, ctx, policy, now)
    saved, cost = goodput(event, job, ctx, policy, now, ahead)

    def verdict(action: Action, reasons: list[str], on_hold: bool = False) -> Decision:
        return Decision(
            action,
            node,
            reasons,
            saved,
            cost,
            on_hold,
            ahead.lasted_s,
            ahead.expected_s,
            ahead.lasting_p,
        )

    why = (
        f"lasted {ahead.lasted_s:.0f} s, expected {ahead.expected_s:.0f} s more "
        f"({ahead.lasting_p:.0%} that it lasts)"
    )
    reasons = _blockers(event, job, policy, ctx, cluster, now)
    if saved <= cost:
        reasons.append(f"goodput: evicting saves {saved:.0f} s but costs {cost:.0f} s ({why})")
    else:
        unsure = _not_sure_yet(event, ahead, cost, policy)
        reasons += [f"{unsure} ({why})"] if unsure else []
    switches = _switches(cluster)
    if reasons or switches:
        return verdict(note, reasons + switches, on_hold=not reasons and not cluster.dry_run)
    waited = now - ctx.waiting_since if ctx.waiting_since is not None else 0.0
    if policy.actions.when == "after_checkpoint" and ctx.reports_checkpoints:
        if waited < policy.actions.max_wait_s:
            return verdict("wait", ["waiting for the job's next checkpoint"])
        reasons.append(f"no checkpoint within {policy.actions.max_wait_s:.0f} s: evicting")
    action: Action = "annotate" if cluster.dry_run else "evict"
    reasons += ["dry run"] if cluster.dry_run else []
    return verdict(action, [*reasons, f"goodput: saves {saved:.0f} s, costs {cost:.0f} s ({why})"])
