"""Acting on the service's advice inside the job (``straggler leave-on-advice``): run one
node's launcher (for example ``torchrun --nnodes 3:4``), and when the service advises the job
to leave this node, stop the launcher and report that the node left. A launcher that
re-forms its group without the node (torch elastic with ``--nnodes MIN:MAX``, a spare node
in the allocation) then goes on with no Slurm requeue; the service, told so within the
advice's deadline, requeues nothing (policy/lifecycle.py).

The watch never touches the training: it reads one small key every ``every_s`` with the job's
own credential; Redis away is logged and waited out (the service then requeues at the
deadline, as it would without advice).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
import structlog

from slurm_plugin.errors import StragglerError
from slurm_plugin.store import advice
from slurm_plugin.store.advice import Advice

log = structlog.get_logger(__name__)

#: Exit status of the watch when its node left on advice (the launcher stopped on purpose).
LEFT = 0


@dataclass(frozen=True)
class Watch:
    """What the watch needs: where to read advice and report, which node it stands for."""

    job_id: str
    node: str
    read: Callable[[], Advice | None]
    report: Callable[[Advice], None]
    clock: Callable[[], float] = time.time
    every_s: float = 2.0
    #: How long the launcher has to stop after SIGTERM before SIGKILL.
    grace_s: float = 30.0


def advised_here(watch: Watch) -> Advice | None:
    """The advice that asks this node to leave and still holds; None otherwise (no advice,
    another node's, an expired one, or Redis away: logged)."""
    try:
        found = watch.read()
    except (StragglerError, redis.RedisError) as exc:  # waited out: the launcher runs on
        log.warning("leave.advice_unread", job_id=watch.job_id, error=str(exc))
        return None
    if found is None or found.job_id != watch.job_id or not found.for_node(watch.node):
        return None
    return found if found.holds(watch.clock()) else None


def run(
    watch: Watch, argv: Sequence[str], stop: threading.Event | None = None
) -> tuple[int, Advice | None]:
    """Run ``argv`` (its own process group) until it exits (its status, None) or the advice
    asks this node to leave: then stop it (SIGTERM, SIGKILL after ``grace_s``), report that
    the node left, and return (:data:`LEFT`, the advice). SIGTERM/SIGINT to the watch go to
    the launcher."""
    stop = stop or threading.Event()
    child = subprocess.Popen(list(argv), start_new_session=True)  # argv only

    def forward(signum: int, _frame: object) -> None:
        _signal_group(child, signum)

    main = threading.current_thread() is threading.main_thread()  # signals: only there
    signals = (signal.SIGTERM, signal.SIGINT) if main else ()
    previous = {s: signal.signal(s, forward) for s in signals}
    try:
        while True:
            try:
                return child.wait(timeout=watch.every_s), None
            except subprocess.TimeoutExpired:
                pass
            if stop.is_set():
                continue
            found = advised_here(watch)
            if found is None:
                continue
            log.warning(
                "leave.advised",
                job_id=watch.job_id,
                node=watch.node,
                decision_id=found.decision_id,
                reasons=found.reasons,
            )
            _stop(child, watch.grace_s)
            try:
                watch.report(found)
            except StragglerError as exc:  # the service then requeues at the deadline
                log.warning("leave.report_failed", job_id=watch.job_id, error=str(exc))
            return LEFT, found
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.poll() is None:
            _stop(child, watch.grace_s)


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.killpg(child.pid, signum)


def _stop(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the launcher's process group, SIGKILL it after ``grace_s``."""
    _signal_group(child, signal.SIGTERM)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(child, signal.SIGKILL)
        child.wait()


def redis_watch(job_id: str, node: str, client: object, *, every_s: float = 2.0) -> Watch:
    """A watch over Redis (``client``: connected with the job's credential)."""
    from slurm_plugin.store.telemetry_store import TelemetryStore  # noqa: PLC0415

    store = TelemetryStore(client)  # type: ignore[arg-type]

    def report(found: Advice) -> None:
        fields = advice.acted_event(found.decision_id, node)
        event = {"name": advice.ACTED, "ts": time.time(), "node": node, **fields}
        store.publish(job_id, events=[event])

    return Watch(job_id, node, lambda: advice.read(client, job_id), report, every_s=every_s)


__all__ = ["LEFT", "Watch", "advised_here", "redis_watch", "run"]
