"""Which of a job id's decisions belong to the job Slurm runs under that id now.

Slurm gives an id again (a controller reinstall, ``MaxJobId`` wrapping); the decisions of the
earlier job stay in the id's index for their retention. `job show` shows the current job's
and counts the others per job, told apart as the service tells jobs apart
(``service/identity.py``): the user and the first submit time Slurm gave the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_plugin.store.job_state import JobState

#: Submit times within this many seconds are the same (Slurm keeps whole seconds).
_SAME_S = 1.0


@dataclass(frozen=True)
class Run:
    """One job that held the id: its user and first submit time (None: not recorded)."""

    user: str | None
    first_submit_ts: float | None

    @classmethod
    def of_decision(cls, decision: Mapping[str, Any]) -> Run:
        return cls(_text(decision.get("job_user")), _number(decision.get("job_first_submit_ts")))

    @classmethod
    def of_state(cls, state: JobState) -> Run | None:
        if state.identity_user is None:
            return None
        return cls(state.identity_user, _number(state.identity_first_submit_ts))

    def same(self, other: Run) -> bool:
        if self.user and other.user and self.user != other.user:
            return False
        if self.first_submit_ts is None or other.first_submit_ts is None:
            return True
        return abs(self.first_submit_ts - other.first_submit_ts) < _SAME_S


def split(
    decisions: Sequence[dict[str, Any]], current: Run | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The decisions of the job that holds the id now, and a summary per earlier job (its
    user, first submit time and decisions). Without a current job (the service keeps no state
    for the id) the newest decision's job is the one shown."""
    if current is None and decisions:
        current = Run.of_decision(decisions[-1])
    mine: list[dict[str, Any]] = []
    others: dict[Run, int] = {}
    for decision in decisions:
        run = Run.of_decision(decision)
        if current is None or current.same(run):
            mine.append(decision)
        else:
            others[run] = others.get(run, 0) + 1
    return mine, [
        {"user": run.user, "first_submit_ts": run.first_submit_ts, "decisions": count}
        for run, count in others.items()
    ]


def _number(value: Any) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None
