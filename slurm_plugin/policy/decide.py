"""The decision engine (pure): given a detection, the job, the cluster and the policy, what
to do and why. Every reason and both goodput numbers go into the decision record."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.policy.durations import Passing
from slurm_plugin.policy.rails import SafetyPolicy
from slurm_plugin.policy.schema import Policy

Action = Literal["evict", "wait", "annotate", "none"]


@dataclass(frozen=True)
class JobContext:
    """What the service knows about a job beyond Slurm's view."""

    evictions: int = 0
    last_eviction_ts: float | None = None
    last_checkpoint_ts: float | None = None
    #: The job reports checkpoints (and did not miss the last one waited for: a wait that
    #: ran out of ``max_wait_s`` without one makes the job decided on as if it reported
    #: none, until its next checkpoint).
    reports_checkpoints: bool = False
    #: The job's checkpoint period as its reported checkpoints show it (None: unknown).
    checkpoint_period_s: float | None = None
    waiting_since: float | None = None
    #: Other jobs that saw the event's node slow within ``recent_days`` (its past).
    node_incidents: int = 0
    #: The attempt the job was requeued from for a slowdown there since its first steps
    #: (``StragglerEvent.from_start``; None: none was).
    from_start_requeued: int | None = None


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
    #: What the goodput figures were computed from (:class:`Goodput`, as a dict).
    inputs: dict[str, Any] | None = None


@dataclass(frozen=True)
class Outlook:
    """How much longer a slowdown is expected to last."""

    lasted_s: float
    expected_s: float
    lasting_p: float
    #: What is left of the job (its time limit, or the policy's assumption).
    remaining_s: float
    remaining_from: str = "time limit"
    #: How much longer until it is ``min_lasting_p`` likely to last (0: it already is).
    sure_in_s: float = 0.0
    #: The standard deviation of how much longer it goes on (the two kinds, and a passing
    #: one's heavy tail): how uncertain ``expected_s`` is.
    sd_s: float = 0.0


@dataclass(frozen=True)
class Goodput:
    """Evicting's expected saving against its cost, and their inputs (job seconds: the
    whole job waits for its slowest rank, so both scale with its GPUs alike)."""

    saved_s: float
    cost_s: float
    #: The share of the job's step time the node costs (%), and where it came from: the
    #: what-if of the job's recent steps without the node, or the rank's own slowdown when
    #: the detector could not say.
    share_pct: float
    share_from: str
    remaining_s: float
    remaining_from: str
    restart_cost_s: float
    lost_work_s: float
    #: What the lost work was taken from: the job's last reported checkpoint, the site's
    #: checkpoint interval (assumed), or the job's start.
    lost_work_from: str
    #: How long until the next checkpoint, when the policy evicts after one (the slowdown
    #: goes on until then).
    checkpoint_wait_s: float


def passing(policy: Policy) -> Passing:
    """The policy's lengths of slowdowns that pass by themselves (:mod:`.durations`)."""
    actions = policy.actions
    return Passing(actions.transient_s, actions.episode_s, actions.episode_share)


def outlook(
    event: StragglerEvent, job: JobInfo, ctx: JobContext, policy: Policy, now: float
) -> Outlook:
    """Expected remaining duration of the slowdown. Two kinds of slowdown: one that lasts for
    the rest of the job (a fault; prior ``persistent_prior``, raised by each other job that saw
    the node slow: ``1 - (1 - prior) / (1 + incidents)``) and one that passes, with a
    heavy-tailed length (:func:`_on`). Having lasted ``L`` seconds, the chance that it is a
    lasting one grows with ``L`` (Bayes), and so does how long a passing one still goes on."""
    actions = policy.actions
    remaining, source = job_remaining(job, policy, now)
    lasted = max(0.0, now - event.since_ts) if event.since_ts is not None else 0.0
    prior = 1.0 - (1.0 - actions.persistent_prior) / (1.0 + max(0, ctx.node_incidents))
    lengths = passing(policy)
    lasting = prior / (prior + (1.0 - prior) * lengths.on(lasted))
    expected = lasting * remaining + (1.0 - lasting) * lengths.left(lasted, remaining)
    sure = lengths.sure_at(prior, actions.min_lasting_p)
    square = lasting * remaining**2 + (1.0 - lasting) * lengths.square(lasted, remaining)
    sd = math.sqrt(max(0.0, square - expected**2))
    return Outlook(lasted, expected, lasting, remaining, source, max(0.0, sure - lasted), sd)


def _not_sure_yet(
    ahead: Outlook, gain: Goodput, policy: Policy, job: JobInfo, ctx: JobContext, now: float
) -> str | None:
    """Why evicting now is premature although it pays on average, or None. Waiting a while
    longer (as long as the slowdown has lasted, and at least ``transient_s``) costs the
    slowdown's share of the slow time in that window, and, if it is still on then, the work
    done meanwhile that a later requeue loses; evicting now wastes the requeue if the
    slowdown would have passed within it. While the second is larger, wait and decide again
    at the node's next report."""
    lengths = passing(policy)
    window = min(policy.actions.transient_s + ahead.lasted_s, ahead.remaining_s)
    passes = (1.0 - ahead.lasting_p) * lengths.ends_within(ahead.lasted_s, window)
    waiting = gain.share_pct / 100.0 * _slow_within(ahead, window, lengths)
    waiting += (1.0 - passes) * _more_lost_work(gain, job, ctx, policy, now + window)
    if gain.cost_s * passes <= waiting:
        return None
    return (
        f"not sure yet: waiting {window:.0f} s more costs {waiting:.0f} s on average; "
        f"evicting now wastes the {gain.cost_s:.0f} s requeue if it passes ({passes:.0%} likely)"
    )


def _slow_within(ahead: Outlook, window: float, lengths: Passing) -> float:
    """How long the slowdown is expected to stay on within the next ``window`` seconds."""
    lasting = ahead.lasting_p
    return lasting * window + (1.0 - lasting) * lengths.left(ahead.lasted_s, window)


def _doubt_costs_more(ahead: Outlook, gain: Goodput, policy: Policy) -> bool:
    """Waiting until the slowdown is ``min_lasting_p`` likely would cost the job, on
    average, more than ``doubt_requeues`` requeues (the node's share of the job's time over
    the part of that wait it is expected to stay on)."""
    wait = min(ahead.sure_in_s, ahead.remaining_s)
    slow = _slow_within(ahead, wait, passing(policy))
    return gain.share_pct / 100.0 * slow > policy.actions.doubt_requeues * gain.cost_s


def _more_lost_work(
    gain: Goodput, job: JobInfo, ctx: JobContext, policy: Policy, later: float
) -> float:
    """How much more work a requeue at ``later`` would lose than one now (none while the
    eviction waits for a checkpoint: it loses no work either way)."""
    if gain.lost_work_s <= 0 and gain.checkpoint_wait_s > 0:
        return 0.0
    last = ctx.last_checkpoint_ts
    if last is None:  # since the start, or up to half the site's interval
        return max(0.0, lost_work(job, ctx, policy, later)[0] - gain.lost_work_s)
    period = ctx.checkpoint_period_s
    if period and period > 0:
        last += math.floor(max(0.0, later - last) / period) * period
    return max(0.0, max(0.0, later - last) - gain.lost_work_s)


def _share(event: StragglerEvent) -> tuple[float, str]:
    """The share of the job's time the slowdown wastes (%): the job's what-if when the
    detector gave one, else the rank's own slowdown (+100 % slower: half of it)."""
    if event.job_loss_pct is not None and math.isfinite(event.job_loss_pct):
        return max(0.0, event.job_loss_pct), "the job's steps without the node"
    slowdown = max(0.0, event.slowdown_pct) / 100.0
    return 100.0 * slowdown / (1.0 + slowdown), "the rank's slowdown"


def job_remaining(job: JobInfo, policy: Policy, now: float) -> tuple[float, str]:
    """The job's remaining run: to its time limit; without one, what a job of its age is
    expected to run on, at least the policy's ``assume_remaining_s``; and which it is. Run
    lengths are heavy-tailed (a job that has run for ``a`` is as likely as not to run
    another ``a``: Pareto, shape 1), up to ``no_limit_horizon_s`` in all: ``a ln(H / a)``
    (a job 10 minutes in: ~1 h more; an hour in: ~5 h; a day in: ~47 h, for H = 7 days)."""
    if job.time_limit_s is not None and job.start_time is not None:
        return max(0.0, job.start_time + job.time_limit_s - now), "time limit"
    actions = policy.actions
    age = max(60.0, now - job.start_time) if job.start_time is not None else 60.0
    expected = (
        age * math.log(actions.no_limit_horizon_s / age)
        if actions.no_limit_horizon_s > age
        else 0.0
    )
    if expected > actions.assume_remaining_s:
        return expected, f"expected of a job {age:.0f} s old (no time limit)"
    return actions.assume_remaining_s, "assumed (no time limit)"


def lost_work(job: JobInfo, ctx: JobContext, policy: Policy, now: float) -> tuple[float, str]:
    """The work a requeue now loses, and what it was taken from: the time since the job's
    last checkpoint; for a job that reports none, half the site's checkpoint interval
    (``assume_checkpoint_s``: a checkpoint at an unknown phase) when set, else the time since
    the job started; never more than the job has run."""
    ran = max(0.0, now - job.start_time) if job.start_time is not None else 0.0
    if ctx.last_checkpoint_ts is not None:
        return max(0.0, now - ctx.last_checkpoint_ts), "the job's last checkpoint"
    assumed = policy.actions.assume_checkpoint_s
    if assumed is not None and job.start_time is not None:
        return min(ran, assumed / 2.0), f"half the site's {assumed:.0f} s checkpoint interval"
    return ran, "the job's start (no checkpoint known)"


def goodput(
    event: StragglerEvent, job: JobInfo, ctx: JobContext, policy: Policy, now: float, ahead: Outlook
) -> Goodput:
    """Evicting's expected saving, the share of the job's time the node costs over the time
    ``ahead`` expects the slowdown to go on, against its cost: the restart and the work since
    the last checkpoint. When the policy evicts after the job's next checkpoint, waiting for
    it loses no work but leaves the slowdown on until then (the period the job's checkpoints
    show, else half of ``max_wait_s``): :func:`decide` waits only when that is the cheaper."""
    share, source = _share(event)
    actions = policy.actions
    lost, lost_from = lost_work(job, ctx, policy, now)
    wait = 0.0
    if checkpoint_wait(policy, ctx):
        wait = actions.max_wait_s / 2.0
        if ctx.checkpoint_period_s is not None and ctx.last_checkpoint_ts is not None:
            due = ctx.last_checkpoint_ts + ctx.checkpoint_period_s - now
            wait = min(actions.max_wait_s, due) if due > 0 else wait
        if lost <= share / 100.0 * wait:
            wait = 0.0  # cheaper to lose the little work since the last checkpoint
        else:
            lost = 0.0
    saved = share / 100.0 * max(0.0, ahead.expected_s - wait)
    return Goodput(
        saved_s=saved,
        cost_s=actions.restart_cost_s + lost,
        share_pct=round(share, 2),
        share_from=source,
        remaining_s=round(ahead.remaining_s, 1),
        remaining_from=ahead.remaining_from,
        restart_cost_s=actions.restart_cost_s,
        lost_work_s=round(lost, 1),
        lost_work_from=lost_from,
        checkpoint_wait_s=round(wait, 1),
    )


def checkpoint_wait(policy: Policy, ctx: JobContext) -> bool:
    """The policy evicts after the job's next checkpoint, and the job reports checkpoints."""
    return policy.actions.when == "after_checkpoint" and ctx.reports_checkpoints


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
    # Advice first (recovery = "advice"): the job leaves the node inside its allocation, so
    # what only a requeue needs (requeueable, room without the node) is asked only of the
    # requeue at the advice's deadline (policy/lifecycle.py decides that one as "requeue").
    requeue = policy.actions.recovery == "requeue"
    if requeue and not job.requeue:
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
    if requeue and left < needed:
        reasons.append(
            f"excluding {node} would leave {left} usable nodes in partition "
            f"{job.partition}; the job needs {needed}"
        )
    came_back = ctx.from_start_requeued
    if event.from_start and came_back is not None and event.attempt > came_back:
        reasons.append(
            f"the job was requeued from attempt {came_back} for a slowdown there since its "
            f"first steps, and this attempt is slow since its first steps again ({node}): "
            "the job's own design (a pipeline stage on one node), not a node's fault"
        )
    if _maybe_a_stage(event, ctx):
        reasons.append(
            f"{node}'s GPUs slow since the job's first steps may be a pipeline stage laid over "
            "them (some of its GPUs, no labels, a job of too few nodes to learn its stages), "
            f"and no other job saw {node} slow: waiting for another job's word"
        )
    if cluster.evictions_last_hour >= safety.max_evictions_per_hour:
        reasons.append(f"eviction budget spent ({cluster.evictions_last_hour} in the last hour)")
    return reasons


def _maybe_a_stage(event: StragglerEvent, ctx: JobContext) -> bool:
    """Issue 36, class 6: GPUs that may be a pipeline stage laid over them
    (:attr:`StragglerEvent.maybe_a_stage`), on a node no other job saw slow, are not evicted:
    noted, and another job's word on the node decides (they never count in node history
    themselves: a two-node pipeline run again on the same nodes would mark a healthy one).
    One GPU, or the whole node, slow from the start is evicted as any straggler: a whole
    node may be a stage too, but nothing tells, and a requeue of a small job costs less than
    a fault left for the rest of its life (measured on the month benchmark)."""
    return event.maybe_a_stage and ctx.node_incidents == 0


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


def _slow(event: StragglerEvent, policy: Policy) -> bool:
    """Slower than its peers by at least the policy's minimum and standing out from the job's
    rank-to-rank variation."""
    return event.slowdown_pct >= minimum_slowdown_pct(event, policy) and not event.blends_in


def is_node_slow(event: StragglerEvent, policy: Policy) -> bool:
    """Slow (over the minimum, standing out), whether or not the job waits for it: what node
    history counts (a node slow in two jobs is a bad node, also where one of them waited for
    a slower pipeline stage anyway). A speed-up, a slowdown too small to matter, and GPUs
    that may be the job's own stage (:attr:`StragglerEvent.maybe_a_stage`) never enter it."""
    return _slow(event, policy) and not event.maybe_a_stage


def is_slowdown(event: StragglerEvent, policy: Policy) -> bool:
    """Slow (over the minimum, standing out) and, for compute, costing the job at least
    ``min_job_loss_pct`` of its time when the detector could say. Anything else (a rank the
    job does not wait for among them) never enters an annotation or a decision."""
    return _slow(event, policy) and not _costs_nothing(event, policy)


def _costs_nothing(event: StragglerEvent, policy: Policy) -> bool:
    loss = event.job_loss_pct
    return (
        event.cause == "compute"
        and loss is not None
        and math.isfinite(loss)
        and loss < policy.detection.min_job_loss_pct
    )


def _not_acted_on(event: StragglerEvent, policy: Policy) -> str | None:
    """Why an event leads to nothing at all (not even an annotation), or None."""
    if policy.actions.mode == "off":
        return "policy is off"
    if event.blends_in:
        return (
            f"{event.node} does not stand out from the job's own rank-to-rank variation: its "
            f"level is {event.level_z:.1f} spreads above the other ranks', a straggler among "
            f"this many ranks must clear {event.level_z_min:.1f}"
        )
    if _costs_nothing(event, policy):
        return (
            f"the job would be no faster without {event.node}: it costs "
            f"{event.job_loss_pct:.2f}% of the job's step time, under the policy's minimum of "
            f"{policy.detection.min_job_loss_pct:g}% (other ranks are as slow)"
        )
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
    gain = goodput(event, job, ctx, policy, now, ahead)
    saved, cost = gain.saved_s, gain.cost_s

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
            asdict(gain),
        )

    why = (
        f"lasted {ahead.lasted_s:.0f} s, expected {ahead.expected_s:.0f} s more "
        f"({ahead.lasting_p:.0%} that it lasts)"
    )
    reasons = _blockers(event, job, policy, ctx, cluster, now)
    margin = policy.actions.risk_sd * gain.share_pct / 100.0 * ahead.sd_s
    if saved <= cost:
        reasons.append(f"goodput: evicting saves {saved:.0f} s but costs {cost:.0f} s ({why})")
    elif ahead.lasting_p < policy.actions.min_lasting_p and not _doubt_costs_more(
        ahead, gain, policy
    ):
        reasons.append(
            f"not sure it lasts: {ahead.lasting_p:.0%} likely, the policy acts from "
            f"{policy.actions.min_lasting_p:.0%} ({why})"
        )
    elif saved - cost <= margin:
        reasons.append(
            f"goodput too uncertain: evicting saves {saved:.0f} s and costs {cost:.0f} s, a "
            f"margin within {policy.actions.risk_sd:g} standard deviation of the saving "
            f"({margin / max(policy.actions.risk_sd, 1e-9):.0f} s: the slowdown may pass) ({why})"
        )
    else:
        unsure = _not_sure_yet(ahead, gain, policy, job, ctx, now)
        reasons += [f"{unsure} ({why})"] if unsure else []
    switches = _switches(cluster)
    if reasons or switches:
        return verdict(note, reasons + switches, on_hold=not reasons and not cluster.dry_run)
    waited = now - ctx.waiting_since if ctx.waiting_since is not None else 0.0
    if checkpoint_wait(policy, ctx) and gain.checkpoint_wait_s > 0:
        if waited < policy.actions.max_wait_s:
            return verdict("wait", ["waiting for the job's next checkpoint"])
        reasons.append(f"no checkpoint within {policy.actions.max_wait_s:.0f} s: evicting")
    action: Action = "annotate" if cluster.dry_run else "evict"
    reasons += ["dry run"] if cluster.dry_run else []
    return verdict(action, [*reasons, f"goodput: saves {saved:.0f} s, costs {cost:.0f} s ({why})"])
