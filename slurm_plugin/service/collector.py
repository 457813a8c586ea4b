"""The garbage collector of the service's process.

A cycle at 2,000 jobs of 8 ranks allocates a few hundred thousand short-lived containers (an
entry's fields, its header, per-job batches). At CPython's default thresholds (700, 10, 10)
that set off ~450 young, ~40 middle and ~3.6 full collections a cycle, the full ones each
walking every object the service keeps (~120,000): 270 ms of a 1,070 ms cycle, measured with
``benchmarks.bench_many_jobs``. A young generation of 10,000 allocations keeps the same
collector (cycles of garbage are still found) at ~27 young, ~2.5 middle and one full
collection every four cycles: ~90 ms a cycle.

Even so, a young collection in the middle of a cycle walks the cycle's live containers (a
page of entries, the decoded columns' headers) and moves them into the middle generation,
whose collections then walk them again: ~80 ms of a ~950 ms cycle. :class:`BetweenCycles`
pauses the collector during a cycle and collects once at its end, when what the cycle read is
gone (freed by reference counts): the young generation is then small, and the middle and full
collections run on a clock of their own. Garbage in reference cycles waits at most one cycle.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

#: Allocations (net of deallocations) between two young collections; CPython's is 700.
YOUNG = 10_000


def tune() -> None:
    """Set the process's collector thresholds for a service cycle (``straggler serve`` and
    the benchmark that measures its cycle call this)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)


#: Seconds between two collections of the middle generation, and of every generation, made at
#: the end of a cycle (the young one is collected at the end of every cycle).
MIDDLE_EVERY_S = 10.0
FULL_EVERY_S = 120.0


class BetweenCycles:
    """The collector paused during a cycle, run at its end (the young generation each time,
    the middle and full ones as their periods come due); nothing is changed where the
    collector was disabled already."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._middle_at = self._full_at = clock()

    @contextlib.contextmanager
    def cycle(self) -> Iterator[None]:
        """Run the body with the collector paused; collect after it."""
        if not gc.isenabled():
            yield
            return
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
            now = self.clock()
            generation = 0
            if now - self._full_at >= FULL_EVERY_S:
                generation, self._full_at, self._middle_at = 2, now, now
            elif now - self._middle_at >= MIDDLE_EVERY_S:
                generation, self._middle_at = 1, now
            gc.collect(generation)
