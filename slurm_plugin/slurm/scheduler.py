"""The scheduler seam: a small Protocol and the default backend over Slurm's CLIs.

Every call is an argv list with a timeout; queries are batched (one ``squeue --json`` for all
jobs, one ``sinfo --json`` for all nodes). Failures raise :class:`SlurmError` (with the command)
and callers treat the answer as unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from slurm_plugin.config import Settings
from slurm_plugin.errors import CommandError, JobNotFoundError, SlurmError
from slurm_plugin.model.cluster import HOLD_UNCLEAR, JobInfo, NodeInfo
from slurm_plugin.model.keys import check_job_id, check_node
from slurm_plugin.slurm.parsers import (
    collect_hostlist,
    field_values,
    parse_scontrol_record,
    parse_sinfo_json,
    parse_squeue_json,
)
from slurm_plugin.slurm.release import SlurmRelease, parse_version
from slurm_plugin.slurm.runner import CommandResult, run_command


class Scheduler(Protocol):
    """What the service needs from Slurm."""

    def jobs(self) -> list[JobInfo]:
        """Every job the controller knows (one batched query)."""
        ...

    def job(self, job_id: str) -> JobInfo:
        """One job, freshly from the controller."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """Every node (one batched query)."""
        ...

    def requeue_hold(self, job_id: str) -> None:
        """Requeue a running job and hold it."""
        ...

    def hold_reason(self, job_id: str) -> str:
        """Why Slurm holds the job, as ``scontrol show job`` says: our requeuehold reads
        ``job_requeued_in_held_state``, a hold by its user or an admin ``JobHeldUser`` or
        ``JobHeldAdmin`` (squeue says JobHeldUser for all of them); ``HOLD_UNCLEAR`` when
        the job's own text names a reason too (never taken for ours)."""
        ...

    def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        """Replace the job's excluded nodes (callers merge the old ones in)."""
        ...

    def release(self, job_id: str) -> None:
        """Release a held job."""
        ...

    def annotate(self, job_id: str, text: str) -> None:
        """Set the job's AdminComment."""
        ...

    def drain(self, node: str, reason: str) -> None:
        """Drain a node with a reason."""
        ...

    def resume(self, node: str) -> None:
        """Resume a drained node."""
        ...


Runner = Callable[..., CommandResult]


class ScontrolScheduler:
    """:class:`Scheduler` over squeue, sinfo and scontrol.

    Job state comes only from Slurm's JSON (``squeue --json``, or ``scontrol --json show job J``
    on releases that have it), never from ``scontrol -o`` text, where a job's name, comment or
    submit line can hold ``JobState=...`` and be read as a field. ``runner`` is the command seam
    (``run_command``'s signature); tests pass canned outputs through it.
    """

    def __init__(self, settings: Settings, *, runner: Runner = run_command) -> None:
        self.settings = settings
        self._runner = runner
        self._release: SlurmRelease | None = None

    def _run(self, name: str, *args: str) -> str:
        argv = [self.settings.slurm_command(name), *args]
        try:
            result: CommandResult = self._runner(
                argv, timeout_s=self.settings.slurm.command_timeout_s, env=self.settings.slurm_env()
            )
        except CommandError as exc:
            raise SlurmError(f"{' '.join(argv[:4])}: {exc}") from exc
        return result.stdout

    def slurm_release(self) -> SlurmRelease:
        """The release ``scontrol --version`` names (asked once)."""
        if self._release is None:
            self._release = parse_version(self._run("scontrol", "--version"))
        return self._release

    def jobs(self) -> list[JobInfo]:
        return parse_squeue_json(self._run("squeue", "--json"))

    def job(self, job_id: str) -> JobInfo:
        job_id = check_job_id(job_id)
        try:
            if self.slurm_release().scontrol_json:
                listed = parse_squeue_json(self._run("scontrol", "--json", "show", "job", job_id))
            else:  # 22.05: no scontrol --json, and squeue --json ignores -j: filter here
                listed = self.jobs()
        except SlurmError as exc:
            if "invalid job id" in str(exc).lower():
                raise JobNotFoundError(f"job {job_id} is not known to Slurm ({exc})") from exc
            raise
        for info in listed:
            if info.job_id == job_id:
                return info
        raise JobNotFoundError(f"job {job_id} is not known to Slurm")

    def nodes(self) -> list[NodeInfo]:
        return parse_sinfo_json(self._run("sinfo", "--json"))

    def requeue_hold(self, job_id: str) -> None:
        self._run("scontrol", "requeuehold", check_job_id(job_id))

    def hold_reason(self, job_id: str) -> str:
        text = self._run("scontrol", "-o", "show", "job", check_job_id(job_id))
        parse_scontrol_record(text)  # a line that is no record at all is an error
        # The text cannot be split unambiguously: a job whose comment says `Reason=x` reads
        # as two reasons. Only one reason, all occurrences alike, is believed.
        reasons = set(field_values(text, "Reason"))
        if len(reasons) > 1:
            return HOLD_UNCLEAR
        return reasons.pop() if reasons else ""

    def set_excluded(self, job_id: str, nodes: Sequence[str]) -> None:
        value = collect_hostlist([check_node(n) for n in nodes])
        self._run("scontrol", "update", f"JobId={check_job_id(job_id)}", f"ExcNodeList={value}")

    def release(self, job_id: str) -> None:
        self._run("scontrol", "release", check_job_id(job_id))

    def annotate(self, job_id: str, text: str) -> None:
        self._run("scontrol", "update", f"JobId={check_job_id(job_id)}", f"AdminComment={text}")

    def drain(self, node: str, reason: str) -> None:
        if not reason:
            raise SlurmError("a drain needs a reason")
        self._run(
            "scontrol", "update", f"NodeName={check_node(node)}", "State=DRAIN", f"Reason={reason}"
        )

    def resume(self, node: str) -> None:
        self._run("scontrol", "update", f"NodeName={check_node(node)}", "State=RESUME")
