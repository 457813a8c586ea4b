"""The service's policies: re-read every cycle, the last good set kept, one chosen per job."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import structlog

from slurm_plugin.config import Settings
from slurm_plugin.errors import StragglerError
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.loader import active_policies, apply_job_overrides, policy_from_comment
from slurm_plugin.policy.schema import Policy
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.registration import Registration

log = structlog.get_logger(__name__)
#: A job's registration, once it is the one of the attempt Slurm runs, is kept this long before
#: it is read again (the prolog writes it once per attempt; at 2,000 jobs reading every one each
#: cycle was 2,000 HGETALLs and ~30 ms).
REGISTRATION_KEPT_S = 600.0


class PolicySet:
    """The policy directory and the applied policies, as the service last read them."""

    def __init__(
        self,
        settings: Settings,
        state: ServiceState,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.state = state
        self.clock = clock
        self.policies: dict[str, Policy] = {}
        self._metas: dict[str, Registration] = {}  # this cycle's job registrations
        #: Registrations of the attempt Slurm runs, with when they were read: not read again
        #: until REGISTRATION_KEPT_S (or the job's attempt or run changes).
        self._kept: dict[str, tuple[Registration, float]] = {}

    @property
    def default(self) -> Policy:
        """The cluster's default policy."""
        return self.policies[self.settings.service.default_policy]

    def reload(self) -> None:
        """Re-read the policy directory and the applied policies; keep the last good set when
        something is broken (raise only when there is none yet)."""
        try:
            policies = self._read()
        except StragglerError as exc:
            if not self.policies:
                raise
            log.warning("service.policies_invalid", error=str(exc), kept=sorted(self.policies))
            return
        self.policies = policies

    def _read(self) -> dict[str, Policy]:
        policies, problems = active_policies(
            self.settings.service.policy_dir, self.state.applied_policies()
        )
        for problem in problems:
            log.warning("service.applied_policy_invalid", problem=problem)
        if self.settings.service.default_policy not in policies:
            raise StragglerError(f"default policy {self.settings.service.default_policy!r} missing")
        return policies

    def prefetch(self, jobs: Iterable[JobInfo]) -> None:
        """The registrations of ``jobs`` for this cycle's :meth:`for_job` (a job missing from
        them is read on its own): those not kept read in one round trip. A registration is kept
        only once it is the one of the attempt (and run, where Slurm has run ids) Slurm runs
        now: before the prolog of a new attempt wrote, the job's is read every cycle."""
        now = self.clock()
        metas: dict[str, Registration] = {}
        wanted = []
        for job in jobs:
            kept = self._kept.get(job.job_id)
            if kept is not None and now - kept[1] < REGISTRATION_KEPT_S and _of_run(kept[0], job):
                metas[job.job_id] = kept[0]
            else:
                wanted.append(job)
        read = self.state.job_metas([job.job_id for job in wanted])
        for job in wanted:
            meta = metas[job.job_id] = read[job.job_id]
            if _of_run(meta, job):
                self._kept[job.job_id] = (meta, now)
            else:
                self._kept.pop(job.job_id, None)
        self._metas = metas
        if len(self._kept) > 2 * len(metas) + 1024:  # jobs that ended: forgotten
            self._kept = {j: k for j, k in self._kept.items() if j in metas}

    def forget(self, job_id: str) -> None:
        """Read the job's registration again (Slurm gave its id to another job)."""
        self._kept.pop(job_id, None)

    def for_job(self, job: JobInfo) -> Policy:
        """The job's policy: its registration, its comment, else the cluster default; with the
        job's own overrides (sbatch --straggler-*) applied only where they are stricter."""
        meta = self._metas.get(job.job_id)
        if meta is None:
            meta = self.state.job_meta(job.job_id)
        wanted = meta.policy or policy_from_comment(job.comment) or ""
        allowed = self.settings.service.allowed_policies
        if wanted and (
            wanted not in self.policies or (allowed is not None and wanted not in allowed)
        ):
            log.warning("service.policy_refused", job_id=job.job_id, policy=wanted[:40])
            wanted = ""
        base = self.policies.get(wanted) or self.default
        return apply_job_overrides(base, meta.job_options())


#: A registration written this long before Slurm started the job's attempt is not kept (an
#: earlier job's with the same id, where its prolog failed to write; nodes' clocks may differ).
KEEP_SLACK_S = 300.0


def _of_run(meta: Registration, job: JobInfo) -> bool:
    """The registration is the one the prolog wrote for the attempt (and run) Slurm runs:
    only such a one is kept (any other is read again each cycle, as it was before)."""
    if not meta.registered_at or meta.attempt != str(job.restarts):
        return False
    if job.sluid is not None and meta.run != job.sluid:
        return False
    try:
        written = float(meta.registered_at)
    except ValueError:
        return False
    start = job.start_time
    return start is None or not math.isfinite(start) or written >= start - KEEP_SLACK_S
