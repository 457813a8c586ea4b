"""The life of a decision about one job, as one pure state machine: the service carries out
its effects on Redis and Slurm, the backtest carries out the same effects in memory, so the
two can never again decide differently around the same verdict.

A job is either *idle* (``None``) or has one decision :class:`Waiting`. Two inputs drive it:

- :func:`detected`: the detector reported a straggler. The policy's verdict (:func:`decide`)
  with the facts after it (:func:`~slurm_plugin.policy.verdict.final`: an eviction already in
  progress, the re-check of the node) says evict, wait, annotate or nothing. While a decision
  waits, a new detection of another node joins it as a *candidate*; an eviction supersedes it.
- :func:`tick`: a service cycle (a point on the trace's clock). A waiting decision is decided
  again when what it waits for came: the job's checkpoint or ``max_wait_s`` (``checkpoint``),
  a pause or the breaker lifted (``resume``), a re-check that had nothing to look at
  (``recheck``, the next cycle; for at most ``max_wait_s``, then the decision is closed and
  the node's next detection decides anew: no decision waits forever). Of its candidates,
  the one slowest in the newest steps is decided on again, as if the job reported no
  checkpoints, on the candidate's own event.

- Under ``recovery = "advice"`` an eviction first advises the job to leave the nodes itself
  (:class:`Advise`; the decision then waits for ``advice``): the job's report that it left
  every advised node closes it (``acted``, no requeue); at ``advice_deadline_s`` without it,
  the decision is taken again and its eviction requeues the job as under ``requeue``. A node
  the job was advised to leave before is never advised again: still slow there, it is
  requeued away.

- :func:`ended`: the job stopped running (ended, requeued or held by another, the end of
  its trace): its waiting decision is abandoned, nothing is waited for any more.

Every eviction, waited or not, is
one :class:`Evict` effect carrying the verdict it was decided on, so what it saves and costs
reaches the same accounting on both paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from slurm_plugin.detection.events import Event, StragglerEvent
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.decide import (
    ClusterContext,
    Decision,
    JobContext,
    decide,
    is_slowdown,
)
from slurm_plugin.policy.schema import Policy
from slurm_plugin.policy.verdict import UNKNOWN, Facts, final, recheck

WaitingFor = Literal["checkpoint", "resume", "recheck", "advice"]
#: What an eviction came after: the detection itself, or what its waiting decision waited for.
After = Literal["detection", "checkpoint", "max wait", "resume", "recheck", "advice deadline"]


class Recheck(Protocol):
    """The re-check (detection/recheck.py): how much slower ``event``'s node (its straggling
    ranks) is than its peers in the job's newest steps from ``since_step`` on, in %; None:
    unknown, nothing of the node to look at (never "recovered")."""

    def __call__(self, event: StragglerEvent, since_step: int) -> float | None: ...


@dataclass(frozen=True)
class Candidate:
    """A node flagged while its job's decision waits: its own event, and how many other jobs
    had seen it slow then (the verdict's prior that it is a fault)."""

    event: StragglerEvent
    node_incidents: int = 0


@dataclass(frozen=True)
class Waiting:
    """A job's decision that waits: for what, since when, on which event and candidates (the
    original event's node first)."""

    decision_id: str
    candidates: tuple[Candidate, ...]
    since: float
    waiting_for: WaitingFor = "checkpoint"
    #: Since when a re-check has had nothing to look at (None: not re-checking).
    rechecking_since: float | None = None
    #: The nodes the job was advised to leave (waiting for ``advice``).
    advised: tuple[str, ...] = ()

    @property
    def event(self) -> StragglerEvent:
        """The event the decision was first taken on."""
        return self.candidates[0].event

    def nodes(self) -> list[str]:
        return [c.event.node for c in self.candidates]


@dataclass(frozen=True)
class World:
    """The facts of now, as the caller gathered them."""

    job: JobInfo
    policy: Policy
    ctx: JobContext
    cluster: ClusterContext
    now: float
    recheck: Recheck
    #: An eviction of this job is still open (its outcome not yet known); asked only of a
    #: verdict to evict, as the re-check is.
    evicting: Callable[[], bool] = lambda: False
    #: The job's other nodes flagged in the same cycle as this detection, each with its own
    #: event and incidents: candidates for the same requeue (asked only of an eviction).
    peers: Callable[[], tuple[Candidate, ...]] = lambda: ()
    #: The nodes the job was advised to leave before (never advised again).
    advised: frozenset[str] = frozenset()
    #: Decision id -> the nodes the job reported leaving on that decision's advice.
    acted: Mapping[str, frozenset[str]] = field(default_factory=dict)


# -- effects --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """Save a new decision: recorded (``annotate`` puts our mark on the job), or waiting."""

    decision_id: str
    event: StragglerEvent
    decision: Decision
    state: Literal["recorded", "waiting"]
    extra: dict[str, object] = field(default_factory=dict)
    annotate: bool = False
    node_incidents: int = 0


@dataclass(frozen=True)
class Joined:
    """A node flagged while the job's decision waits joined it as a candidate."""

    decision_id: str
    waiting: Waiting


@dataclass(frozen=True)
class Rechecking:
    """The waiting decision's re-check had nothing to look at (from ``since``): decided again
    next cycle."""

    decision_id: str
    since: float


@dataclass(frozen=True)
class Missed:
    """The job's checkpoint did not come within ``max_wait_s``: it is decided on as if it
    reported none until its next one."""

    now: float


@dataclass(frozen=True)
class Close:
    """End the job's waiting decision without an eviction (``note``: why it was superseded);
    ``abandoned``: the job stopped running while it waited (``note`` says so)."""

    decision_id: str
    reasons: tuple[str, ...] = ()
    note: str = ""
    abandoned: bool = False
    #: The job left the advised nodes itself: no requeue.
    acted: bool = False


#: Why a waiting decision closes when its re-check never had anything to look at (the job's
#: newest steps never showed the node: restarted with other step numbers, a node that stopped
#: reporting): the node's next detection decides anew, on its own steps.
RECHECK_GAVE_UP = "closed: nothing of the node to re-check on"

#: Why a waiting decision of a job that stopped running is abandoned.
ENDED = "the job stopped running (ended, requeued or held) while waiting"


@dataclass(frozen=True)
class Evict:
    """Requeue the job without ``nodes``, on ``decision`` about ``event``."""

    decision_id: str
    event: StragglerEvent
    decision: Decision
    nodes: tuple[str, ...]
    after: After
    #: When the slowdown acted on was first detected (detection to action: the latency).
    detected_ts: float
    node_incidents: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    def event_on(self, node: str) -> StragglerEvent:
        """What it puts into ``node``'s history, the service and the backtest alike: the
        event decided on; on another node of the requeue, that event with no slowdown or
        episode of its own. An incident however young (the job paid a requeue for it)."""
        if node == self.event.node:
            return self.event
        return replace(self.event, node=node, slowdown_pct=0.0, since_ts=None)


@dataclass(frozen=True)
class Advise:
    """Advise the job to leave ``nodes`` by ``deadline_ts`` (the decision waits for it), on
    ``decision`` about ``event``."""

    decision_id: str
    event: StragglerEvent
    decision: Decision
    nodes: tuple[str, ...]
    deadline_ts: float
    detected_ts: float
    #: The waiting decision it leaves (its candidates: every advised node with its event).
    waiting: Waiting
    node_incidents: int = 0
    extra: dict[str, object] = field(default_factory=dict)


Effect = Record | Joined | Rechecking | Missed | Close | Evict | Advise

#: Why a decision closes when the job left the advised nodes itself.
ACTED = "the job left the advised nodes itself"


def _act(
    evict: Evict, candidates: tuple[Candidate, ...], world: World
) -> tuple[Waiting | None, Evict | Advise]:
    """An eviction, or under ``recovery = "advice"`` the advice to leave its nodes first
    (unless the job was advised to leave every one of them before), waiting for the job."""
    actions = world.policy.actions
    if actions.recovery != "advice" or set(evict.nodes) <= world.advised:
        return None, evict
    chosen = [Candidate(evict.event, evict.node_incidents)]  # its own node first
    for c in candidates:
        if c.event.node in evict.nodes and c.event.node not in {x.event.node for x in chosen}:
            chosen.append(c)
    deadline = world.now + actions.advice_deadline_s
    state = Waiting(evict.decision_id, tuple(chosen), world.now, "advice", advised=evict.nodes)
    advise = Advise(
        evict.decision_id,
        evict.event,
        evict.decision,
        evict.nodes,
        deadline,
        evict.detected_ts,
        state,
        evict.node_incidents,
        {**evict.extra, "waiting_for": "advice"},
    )
    return state, advise


def _verdict(
    event: StragglerEvent, world: World, ctx: JobContext
) -> tuple[Decision, dict[str, object]]:
    """The policy's decision, then the facts after it (an eviction in progress, the
    re-check of the node from the step it was flagged at)."""
    decision = decide(event, world.job, world.policy, ctx, world.cluster, world.now)
    if decision.action != "evict":
        return decision, {}
    evicting = world.evicting()
    fact = None
    if not evicting:
        slowdown = world.recheck(event, event.step)
        fact = recheck(event.node, slowdown, world.policy.detection.min_slowdown_pct)
    return final(decision, Facts(evicting=evicting, recheck=fact))


def detected(
    state: Waiting | None,
    event: StragglerEvent,
    node_incidents: int,
    decision_id: str,
    world: World,
) -> tuple[Waiting | None, list[Effect], Decision]:
    """A straggler ``event`` on the job, ``decision_id`` the id a new decision takes."""
    world = _advised_before(world, event.node)
    ctx = replace(world.ctx, node_incidents=node_incidents)
    decision, settled = _verdict(event, world, ctx)
    if state is not None and state.waiting_for == "advice" and event.node in state.advised:
        return state, [], decision  # the job was advised to leave it: its deadline stands
    if decision.action == "evict":
        effects: list[Effect] = []
        if state is not None:
            effects.append(Close(state.decision_id, note=f"superseded by {decision_id}"))
        others = [*(state.candidates if state is not None else ()), *world.peers()]
        nodes = (event.node, *_joining(others, event.step, world, ctx, event.node))
        evict = Evict(
            decision_id, event, decision, nodes, "detection", event.ts, node_incidents, settled
        )
        waits, acted = _act(evict, tuple(others), world)
        effects.append(acted)
        return waits, effects, decision
    if decision.action == "wait" or decision.on_hold:
        if state is not None:  # one waiting decision per job; its clock is not reset
            if event.node in state.nodes():
                return state, [], decision
            joined = (*state.candidates, Candidate(event, node_incidents))
            state = replace(state, candidates=joined)
            return state, [Joined(state.decision_id, state)], decision
        waiting_for: WaitingFor = "resume" if decision.on_hold else "checkpoint"
        if settled.get("waiting_for") == "recheck":
            waiting_for = "recheck"
        rechecking = world.now if waiting_for == "recheck" else None
        first = (Candidate(event, node_incidents),)
        state = Waiting(decision_id, first, world.now, waiting_for, rechecking)
        extra = {**settled, "waiting_for": waiting_for}
        if rechecking is not None:
            extra["rechecking_since"] = rechecking
        record = Record(
            decision_id, event, decision, "waiting", extra, decision.on_hold, node_incidents
        )
        return state, [record], decision
    annotate = decision.action == "annotate"
    record = Record(decision_id, event, decision, "recorded", settled, annotate, node_incidents)
    return state, [record], decision


def peers_of(
    event: StragglerEvent,
    flagged: Iterable[Event],
    policy: Policy,
    incidents: Callable[[str], int],
) -> tuple[Candidate, ...]:
    """The job's other nodes among ``flagged`` (a cycle's detections) that slowed it, each
    once, with its incidents in other jobs (``incidents(node)``): :attr:`World.peers`."""
    found: dict[str, Candidate] = {}
    for other in flagged:
        if (
            isinstance(other, StragglerEvent)
            and other.job_id == event.job_id
            and other.node != event.node
            and other.node not in found
            and is_slowdown(other, policy)
        ):
            found[other.node] = Candidate(other, incidents(other.node))
    return tuple(found.values())


def _joining(
    others: list[Candidate], step: int, world: World, ctx: JobContext, first: str
) -> list[str]:
    """The other flagged nodes that go in the same requeue as ``first``: each whose own
    verdict, now, with the nodes before it already excluded (the partition's capacity), is
    to evict and whose re-check shows it still slow, up to the rails' nodes per eviction.
    Each candidate's share is its own what-if, in which the job's other slow nodes count as
    dealt with (detection/attribution.py), so two bad nodes never mask each other."""
    most = world.cluster.safety.max_nodes_per_eviction
    chosen = [first]
    for candidate in others:
        if len(chosen) >= most:
            break
        if candidate.event.node in chosen:
            continue
        event = replace(candidate.event, ts=world.now, step=step)
        job = replace(world.job, excluded=(*world.job.excluded, *chosen))
        here = replace(world, job=job, evicting=lambda: False)
        own = replace(ctx, node_incidents=candidate.node_incidents)
        verdict, settled = _verdict(event, here, own)
        if verdict.action == "evict" and not settled:
            chosen.append(candidate.event.node)
    return chosen[1:]


def _advised_before(world: World, node: str) -> World:
    """A node the job was advised to leave before is decided on as a requeue (never
    advised again, and only with a requeue's rails)."""
    if node not in world.advised:
        return world
    return replace(world, policy=requeue_only(world.policy))


def requeue_only(policy: Policy) -> Policy:
    """``policy`` deciding a requeue (``recovery = "requeue"``)."""
    if policy.actions.recovery == "requeue":
        return policy
    actions = policy.actions.model_copy(update={"recovery": "requeue"})
    return policy.model_copy(update={"actions": actions})


def _advice_due(state: Waiting, world: World) -> Literal["acted", "advice deadline"] | None:
    """The job left every advised node (by its own report), or its deadline passed."""
    if state.advised and set(state.advised) <= world.acted.get(state.decision_id, frozenset()):
        return "acted"
    deadline = state.since + world.policy.actions.advice_deadline_s
    return "advice deadline" if world.now >= deadline else None


def _due(state: Waiting, world: World) -> After | Literal["acted"] | None:
    """What the waiting decision waited for, if it came by now."""
    if state.waiting_for == "resume":
        return None if world.cluster.paused or world.cluster.breaker_open else "resume"
    if state.waiting_for == "recheck":
        return "recheck"
    if state.waiting_for == "advice":
        return _advice_due(state, world)
    if (world.ctx.last_checkpoint_ts or 0.0) >= state.since:
        return "checkpoint"
    if world.now - state.since >= world.policy.actions.max_wait_s:
        return "max wait"
    return None


def slowest(state: Waiting, world: World) -> Candidate:
    """Of the waiting decision's candidates, the one slowest in the newest steps since the
    original event's step (the first when none shows any)."""
    since = state.event.step

    def slowdown(c: Candidate) -> float:
        found = world.recheck(c.event, since)
        return float("-inf") if found is None else found

    return max(state.candidates, key=slowdown)


def _rechecking(
    state: Waiting, world: World, effects: list[Effect]
) -> tuple[Waiting | None, list[Effect]]:
    """The re-check had nothing to look at again: wait on, for at most ``max_wait_s`` from
    when it first had nothing, then close (the node's next detection decides anew)."""
    if state.waiting_for != "recheck" or state.rechecking_since is None:
        effects.append(Rechecking(state.decision_id, world.now))
        return replace(state, waiting_for="recheck", rechecking_since=world.now), effects
    if world.now - state.rechecking_since >= world.policy.actions.max_wait_s:
        gave_up = f"{RECHECK_GAVE_UP} for {world.now - state.rechecking_since:.0f} s"
        return None, [*effects, Close(state.decision_id, (gave_up,))]
    return state, effects


def tick(state: Waiting | None, world: World) -> tuple[Waiting | None, list[Effect]]:
    """A cycle: decide a waiting decision again if what it waits for came."""
    if state is None:
        return None, []
    after = _due(state, world)
    if after is None:
        return state, []
    if after == "acted":
        left = ", ".join(state.advised)
        return None, [Close(state.decision_id, note=f"{ACTED}: {left}", acted=True)]
    if after == "advice deadline":  # the requeue it falls back to: its rails, as a requeue
        world = replace(world, policy=requeue_only(world.policy))
    effects: list[Effect] = []
    if after == "max wait":
        effects.append(Missed(world.now))
    chosen = slowest(state, world)
    world = _advised_before(world, chosen.event.node)
    # Decided again on the chosen node's own event, flagged at the original step, now.
    event = replace(chosen.event, ts=world.now, step=state.event.step)
    ctx = replace(world.ctx, reports_checkpoints=False, node_incidents=chosen.node_incidents)
    again, settled = _verdict(event, world, ctx)
    if settled.get("waiting_for") == "recheck":  # still nothing to re-check on
        return _rechecking(state, world, effects)
    if again.action != "evict":
        return None, [*effects, Close(state.decision_id, tuple(again.reasons))]
    others = [c for c in state.candidates if c is not chosen]
    evict = Evict(
        state.decision_id,
        event,
        again,
        (event.node, *_joining(others, state.event.step, world, ctx, event.node)),
        after,
        state.event.ts,
        chosen.node_incidents,
        settled,
    )
    # At the advice's deadline the job had its chance: requeued, as under requeue.
    waits, acted = (
        (None, evict) if after == "advice deadline" else _act(evict, state.candidates, world)
    )
    return waits, [*effects, acted]


def ended(decision_id: str) -> tuple[None, list[Effect]]:
    """The job of the waiting decision ``decision_id`` stopped running: abandoned (by id: a
    record too damaged to be decided on again is still closed)."""
    return None, [Close(decision_id, note=ENDED, abandoned=True)]


__all__ = [
    "ACTED",
    "ENDED",
    "RECHECK_GAVE_UP",
    "UNKNOWN",
    "Advise",
    "After",
    "Candidate",
    "Close",
    "Effect",
    "Evict",
    "Joined",
    "Missed",
    "Recheck",
    "Rechecking",
    "Record",
    "Waiting",
    "World",
    "detected",
    "ended",
    "peers_of",
    "requeue_only",
    "slowest",
    "tick",
]
