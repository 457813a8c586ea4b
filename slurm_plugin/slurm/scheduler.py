"""The scheduler seam: a small Protocol and the default backend over Slurm's CLIs.

Every call is an argv list with a timeout; queries are batched (one ``squeue --json`` for all
jobs, one ``sinfo --json`` for all nodes). Failures raise :class:`SlurmError` (with the command)
and callers treat the answer as unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from slurm_plugin.config import Settings
from slurm_plugin.errors import CommandError, SlurmError
from slurm_plugin.slurm.model import JobInfo, NodeInfo
from slurm_plugin.slurm.parsers import (
    collect_hostlist,
    parse_scontrol_job,
    parse_sinfo_json,
    parse_squeue_json,
)
from slurm_plugin.slurm.runner import run_command
from slurm_plugin.telemetry.keys import check_job_id, check_node


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


class ScontrolScheduler:
    """:class:`Scheduler` over squeue, sinfo and scontrol."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.errors = 0

    def _run(self, name: str, *args: str) -> str:
        argv = [self.settings.slurm_command(name), *args]
        try:
            return run_command(
                argv, timeout_s=self.settings.command_timeout_s, env=self.settings.slurm_env()
            ).stdout
        except CommandError as exc:
            self.errors += 1
            raise SlurmError(f"{' '.join(argv[:4])}: {exc}") from exc

    def jobs(self) -> list[JobInfo]:
        return parse_squeue_json(self._run("squeue", "--json"))

    def job(self, job_id: str) -> JobInfo:
        line = self._run("scontrol", "-o", "show", "job", check_job_id(job_id)).strip()
        fresh = parse_scontrol_job(line.splitlines()[0] if line else "")
        # Comments may contain anything; squeue's JSON carries them unambiguously.
        for info in self.jobs():
            if info.job_id == fresh.job_id:
                return JobInfo(
                    **{
                        **fresh.__dict__,
                        "comment": info.comment,
                        "admin_comment": info.admin_comment,
                        "time_limit_s": info.time_limit_s,
                        "start_time": info.start_time,
                    }
                )
        return fresh

    def nodes(self) -> list[NodeInfo]:
        return parse_sinfo_json(self._run("sinfo", "--json"))

    def requeue_hold(self, job_id: str) -> None:
        self._run("scontrol", "requeuehold", check_job_id(job_id))

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
