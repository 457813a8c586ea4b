"""What a straggler decision record holds (Redis hash fields, JSON-ready values)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from slurm_plugin.detection import StragglerEvent
from slurm_plugin.policy.decide import Decision, JobContext


def decision_record(
    event: StragglerEvent,
    decision: Decision,
    evidence: list[str],
    reported: list[str],
    node_incidents: int,
) -> dict[str, Any]:
    """The event, the hardware evidence and the verdict with its numbers: goodput, how long
    the slowdown had lasted, how much longer it was expected to and how likely to last."""
    return {
        "node": event.node,
        "cause": event.cause,
        "scope": event.scope,
        "slowdown_pct": event.slowdown_pct,
        "cusum_ratio": event.cusum_ratio,
        "ranks": event.ranks[:32],
        "hardware_evidence": evidence,
        "job_reported_gpu": reported,
        "decision": decision.action,
        "reasons": decision.reasons,
        "saved_s": rounded(decision.saved_s),
        "cost_s": rounded(decision.cost_s),
        "since_ts": rounded(event.since_ts),
        "lasted_s": rounded(decision.lasted_s),
        "expected_s": rounded(decision.expected_s),
        "lasting_p": rounded(decision.lasting_p, 3),
        "job_loss_pct": event.job_loss_pct,
        "goodput_inputs": decision.inputs,
        "node_incidents": node_incidents,
    }


def job_context(job_state: Mapping[str, str]) -> JobContext:
    """What the goodput rule knows of a job, from its service state."""

    def num(key: str) -> float | None:
        return number(job_state.get(key))

    return JobContext(
        evictions=int(job_state.get("evictions", "0") or 0),
        last_eviction_ts=num("last_eviction_ts"),
        last_checkpoint_ts=num("last_checkpoint_ts"),
        reports_checkpoints=job_state.get("reports_checkpoints") == "1"
        and not (
            num("wait_expired_ts") is not None
            and (num("last_checkpoint_ts") or 0.0) <= (num("wait_expired_ts") or 0.0)
        ),
        checkpoint_period_s=num("checkpoint_period_s"),
        waiting_since=num("waiting_since"),
    )


def number(text: str | None) -> float | None:
    """A number the service wrote into a record, or None when missing or unreadable."""
    try:
        value = float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None
    return value if value is None or math.isfinite(value) else None  # a NaN is no number


def number_or(text: str | None, default: float) -> float:
    """A time the service wrote into a record (``planned_at``...), or ``default``."""
    try:
        return float(text) if text else default
    except ValueError:
        return default


def rounded(value: float | None, digits: int = 1) -> float | None:
    """``value`` rounded for a record (None stays None: the field is left out)."""
    return None if value is None else round(value, digits)
