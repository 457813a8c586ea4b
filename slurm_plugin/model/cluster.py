"""What we know about Slurm jobs and nodes (frozen values, built by the parsers)."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: A job's ranks are believed only below this many per node of the job (a job's user could
#: otherwise claim rank 10**12, and the detector's arrays are as wide as the highest rank).
MAX_RANKS_PER_NODE = 1024


#: ``scontrol show job``'s Reason for a job our requeuehold holds; a hold by the job's user or
#: an admin reads one of OTHERS_HOLDS (squeue says JobHeldUser for every one of them).
REQUEUE_HELD = "job_requeued_in_held_state"
OTHERS_HOLDS = frozenset({"JobHeldUser", "JobHeldAdmin"})
#: The hold reason when ``scontrol -o show job`` gives more than one (the job's own name,
#: comment or submit line holds ``Reason=...``): never taken for ours.
HOLD_UNCLEAR = "(unclear: the job's own text names a hold reason too)"


@dataclass(frozen=True)
class JobInfo:
    """One job as Slurm reports it."""

    job_id: str
    name: str
    state: str
    reason: str
    nodes: tuple[str, ...]
    excluded: tuple[str, ...]
    restarts: int
    requeue: bool
    comment: str
    admin_comment: str
    partition: str
    node_count: int
    user: str
    time_limit_s: float | None = None
    start_time: float | None = None
    priority: int | None = None
    #: When the job was submitted, or last requeued (Slurm moves it then, and counts the
    #: restart): with the user and ``restarts``, what tells this job from a later one that
    #: Slurm gave the same id (service/identity.py).
    submit_time: float | None = None
    #: Slurm's unique id of this run of the job (SLUID, from 25.11; a requeue gives a new
    #: one): None where the release has none.
    sluid: str | None = None

    @property
    def running(self) -> bool:
        """Running and past its prolog."""
        return self.state == "RUNNING" and self.reason != "Prolog"

    @property
    def held(self) -> bool:
        """Held by a user or admin (``requeuehold`` leaves it so: priority 0, and a reason of
        JobHeldUser in squeue or job_requeued_in_held_state in scontrol)."""
        return self.state == "PENDING" and self._hold_set

    @property
    def hold_landed(self) -> bool:
        """Held, or held once its processes have ended: right after ``requeuehold`` Slurm shows
        the job COMPLETING with its hold set (priority 0) and the restart counted, and a
        slurmctld restarted then shows it so for as long as the nodes take to report."""
        return self.state in {"PENDING", "COMPLETING"} and self._hold_set

    @property
    def _hold_set(self) -> bool:
        return self.priority == 0 or self.reason in OTHERS_HOLDS or self.reason == REQUEUE_HELD


@dataclass(frozen=True)
class NodeInfo:
    """One node as Slurm reports it."""

    name: str
    state: str
    flags: tuple[str, ...]
    reason: str
    partitions: tuple[str, ...]
    reason_time: float | None = None  # when Slurm set the reason (unix time), if it says

    @property
    def drained(self) -> bool:
        """Drained or draining, by its state flags. Never by its reason alone: Slurm 24.11 keeps
        a node's Reason for 20 s or more after RESUME."""
        return self.state == "drained" or bool({"DRAIN", "DRAINED", "DRAINING"} & set(self.flags))

    @property
    def usable(self) -> bool:
        """Can take jobs: not down, drained, draining or failing."""
        bad = {"DRAIN", "DRAINED", "DRAINING", "FAIL", "NOT_RESPONDING", "MAINTENANCE"}
        return self.state not in {"down", "drained", "fail", "unknown"} and not (
            bad & set(self.flags)
        )


#: A SLUID as Slurm writes it: "s" and Crockford base32 (13 characters in 26.05).
_SLUID = re.compile(r"s[0-9A-Z]{6,30}")


def valid_sluid(text: object) -> str | None:
    """``text`` when it is a SLUID, else None (an older release, or nothing usable)."""
    return text if isinstance(text, str) and _SLUID.fullmatch(text) else None
