"""The context managers that time a step and its phases for a reporter (``with
rep.step():`` / ``with rep.phase("compute"):``): a clock read on entry and exit, nothing else
on the training thread."""

from __future__ import annotations

import time
from typing import Protocol


class Timed(Protocol):
    """What the timers need of their reporter."""

    _phase_s: list[float | None]
    _next_step: int

    def record(
        self,
        step: int,
        step_s: float,
        compute_s: float | None = None,
        comm_s: float | None = None,
        data_s: float | None = None,
    ) -> None: ...


class StepTimer:
    """Times one step and records it with the phases timed inside it."""

    __slots__ = ("_rep", "_step", "_t0")

    def __init__(self, rep: Timed, step: int | None) -> None:
        self._rep = rep
        self._step = step
        self._t0 = 0.0

    def __enter__(self) -> StepTimer:
        self._rep._phase_s[:] = (None, None, None)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        rep = self._rep
        step = rep._next_step if self._step is None else self._step
        rep._next_step = step + 1
        c, m, d = rep._phase_s
        rep.record(step, time.perf_counter() - self._t0, c, m, d)


class PhaseTimer:
    """Adds the time spent inside it to one phase of the current step."""

    __slots__ = ("_index", "_rep", "_t0")

    def __init__(self, rep: Timed, index: int) -> None:
        self._rep = rep
        self._index = index
        self._t0 = 0.0

    def __enter__(self) -> PhaseTimer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        acc = self._rep._phase_s
        previous = acc[self._index]
        elapsed = time.perf_counter() - self._t0
        acc[self._index] = elapsed if previous is None else previous + elapsed
