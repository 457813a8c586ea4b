"""The final verdict on a detection: the policy's decision (:func:`decide`) with the facts
the service gathered after it, as one pure step, so what is logged, saved and done is the
same thing, decided once.

Facts: an eviction of the job already in progress (then nothing more is done now), and the
re-check of the node on the job's newest steps (recovered: not evicted; unknown: nothing of
the node to look at yet, so the decision waits one cycle and is taken again, never read as
recovered).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_plugin.policy.decide import Decision

#: The re-check's answer when nothing of the node can be looked at: decide again.
UNKNOWN = "not sure yet: no recent steps of the node to re-check; decided again next cycle"
#: A flagged node counts as recovered when its newest steps show less than this fraction of
#: the policy's minimum slowdown (hysteresis: flagged at the minimum, released below half).
RECOVERED_BELOW = 0.5


def recheck(node: str, slowdown_pct: float | None, min_slowdown_pct: float) -> str | None:
    """The re-check's fact from ``node``'s slowdown over its peers in the newest steps (None:
    nothing to look at): :data:`UNKNOWN`, why it recovered, or None while it is still slow.
    Half the minimum, not the minimum itself: the re-check is a robust median over few steps
    and the detection a mean over the shift, so a node slowed by about the minimum would flip
    between the two; a burst that is over shows ~0 %. The service and the backtest both."""
    if slowdown_pct is None:
        return UNKNOWN
    release = min_slowdown_pct * RECOVERED_BELOW
    if slowdown_pct < release:
        return (
            f"recovered, not evicted: {node} is {slowdown_pct:+.1f}% over its peers in the "
            f"newest steps (recovered below {release:g}%, half the policy's minimum)"
        )
    return None


@dataclass(frozen=True)
class Facts:
    """What the service found out about the job once the policy had decided."""

    evicting: bool = False
    #: Why the node is not to be evicted now (recovered, or :data:`UNKNOWN`); None: still slow
    #: (or no re-check was made: the decision was no eviction).
    recheck: str | None = None


def final(decision: Decision, facts: Facts) -> tuple[Decision, dict[str, object]]:
    """The decision to log, save and carry out, and what its record says beyond the policy's
    verdict (``decision``/``reasons`` follow the final action; ``waiting_for``)."""
    if decision.action != "evict":
        return decision, {}
    if facts.evicting:
        done = replace(decision, action="none", reasons=["an eviction is in progress"])
    elif facts.recheck == UNKNOWN:
        waiting = replace(decision, action="wait", reasons=[UNKNOWN])
        return waiting, {"decision": "wait", "reasons": waiting.reasons, "waiting_for": "recheck"}
    elif facts.recheck:
        done = replace(decision, action="none", reasons=[facts.recheck])
    else:
        return decision, {}
    return done, {"decision": done.action, "reasons": done.reasons}
