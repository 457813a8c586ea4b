"""Fakes for what cannot be produced on a test machine, behind the real interfaces.

The fake NVML lives beside the real probe (:mod:`slurm_plugin.probes.fake_nvml`);
``build_ib_tree`` writes a fake sysfs InfiniBand tree for :mod:`slurm_plugin.health.fabric`.

``RecordingReporter`` stands in for a :class:`~slurm_plugin.telemetry.reporter.StepReporter`
where an instrumentation is tested without Redis: it keeps what the timers report.

``FakeStore`` is a :class:`~slurm_plugin.store.telemetry_store.TelemetryStore` that keeps what a
reporter publishes in memory, with failures injectable (Redis away; Redis that stored a
flush and then went away before answering): the reporter's flush, retry and bounds in the
unit tier.

``FakeScheduler`` is the :class:`~slurm_plugin.slurm.scheduler.Scheduler` seam for unit tests of
the control loop: scripted jobs and nodes, every call recorded, failures injectable; with
``FakeClock`` the rails can be tested rail by rail without a cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_plugin.errors import JobNotFoundError, RedisUnavailableError, TelemetryError
from slurm_plugin.health.fabric import COUNTERS
from slurm_plugin.model.cluster import REQUEUE_HELD, JobInfo, NodeInfo
from slurm_plugin.model.records import encode_json_entry
from slurm_plugin.store.telemetry_store import TelemetryStore


def build_ib_tree(
    root: Path,
    hcas: int = 8,
    *,
    rate: str = "400 Gb/sec (4X NDR)",
    state: str = "4: ACTIVE",
    phys_state: str = "5: LinkUp",
    counters: dict[str, int] | None = None,
) -> list[Path]:
    """Write a fake /sys/class/infiniband tree (one port per HCA) under ``root``; returns
    the port directories so a test can break one."""
    ports = []
    for i in range(hcas):
        port = root / "sys/class/infiniband" / f"mlx5_{i}" / "ports" / "1"
        (port / "counters").mkdir(parents=True, exist_ok=True)
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text(phys_state + "\n")
        (port / "rate").write_text(rate + "\n")
        for name in COUNTERS:
            (port / "counters" / name).write_text(f"{(counters or {}).get(name, 0)}\n")
        ports.append(port)
    return ports


class RecordingReporter:
    """A stand-in for ``StepReporter`` that keeps what it is given (``fail``: every record
    raises, as a broken reporter would)."""

    enabled = True
    group = ""

    def __init__(self, fail: bool = False) -> None:
        #: (step, step_s, compute_s, comm_s) in the order reported.
        self.steps: list[tuple[int, float, float | None, float | None]] = []
        self.events: list[dict[str, Any]] = []
        self.fail = fail

    def record(
        self,
        step: int,
        step_s: float,
        compute_s: float | None = None,
        comm_s: float | None = None,
        data_s: float | None = None,
    ) -> None:
        if self.fail:
            raise RuntimeError("reporter broken")
        self.steps.append((step, step_s, compute_s, comm_s))

    def event(self, name: str, **fields: Any) -> None:
        self.events.append({"name": name, **fields})

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        return None


class FakeClock:
    """A clock that moves only when told (``clock()`` -> now; ``advance(s)``)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self.now += seconds


#: The Scheduler calls that change something in Slurm (everything else only reads).
CHANGING_CALLS = frozenset(
    {"requeue_hold", "set_excluded", "release", "annotate", "drain", "resume"}
)


class FakeScheduler:
    """A Slurm that keeps its jobs and nodes in memory and behaves like the real one where the
    service depends on it: requeuehold holds (priority 0, restarts + 1, no nodes), release runs
    the job again on usable nodes it does not exclude, RESUME keeps the Reason (as 24.11 does).
    ``fail[name] = exc`` makes a call raise; ``calls`` lists every call with its arguments."""

    def __init__(self, jobs: Sequence[JobInfo] = (), nodes: Sequence[NodeInfo] = ()) -> None:
        self.job_table: dict[str, JobInfo] = {j.job_id: j for j in jobs}
        self.node_table: dict[str, NodeInfo] = {n.name: n for n in nodes}
        self.calls: list[tuple[str, ...]] = []
        self.fail: dict[str, Exception] = {}

    @property
    def changes(self) -> list[tuple[str, ...]]:
        """The calls that changed something in Slurm."""
        return [c for c in self.calls if c[0] in CHANGING_CALLS]

    def _call(self, name: str, *args: str) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise self.fail[name]

    def _get(self, job_id: str) -> JobInfo:
        if job_id not in self.job_table:
            raise JobNotFoundError(f"job {job_id} is not known to Slurm")
        return self.job_table[job_id]

    def jobs(self) -> list[JobInfo]:
        self._call("jobs")
        return list(self.job_table.values())

    def job(self, job_id: str) -> JobInfo:
        self._call("job", job_id)
        return self._get(job_id)

    def nodes(self) -> list[NodeInfo]:
        self._call("nodes")
        return list(self.node_table.values())

    def requeue_hold(self, job_id: str) -> None:
        self._call("requeue_hold", job_id)
        job = self._get(job_id)
        self.job_table[job_id] = replace(
            job,
            state="PENDING",
            # As `scontrol show job` says it (squeue: JobHeldUser); a user's or an admin's
            # hold reads JobHeldUser or JobHeldAdmin in both.
            reason=REQUEUE_HELD,
            priority=0,
            nodes=(),
            restarts=job.restarts + 1,
            # Slurm moves the submit time on a requeue (to the requeue's time).
            submit_time=None if job.submit_time is None else job.submit_time + 60.0,
            # From 25.11 each run has its own unique id: a requeue starts a new one.
            sluid=None if job.sluid is None else f"{job.sluid[:-2]}{job.restarts + 1:02d}",
        )

    def hold_reason(self, job_id: str) -> str:
        self._call("hold_reason", job_id)
        job = self._get(job_id)
        return job.reason if job.held else ""

    def hold(self, job_id: str, by: str = "User") -> None:
        """What `scontrol hold` (``by="Admin"``) or `scontrol uhold` does: not the service's."""
        self.job_table[job_id] = replace(
            self._get(job_id), state="PENDING", reason=f"JobHeld{by}", priority=0, nodes=()
        )

    def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        self._call("set_excluded", job_id, ",".join(nodes))
        self.job_table[job_id] = replace(self._get(job_id), excluded=tuple(nodes))

    def release(self, job_id: str) -> None:
        self._call("release", job_id)
        job = self._get(job_id)
        if job.state == "COMPLETING" and job.hold_landed:  # the hold lifts; the end goes on
            self.job_table[job_id] = replace(job, reason="None", priority=1)
            return
        if not job.held:
            return
        free = [
            n.name
            for n in self.node_table.values()
            if n.usable and n.name not in job.excluded and job.partition in n.partitions
        ]
        if len(free) < job.node_count:
            self.job_table[job_id] = replace(job, reason="Resources", priority=1)
            return
        self.job_table[job_id] = replace(
            job, state="RUNNING", reason="None", priority=1, nodes=tuple(free[: job.node_count])
        )

    def annotate(self, job_id: str, text: str) -> None:
        self._call("annotate", job_id, text)
        self.job_table[job_id] = replace(self._get(job_id), admin_comment=text)

    def drain(self, node: str, reason: str) -> None:
        self._call("drain", node, reason)
        info = self.node_table[node]
        flags = tuple(dict.fromkeys((*info.flags, "DRAIN")))
        self.node_table[node] = replace(info, flags=flags, reason=reason)

    def resume(self, node: str) -> None:
        self._call("resume", node)
        info = self.node_table[node]
        self.node_table[node] = replace(info, flags=(), state="idle")


class _Connection:
    """What a reporter closes when it is done with its store."""

    closed = False

    def close(self) -> None:
        self.closed = True


class FakeStore(TelemetryStore):
    """A telemetry store in memory: ``steps`` and ``events`` as a reporter published them.

    ``fail_next`` publishes fail before anything is stored (Redis away); ``lose_answer`` are
    stored and then fail (Redis stored the flush, the client gave up before the answer).
    ``stored`` is set after each publish that stored something, for tests to wait on."""

    def __init__(self) -> None:
        self.connection = _Connection()
        super().__init__(self.connection)  # type: ignore[arg-type]
        self.steps: list[dict[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.calls = 0
        self.fail_next = 0
        self.lose_answer = 0
        self.stored = threading.Event()
        self._lock = threading.Lock()

    def publish(
        self,
        job_id: str,
        steps: Sequence[Mapping[str, str]] = (),
        events: Sequence[Mapping[str, Any]] = (),
        gpu_samples: Sequence[Mapping[str, Any]] = (),
        *,
        refresh_ttl: bool = False,
        steps_maxlen: int | None = None,
    ) -> int:
        """Keep the steps and the events that encode (as the real store does); refused
        events are counted, never kept."""
        with self._lock:
            self.calls += 1
            if self.fail_next:
                self.fail_next -= 1
                raise RedisUnavailableError(f"publish for job {job_id} failed: fake Redis away")
            refused = 0
            for event in events:
                try:
                    encode_json_entry(event)
                except TelemetryError:
                    refused += 1
                else:
                    self.events.append(dict(event))
            self.steps.extend(dict(fields) for fields in steps)
            self.stored.set()
            if self.lose_answer:
                self.lose_answer -= 1
                raise RedisUnavailableError(f"publish for job {job_id}: no answer (stored)")
            return refused


__all__ = ["FakeClock", "FakeScheduler", "FakeStore", "RecordingReporter", "build_ib_tree"]
