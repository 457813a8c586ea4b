"""The fence between the service and Slurm: every call that changes something in Slurm first
confirms that this instance still leads, so an instance whose cycle stalled past its lock's
lifetime (a slow Slurm, a paused VM) cannot act next to the new leader."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from slurm_plugin.errors import NotLeaderError
from slurm_plugin.model.cluster import JobInfo, NodeInfo
from slurm_plugin.slurm.scheduler import Scheduler

log = structlog.get_logger(__name__)


class FencedScheduler:
    """A :class:`Scheduler` whose changing calls raise :class:`NotLeaderError` unless
    ``still_leader()`` says yes right before them; queries pass through."""

    def __init__(self, inner: Scheduler, still_leader: Callable[[], bool]) -> None:
        self.inner = inner
        self.still_leader = still_leader

    def _fence(self, action: str, target: str) -> None:
        if not self.still_leader():
            log.error("service.not_leader", action=action, target=target)
            raise NotLeaderError(f"not the leader any more: {action} {target} not done")

    def jobs(self) -> list[JobInfo]:
        return self.inner.jobs()

    def job(self, job_id: str) -> JobInfo:
        return self.inner.job(job_id)

    def nodes(self) -> list[NodeInfo]:
        return self.inner.nodes()

    def hold_reason(self, job_id: str) -> str:
        return self.inner.hold_reason(job_id)

    def requeue_hold(self, job_id: str) -> None:
        self._fence("requeue_hold", job_id)
        self.inner.requeue_hold(job_id)

    def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        self._fence("set_excluded", job_id)
        self.inner.set_excluded(job_id, nodes)

    def release(self, job_id: str) -> None:
        self._fence("release", job_id)
        self.inner.release(job_id)

    def annotate(self, job_id: str, text: str) -> None:
        self._fence("annotate", job_id)
        self.inner.annotate(job_id, text)

    def drain(self, node: str, reason: str) -> None:
        self._fence("drain", node)
        self.inner.drain(node, reason)

    def resume(self, node: str) -> None:
        self._fence("resume", node)
        self.inner.resume(node)
