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
