"""The clocks the PyTorch integrations time with: the wall clock on CPU, CUDA events on a GPU.

On CUDA the host runs ahead of the device, so a mark is an event recorded on the current
stream; it is read only once it has completed (``ready``), never by synchronising.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """Marks a point in the rank's work and tells the seconds between two marks."""

    def mark(self) -> Any: ...
    def ready(self, token: Any) -> bool: ...
    def seconds(self, start: Any, end: Any) -> float: ...


class WallClock:
    """The host's monotonic clock: CPU training, where the host does the work."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, token: Any) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return max(0.0, end - start)


class CudaClock:  # pragma: no cover - exercised only where a GPU exists (make test-gpu)
    """CUDA events on the current stream: what the device did, not when the host asked."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def ready(self, token: torch.cuda.Event) -> bool:
        return bool(token.query())  # type: ignore[no-untyped-call]

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return max(0.0, float(start.elapsed_time(end)) / 1000.0)


def clock_for(on_cuda: bool) -> Clock:
    """The clock for a rank whose work runs on CUDA (``on_cuda``) or on the host."""
    return CudaClock() if on_cuda else WallClock()
