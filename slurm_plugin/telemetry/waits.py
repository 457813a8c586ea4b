"""Compute against collective wait for any PyTorch job: steps from the optimizer, waits from c10d.

Why this mechanism (the README's "Which timing, and why"):

* **Steps** end where every framework ends them: ``optimizer.step()``. PyTorch calls global
  optimizer step hooks for every optimizer, so Lightning, Hugging Face, FSDP and hand-written
  loops all report without a callback of their own; with gradient accumulation a step is one
  optimizer step. Only the first optimizer a process steps counts (a GAN's second one, or a
  wrapper stepping the optimizer it wraps, would count each step twice).
* **Waits** are the time the rank's own work stands still for a collective. Every collective a
  Python framework issues (FSDP1/FSDP2's all-gathers and reduce-scatters, DeepSpeed's,
  ``all_reduce`` of a logged loss, barriers) ends in ``Work.wait()``, also the synchronous
  ones, so timing that one method catches them all, at ~1 us per collective and nothing per
  tensor. On CPU (gloo) ``wait()`` blocks the host: the wall time inside it is the wait. On
  CUDA (NCCL) it only makes the current stream wait, so events recorded on that stream before
  and after it measure how long the stream stood still (or, for a collective issued on a
  side stream as FSDP2 does, how long the collective ran, which is also long on the ranks that
  wait and short on the one they wait for).
* DDP is the exception: its reducer waits in C++, never through Python, so a DDP model is
  timed by hooks of its own instead (:mod:`slurm_plugin.telemetry.torch`); while one is,
  this timer reports nothing, so a step is never reported twice.

A step's ``comm_s`` is its summed wait, ``compute_s`` the rest of the step. The hooks never
raise into training: an error inside them is logged once and the timer stops.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from slurm_plugin.telemetry.clocks import Clock, WallClock
from slurm_plugin.telemetry.reporter import StepReporter

log = structlog.get_logger(__name__)

#: Steps without any collective wait before the job's log says it reports step times only.
NO_WAIT_STEPS = 20


@dataclass
class _Open:
    """A step in progress: when it began and the waits inside it."""

    wall_start: float
    index: int
    waits: list[tuple[Any, Any]] = field(default_factory=list)
    wait_s: float = 0.0


class CollectiveTimer:
    """Times one process's steps (optimizer to optimizer) and its waits in collectives."""

    def __init__(
        self, reporter: StepReporter, *, clock: Clock | None = None, start_step: int = 0
    ) -> None:
        self.reporter = reporter
        #: The step in progress: also how many steps the job has completed (the first
        #: optimizer step completes step ``start_step``; it has no start, so is not reported).
        self.step = start_step
        self.clock: Clock = clock if clock is not None else WallClock()
        #: False while another timer (a DDP model's) reports this rank's steps.
        self.reporting = True
        #: The thread that steps the optimizer: waits on other threads are not the step's.
        self.thread: int | None = None
        self.waits_seen = False
        self._wall = isinstance(self.clock, WallClock)
        self._optimizer: int | None = None
        self._open: _Open | None = None
        self._closed: deque[tuple[_Open, float]] = deque(maxlen=64)
        self._steps_without_waits = 0

    # -- called from the hooks (the training thread) ---------------------------------------
    def add_wait(self, start: Any, end: Any) -> None:
        """One wait of the current step, between two marks of the clock."""
        step = self._open
        if step is None:
            return
        if self._wall:
            step.wait_s += end - start
        else:
            step.waits.append((start, end))
        self.waits_seen = True

    def optimizer_stepped(self, optimizer: Any) -> None:
        """Close the step in progress (when ``optimizer`` is the one that counts)."""
        if self._optimizer is None:
            self._optimizer = id(optimizer)
            self.thread = threading.get_ident()
        elif id(optimizer) != self._optimizer:
            return
        now = time.perf_counter()
        if self._open is not None:
            self._closed.append((self._open, now))
        self.step += 1
        self._open = _Open(wall_start=now, index=self.step)
        self._emit()

    def finish(self) -> None:
        """Report every completed step (call after training; the one in progress is dropped:
        it has no optimizer step to end it)."""
        if not self._wall and torch.cuda.is_available():  # pragma: no cover - GPU only
            torch.cuda.synchronize()
        self._emit()
        self._open = None

    # -- reporting ---------------------------------------------------------------------------
    def _emit(self) -> None:
        clock = self.clock
        while self._closed:
            step, end = self._closed[0]
            if not self._wall and not all(
                clock.ready(a) and clock.ready(b) for a, b in step.waits
            ):  # pragma: no cover - GPU only: the device is still busy; report later
                return
            self._closed.popleft()
            if self.reporting:
                self._report(step, max(0.0, end - step.wall_start))

    def _report(self, step: _Open, step_s: float) -> None:
        if not self.waits_seen:
            self.reporter.record(step.index, step_s)
            self._steps_without_waits += 1
            if self._steps_without_waits == NO_WAIT_STEPS:
                log.warning(
                    "telemetry.step_times_only",
                    steps=NO_WAIT_STEPS,
                    hint="no collective seen: the service gets step times, not compute and "
                    "wait, and cannot tell which rank is slow (see the README's integrations)",
                )
            return
        clock = self.clock
        wait = step.wait_s if self._wall else sum(clock.seconds(a, b) for a, b in step.waits)
        wait = min(wait, step_s)
        self.reporter.record(step.index, step_s, compute_s=step_s - wait, comm_s=wait)


class _Process:
    """What this process has installed: at most one collective timer, hooks installed once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.timer: CollectiveTimer | None = None
        self.hooks_installed = False
        self.failed = False
        #: A DDP model's timer times this process's steps (the collective timer is
        #: then silent).
        self.ddp_timing = False


process = _Process()


def _failed(where: str, exc: BaseException) -> None:
    """A hook failed: stop timing for good (training goes on) and say so once."""
    if not process.failed:
        process.failed = True
        log.warning("telemetry.hook_failed", where=where, error=repr(exc))
    process.timer = None


def install_hooks(on_step: Any = None) -> None:
    """Install the optimizer step hook and the timed ``Work.wait`` once per process.

    ``on_step(optimizer)``, when given, is called at every optimizer step before the timer
    (code-free mode creates the timer there, once ``torch.distributed`` is initialised).
    """
    with process.lock:
        if process.hooks_installed:
            return
        process.hooks_installed = True
    register_optimizer_step_post_hook(_make_step_hook(on_step))
    if dist.is_available():
        _time_work_wait()


def _make_step_hook(on_step: Any) -> Any:
    def _step_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            if on_step is not None:
                on_step(optimizer)
            timer = process.timer
            if timer is not None:
                timer.optimizer_stepped(optimizer)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            _failed("optimizer step", exc)

    return _step_hook


def _time_work_wait() -> None:
    work = dist.distributed_c10d.Work
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        timer = process.timer
        if timer is None or timer.thread != threading.get_ident():
            return original(self, *args, **kwargs)
        try:
            start = timer.clock.mark()
        except Exception as exc:  # noqa: BLE001 - never raise into training
            _failed("collective wait", exc)
            return original(self, *args, **kwargs)
        result = original(self, *args, **kwargs)
        try:
            timer.add_wait(start, timer.clock.mark())
        except Exception as exc:  # noqa: BLE001 - never raise into training
            _failed("collective wait", exc)
        return result

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    work.wait = wait  # type: ignore[method-assign]
