"""Issue 37: the service and the replay carry out one decision lifecycle. The same random event
sequences (detections of slow nodes and of passing blips, several nodes at once, checkpoints,
recoveries, the job ending) go through the real service (real Redis, the fake scheduler and
clock, its detector fed the job's telemetry) and through the backtest's replay (the same
records as a trace, with its companions); both must take the same actions on the same nodes
at the same steps, and leave the same decision waiting.

The detections are scripted (a detector that still takes in every record, so the re-check
reads its rows, but reports what the scenario says): the detector is the same code on both
paths and tested on its own; what this test holds is everything after it. The service's cycle
is the replay's clock: detections, checkpoints and the job's end come at cycle times.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import redis

from slurm_plugin.config import Settings
from slurm_plugin.detection import DetectionParams, Detector, Event, HangEvent, StragglerEvent
from slurm_plugin.model.cluster import NodeInfo
from slurm_plugin.model.records import StepRecord, encode_steps
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.replay import Replay
from slurm_plugin.service.loop import Service
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.telemetry_store import TelemetryStore
from slurm_plugin.testing import FakeClock, FakeScheduler
from slurm_plugin.trace import read_trace, write_trace
from slurm_plugin.trace_meta import CHECKPOINT_END, JobFacts, TraceContext
from tests.integration.conftest import RedisServer, copy_policies
from tests.integration.loop_harness import running_job

JOB = "5"
NODES_IN_JOB = ("node1", "node2", "node3", "node4")
RANKS_PER_NODE = 2
#: The service's cycle (s), the steps each cycle brings, and the healthy compute (s).
CYCLE_S = 10.0
STEPS_PER_CYCLE = 10
COMPUTE_S = 0.5
#: A slow node is reported again this many cycles after its last report (the detector's rearm).
REPORT_EVERY = 7


@dataclass(frozen=True)
class Slow:
    """A node's slowdown: from ``onset`` (a cycle) on, ``factor`` times the healthy compute,
    until ``end`` (a cycle; None: for good)."""

    node: str
    onset: int
    factor: float
    end: int | None

    def at(self, cycle: int) -> float:
        on = self.onset <= cycle and (self.end is None or cycle < self.end)
        return self.factor if on else 1.0


@dataclass
class Scenario:
    """One random job: its slow nodes, blips (a node reported once, never slow), checkpoint
    period (cycles; None: reports none), when it ends (a cycle) and how long it runs."""

    slow: list[Slow]
    blips: dict[int, str]
    checkpoint_every: int | None
    #: The job's checkpoints stop coming from this cycle on (a writer that broke).
    checkpoints_stop: int | None
    ends: int | None
    cycles: int
    seed: int
    #: The shipped policy as it is (a slowdown may be a passing episode), else each slowdown
    #: taken for a fault.
    shipped: bool
    #: Each slowdown taken for a fault, and an eviction advice first (recovery = "advice":
    #: nothing here acts on it, so it is a requeue at the advice's deadline).
    advice: bool = False
    script: dict[float, list[StragglerEvent]] = field(default_factory=dict)

    @classmethod
    def draw(cls, seed: int) -> Scenario:
        rng = random.Random(seed)  # noqa: S311 - a scenario, not cryptography
        nodes = rng.sample(NODES_IN_JOB, rng.choice([1, 2, 2, 3]))
        slow = []
        for node in nodes:
            onset = rng.randrange(3, 150)
            end = rng.choice([None, onset + rng.randrange(2, 90)])
            slow.append(Slow(node, onset, round(rng.uniform(1.04, 2.5), 2), end))
        blips = {rng.randrange(3, 200): rng.choice(NODES_IN_JOB) for _ in range(rng.randrange(4))}
        return cls(
            slow,
            blips,
            rng.choice([None, 18, 30, 60, 100, 150]),
            rng.choice([None, rng.randrange(20, 200)]),
            rng.choice([None, rng.randrange(40, 300)]),
            300,
            seed,
            (shipped := rng.random() < 0.5),
            not shipped and rng.random() < 0.4,
        )

    def factor(self, node: str, cycle: int) -> float:
        return max([1.0, *(s.at(cycle) for s in self.slow if s.node == node)])


def ranks_of(node: str) -> list[int]:
    index = NODES_IN_JOB.index(node)
    return list(range(index * RANKS_PER_NODE, (index + 1) * RANKS_PER_NODE))


class ScriptedDetector(Detector):
    """The real detector (its rows are what the service's re-check reads) reporting what the
    scenario scripts for the current cycle instead of its own alarms."""

    def __init__(
        self, params: DetectionParams, clock: FakeClock, script: dict[float, list[StragglerEvent]]
    ) -> None:
        super().__init__(params)
        self._clock = clock
        self._script = script

    def advance(self, *args: Any, **kwargs: Any) -> list[Event]:
        super().advance(*args, **kwargs)
        return list(self._script.pop(self._clock(), []))

    def check_hangs(self, now: float, *, only: Iterable[str] | None = None) -> list[HangEvent]:
        return []


@dataclass(frozen=True)
class Action:
    """An eviction as the test compares it: the nodes taken out, the step the decision was
    first taken at, what it came after, and the step at which it was carried out."""

    nodes: tuple[str, ...]
    step: int
    after: str
    acted_step: int


@dataclass
class Harness:
    """Builds the service on a private Redis; ``policies``: the policy files both paths read
    (the shipped ones, each slowdown taken for a fault)."""

    make: Callable[..., tuple[Service, ServiceState, TelemetryStore]]
    shipped: Path
    fault: Path
    advice: Path

    def policies(self, sc: Scenario) -> Path:
        if sc.advice:
            return self.advice
        return self.shipped if sc.shipped else self.fault


@pytest.fixture
def harness(private_redis: RedisServer, tmp_path: Path) -> Iterator[Harness]:
    clients: list[redis.Redis] = []
    shipped = copy_policies(tmp_path / "shipped", persistent_prior=None)
    fault = copy_policies(tmp_path / "fault")
    advice = copy_policies(tmp_path / "advice")
    evict = advice / "evict.toml"
    evict.write_text(evict.read_text().replace("[actions]\n", '[actions]\nrecovery = "advice"\n'))

    def make(
        slurm: FakeScheduler,
        clock: FakeClock,
        script: dict[float, list[StragglerEvent]],
        policies: Path,
    ) -> tuple[Service, ServiceState, TelemetryStore]:
        text = redis.Redis.from_url(private_redis.url, decode_responses=True)
        raw = redis.Redis.from_url(private_redis.url)
        clients.extend([text, raw])
        text.flushdb()
        settings = Settings(service={"policy_dir": policies, "interval_s": CYCLE_S})
        state, store = ServiceState(text, clock), TelemetryStore(raw)
        service = Service(
            settings,
            slurm,
            state,
            store,
            clock=clock,
            instance="eq",
            detector=lambda params: ScriptedDetector(params, clock, script),
        )
        return service, state, store

    yield Harness(make, shipped, fault, advice)
    for client in clients:
        client.close()


def _event(sc: Scenario, node: str, cycle: int, now: float, factor: float) -> StragglerEvent:
    onsets = [s.onset for s in sc.slow if s.node == node and s.at(cycle) > 1.0]
    since = now - CYCLE_S * (cycle - min(onsets)) if onsets else now
    return StragglerEvent(
        job_id=JOB,
        node=node,
        gpu=None,
        ranks=ranks_of(node),
        step=(cycle + 1) * STEPS_PER_CYCLE - 1,
        ts=now,
        cusum_ratio=1.5,
        slowdown_pct=round((factor - 1.0) * 100.0, 1),
        cause="compute",
        scope="node",
        since_ts=since,
        job_loss_pct=round((1.0 - 1.0 / factor) * 100.0, 1),
    )


def _detections(sc: Scenario, cycle: int, now: float) -> list[StragglerEvent]:
    """What the scenario's detector reports at ``cycle``: each slow node at its onset and then
    every REPORT_EVERY cycles while it lasts, and a blip (a node reported at +30 % that the
    re-check finds at its peers' pace)."""
    found = []
    for node in NODES_IN_JOB:
        onsets = [s.onset for s in sc.slow if s.node == node and s.at(cycle) > 1.0]
        if onsets and (cycle - min(onsets)) % REPORT_EVERY == 0:
            found.append(_event(sc, node, cycle, now, sc.factor(node, cycle)))
        elif sc.blips.get(cycle) == node:
            found.append(_event(sc, node, cycle, now, 1.3))
    return found


def _records(sc: Scenario, cycle: int, t0: float, rng: random.Random) -> list[StepRecord]:
    """The job's records of ``cycle``'s steps: a slow node computes longer, the others wait."""
    out = []
    step_s = COMPUTE_S * max(sc.factor(n, cycle) for n in NODES_IN_JOB) + 0.1
    for step in range(cycle * STEPS_PER_CYCLE, (cycle + 1) * STEPS_PER_CYCLE):
        ts = t0 + (step + 1) * CYCLE_S / STEPS_PER_CYCLE
        for node in NODES_IN_JOB:
            for rank in ranks_of(node):
                compute = COMPUTE_S * sc.factor(node, cycle) * (1 + 0.01 * rng.gauss(0, 1))
                out.append(
                    StepRecord(JOB, rank, node, rank % RANKS_PER_NODE, step, ts, step_s,
                               compute, step_s - compute, 0.001)
                )  # fmt: skip
    return out


def _publish(store: TelemetryStore, records: list[StepRecord]) -> None:
    batches = []
    for node in NODES_IN_JOB:
        for rank in ranks_of(node):
            raws = [
                (r.step, r.ts, r.step_s, r.compute_s, r.comm_s, r.data_s)
                for r in records
                if r.rank == rank
            ]
            batches.append(encode_steps(rank, node, rank % RANKS_PER_NODE, 0, raws, ""))
    store.publish(JOB, batches)


def _step_at(ts: float, t0: float) -> int:
    return round((ts - t0) * STEPS_PER_CYCLE / CYCLE_S) - 1


def _through_the_service(
    sc: Scenario, harness: Harness, t0: float
) -> tuple[list[Action], list[str], list[str], list[StepRecord], list[float]]:
    """Cycles of the real service over the scenario, until the job ends, is evicted or the
    scenario's time is up. Returns its evictions, each detection's verdict (in order), the
    nodes of the decision waiting when the job last ran, the records it was given and the
    checkpoints."""
    clock = FakeClock(t0)
    job = replace(running_job(clock, JOB, nodes=NODES_IN_JOB), node_count=len(NODES_IN_JOB))
    nodes = [NodeInfo(f"node{i}", "idle", (), "", ("debug",)) for i in range(1, 9)]
    slurm = FakeScheduler([job], nodes)
    script: dict[float, list[StragglerEvent]] = {}
    service, state, store = harness.make(slurm, clock, script, harness.policies(sc))
    rng = random.Random(sc.seed)  # noqa: S311 - measurement noise
    records: list[StepRecord] = []
    checkpoints: list[float] = []
    verdicts: list[str] = []
    acted: dict[str, int] = {}
    left: list[str] = []
    for cycle in range(sc.cycles):
        clock.now = t0 + (cycle + 1) * CYCLE_S
        if sc.ends is not None and cycle >= sc.ends:
            waiting = state.job(JOB).get("waiting")
            slurm.job_table[JOB] = replace(slurm.job_table[JOB], state="COMPLETED")
            service.cycle()
            if waiting:  # nothing is waited for on a job that ended
                assert state.decision(waiting)["state"] == "abandoned"
            break
        new = _records(sc, cycle, t0, rng)
        records += new
        _publish(store, new)
        stopped = sc.checkpoints_stop is not None and cycle >= sc.checkpoints_stop
        if sc.checkpoint_every and (cycle + 1) % sc.checkpoint_every == 0 and not stopped:
            checkpoints.append(clock())
            step = (cycle + 1) * STEPS_PER_CYCLE - 1
            store.publish(JOB, events=[{"name": CHECKPOINT_END, "ts": clock(), "step": step}])
        script[clock()] = _detections(sc, cycle, clock())
        report = service.cycle()
        assert report.error is None, report.error
        verdicts += [d["action"] for d in report.decisions[: len(report.events)]]
        for d in report.decisions:
            if d.get("action") == "evict":
                acted.setdefault(d["id"], _step_at(clock(), t0))
        held = service._decisions.waiting(state.job_state(JOB))
        left = held.nodes() if held else []
        if slurm.job_table[JOB].restarts:
            break
    evictions = [
        Action(
            tuple(sorted(slurm.job_table[JOB].excluded)),
            int(d["step"]),
            d.get("after") or "detection",
            acted[d["id"]],
        )
        for d in state.job_decisions(JOB)
        if d.get("action") == "evict" and d.get("state") != "failed"
    ]
    return evictions, verdicts, left, records, checkpoints


def _through_the_replay(
    sc: Scenario, policies: Path, records: list[StepRecord], checkpoints: list[float], t0: float
) -> tuple[list[Action], list[str], list[str]]:
    """The same detections, on the same records as a trace, through the backtest's replay."""
    out = io.StringIO()
    write_trace(records, out)
    trace = read_trace(io.StringIO(out.getvalue()), name="eq")
    start = t0 - 600
    context = TraceContext(
        jobs={JOB: JobFacts(start, start + 4 * 3600)},
        events={JOB: [(ts, CHECKPOINT_END) for ts in checkpoints]},
    )
    policy = load_policy(policies / "evict.toml")
    replay = Replay(policy, trace, context, cycle_s=CYCLE_S)
    verdicts: list[str] = []
    rows: list[dict[str, Any]] = []
    last = max(r.ts for r in records)
    for cycle in range(sc.cycles):
        now = t0 + (cycle + 1) * CYCLE_S
        if now > last:
            break
        for event in _detections(sc, cycle, now):
            replay.until(event.ts, before=True)
            row: dict[str, Any] = {"node": event.node, "step": event.step, "ts": event.ts}
            replay.decide(event, row)
            verdicts.append(row["action"])
            rows.append(row)
        replay.until(now)
    evictions = [
        Action(
            tuple(sorted(replay.excluded.get(JOB, ()))),
            row["step"],
            row.get("after") or "detection",
            _step_at(row.get("acted_ts", row["ts"]), t0),
        )
        for row in rows
        if row["action"] == "evict"
    ]
    held = replay.waiting.get(JOB)
    return evictions, verdicts, held.state.nodes() if held else []


SEEDS = 32


def test_the_service_and_the_replay_take_the_same_actions(harness: Harness) -> None:
    """Same detections, checkpoints (and checkpoints that stop), recoveries and job end:
    the same verdict on every detection, the same eviction (nodes, the step it was decided
    at, what it came after, the step it was carried out at), and the same decision left
    waiting. The scenarios between them reach every path: an eviction on detection, at a
    checkpoint and after ``max_wait_s``, waits, annotations and nothing, a job ending while a
    decision waits (closed by the service)."""
    t0 = 1_800_000_000.0
    seen: dict[str, int] = {}
    for seed in range(SEEDS):
        sc = Scenario.draw(seed)
        evictions, verdicts, left, records, checkpoints = _through_the_service(sc, harness, t0)
        replayed = _through_the_replay(sc, harness.policies(sc), records, checkpoints, t0)
        assert (evictions, verdicts, left) == replayed, sc
        for what in [*(f"after {e.after}" for e in evictions), *verdicts]:
            seen[what] = seen.get(what, 0) + 1
        if any(len(e.nodes) > 1 for e in evictions):
            seen["several nodes in one requeue"] = seen.get("several nodes in one requeue", 0) + 1
        if sc.ends is not None and any(a == "wait" for a in verdicts) and not evictions:
            seen["ended waiting"] = seen.get("ended waiting", 0) + 1
    wanted = {"after detection", "after checkpoint", "after max wait", "evict", "wait"}
    wanted |= {"after advice deadline"}
    assert wanted | {"annotate", "none", "ended waiting", "several nodes in one requeue"} <= set(
        seen
    ), seen
