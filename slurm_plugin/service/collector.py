"""The garbage collector of the service's process.

A cycle at 2,000 jobs of 8 ranks allocates a few hundred thousand short-lived containers (an
entry's fields, its header, per-job batches). At CPython's default thresholds (700, 10, 10)
that set off ~450 young, ~40 middle and ~3.6 full collections a cycle, the full ones each
walking every object the service keeps (~120,000): 270 ms of a 1,070 ms cycle, measured with
``benchmarks.bench_many_jobs``. A young generation of 10,000 allocations keeps the same
collector (cycles of garbage are still found) at ~27 young, ~2.5 middle and one full
collection every four cycles: ~90 ms a cycle.
"""

from __future__ import annotations

import gc

#: Allocations (net of deallocations) between two young collections; CPython's is 700.
YOUNG = 10_000


def tune() -> None:
    """Set the process's collector thresholds for a service cycle (``straggler serve`` and
    the benchmark that measures its cycle call this)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
