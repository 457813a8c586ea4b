"""The service's policies: re-read every cycle, the last good set kept, one chosen per job."""

from __future__ import annotations

import structlog

from slurm_plugin.config import Settings
from slurm_plugin.errors import StragglerError
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.loader import active_policies, apply_job_overrides, policy_from_comment
from slurm_plugin.policy.schema import Policy
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.registration import Registration

log = structlog.get_logger(__name__)


class PolicySet:
    """The policy directory and the applied policies, as the service last read them."""

    def __init__(self, settings: Settings, state: ServiceState) -> None:
        self.settings = settings
        self.state = state
        self.policies: dict[str, Policy] = {}
        self._metas: dict[str, Registration] = {}  # this cycle's job registrations

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

    def prefetch(self, job_ids: list[str]) -> None:
        """Read the registrations of ``job_ids`` in one round trip, for this cycle's
        :meth:`for_job` (a job missing from them is read on its own)."""
        self._metas = self.state.job_metas(job_ids)

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
