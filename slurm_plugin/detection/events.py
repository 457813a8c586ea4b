"""What the detector reports (frozen values; JSON via ``to_dict``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Cause = Literal["compute", "input"]
Scope = Literal["gpu", "node"]

#: A job on fewer nodes cannot show a pipeline stage on one node as structure: the detector
#: learns a stage only where it spans two nodes or more, and two more hold the rest.
STAGE_MIN_JOB_NODES = 4


class _Json:
    """``to_dict``: the JSON-ready form of a dataclass event."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data: dict[str, Any] = asdict(self)  # type: ignore[call-overload]
        return data


@dataclass(frozen=True)
class StragglerEvent(_Json):
    """One node (or one GPU of it) holds the job back."""

    job_id: str
    node: str
    gpu: int | None
    ranks: list[int]
    step: int
    ts: float
    #: The alarming CUSUM chart's statistic over its threshold (>= 1 at an alarm; 1.0 for
    #: an input report): how far past the line the evidence is, not a performance ratio.
    cusum_ratio: float
    slowdown_pct: float
    cause: Cause
    scope: Scope
    attempt: int = 0
    kind: Literal["straggler"] = "straggler"
    #: When the slowdown began (unix time): the first step of the run that raised the alarm,
    #: or of the first report when the node is reported again for the same slowdown.
    since_ts: float | None = None
    #: The share of the job's step time (%) the node costs it: the what-if of the recent
    #: steps without its ranks (None: unknown, nothing to compare with).
    job_loss_pct: float | None = None
    #: How far the flagged ranks' level (their excess compute smoothed over
    #: ``level_halflife_steps``) stands above the job's other ranks', in their rank-to-rank
    #: spread of levels, and the bar a straggler among the
    #: job's ranks must clear (:func:`slurm_plugin.detection.attribution.stand_out`; None:
    #: too few ranks to tell).
    level_z: float | None = None
    level_z_min: float | None = None
    #: Its ranks (no labels gave them peers on another node) were as slow through the
    #: warm-up, the first steps the detector saw: a fault present from the job's start, or an
    #: offset of the job's design (a pipeline stage) that a job of too few nodes cannot show
    #: as structure.
    from_start: bool = False
    #: Some GPUs of the node (more than one, not all) were as slow from the first steps, in
    #: a job of fewer than :data:`STAGE_MIN_JOB_NODES` nodes (too few to learn its stages):
    #: a pipeline stage laid over those GPUs looks the same, where a fault slows one GPU or
    #: the whole node.
    maybe_a_stage: bool = False

    @property
    def blends_in(self) -> bool:
        """A compute straggler whose level does not stand out from the job's own rank-to-rank
        spread of levels: the tail of how the job's healthy ranks differ, not a fault of the
        node. Unknown (too few ranks, a record of an earlier release) never blends in."""
        z, bar = self.level_z, self.level_z_min
        return (
            self.cause == "compute"
            and z is not None
            and bar is not None
            and math.isfinite(bar)
            and not z >= bar  # a NaN level blends in
        )

    @property
    def lasted_s(self) -> float:
        """How long the slowdown has lasted when reported (0 when its start is unknown)."""
        return max(0.0, self.ts - self.since_ts) if self.since_ts is not None else 0.0


@dataclass(frozen=True)
class HangEvent(_Json):
    """The job made no progress for the hang timeout."""

    job_id: str
    step: int
    ts: float
    stalled_s: float
    first_stopped: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    attempt: int = 0
    kind: Literal["hang"] = "hang"


@dataclass(frozen=True)
class SyncStallEvent(_Json):
    """Job-wide wait rose while compute stayed flat: fabric or collective trouble."""

    job_id: str
    step: int
    ts: float
    wait_rise_pct: float
    attempt: int = 0
    kind: Literal["sync_stall"] = "sync_stall"


Event = StragglerEvent | HangEvent | SyncStallEvent
