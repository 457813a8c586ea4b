"""PyTorch DistributedDataParallel integration: per-rank compute and communication wait.

``attach(ddp_model, reporter)`` registers a forward pre-hook and a DDP communication hook that
wraps the default all-reduce. For every training step it measures

* ``compute_s``: from the start of the forward pass until the last gradient bucket is ready
  (the work this rank does before it can synchronise), and
* ``comm_s``: from that moment until the last all-reduce completes (time spent waiting for the
  other ranks plus the transfer).

A straggler therefore shows high compute and low wait, its healthy peers high wait. Steps are
closed at the next training forward pass (or by :meth:`DDPTimer.finish`), so ``step_s`` spans
forward start to forward start and includes the optimizer and data loading. Forward passes
with gradients disabled (evaluation) are ignored; several forwards before one synchronisation
(gradient accumulation with ``no_sync``) count as one step.

On CPU (gloo) the clock is the wall clock. On CUDA, CUDA events are recorded on the current
stream (never synchronised: a step is reported once its events have completed), because the
host runs ahead of the device.
"""

# No ``from __future__ import annotations`` here: DDP inspects the comm hook's annotations at
# registration and needs the real classes, not strings.

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin.telemetry.reporter import StepReporter


class _Clock(Protocol):
    def mark(self) -> Any: ...
    def ready(self, token: Any) -> bool: ...
    def seconds(self, start: Any, end: Any) -> float: ...


class _WallClock:
    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, token: Any) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return max(0.0, end - start)


class _CudaClock:  # pragma: no cover - exercised only where a GPU exists
    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def ready(self, token: torch.cuda.Event) -> bool:
        return bool(token.query())  # type: ignore[no-untyped-call]

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return max(0.0, float(start.elapsed_time(end)) / 1000.0)


@dataclass
class _Step:
    started: Any
    ready: Any = None
    done: Any = None
    wall_start: float = 0.0


class DDPTimer:
    """Measures compute and communication wait of one DDP rank; see :func:`attach`."""

    def __init__(
        self,
        model: DistributedDataParallel,
        reporter: StepReporter,
        *,
        process_group: dist.ProcessGroup | None = None,
        start_step: int = 0,
    ) -> None:
        self.reporter = reporter
        self.step = start_step
        on_cuda = any(p.is_cuda for p in model.parameters())
        self._clock: _Clock = _CudaClock() if on_cuda else _WallClock()
        self._current: _Step | None = None
        self._closed: deque[tuple[_Step, float]] = deque(maxlen=64)
        model.register_forward_pre_hook(self._on_forward)
        model.register_comm_hook(process_group, self._comm_hook)

    def _on_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        current = self._current
        if current is not None and current.ready is None:
            return  # gradient accumulation: the step goes on until a synchronisation
        now_wall = time.perf_counter()
        if current is not None:
            self._closed.append((current, now_wall))
        self._current = _Step(started=self._clock.mark(), wall_start=now_wall)
        self._emit_ready()

    def _comm_hook(
        self, process_group: dist.ProcessGroup | None, bucket: GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        step = self._current
        if step is not None:
            step.ready = self._clock.mark()
        future = allreduce_hook(process_group, bucket)  # type: ignore[arg-type]

        def _completed(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            if step is not None:
                step.done = self._clock.mark()
            return fut.value()

        return future.then(_completed)

    def _emit_ready(self) -> None:
        clock = self._clock
        while self._closed:
            step, wall_end = self._closed[0]
            if step.ready is None or step.done is None:
                self._closed.popleft()
                continue
            if not (
                clock.ready(step.started) and clock.ready(step.ready) and clock.ready(step.done)
            ):
                return  # device still busy: report later, never wait
            self._closed.popleft()
            self.reporter.record(
                self.step,
                max(0.0, wall_end - step.wall_start),
                compute_s=clock.seconds(step.started, step.ready),
                comm_s=clock.seconds(step.ready, step.done),
            )
            self.step += 1

    def finish(self) -> None:
        """Close the step in progress and report every completed one (call after training)."""
        if self._current is not None and self._current.ready is not None:
            self._closed.append((self._current, time.perf_counter()))
            self._current = None
        if isinstance(self._clock, _CudaClock):  # pragma: no cover - GPU only
            torch.cuda.synchronize()
        self._emit_ready()


def attach(
    model: DistributedDataParallel,
    reporter: StepReporter,
    *,
    process_group: dist.ProcessGroup | None = None,
    start_step: int = 0,
) -> DDPTimer:
    """Instrument a DDP model: every step's compute and wait go to ``reporter``.

    Example::

        reporter = StepReporter.from_env()
        model = DistributedDataParallel(net)
        timer = attach(model, reporter, start_step=resumed_step)
        ...train...
        timer.finish(); reporter.close()
    """
    if reporter.enabled and not reporter.group:  # Megatron-style stages are peer groups
        reporter.group = group_from_megatron()
    return DDPTimer(model, reporter, process_group=process_group, start_step=start_step)


def group_from_mesh(mesh: Any, data_parallel: tuple[str, ...] = ("dp", "ddp", "fsdp")) -> str:
    """A peer-group label from a ``DeviceMesh``: this rank's coordinates on every dimension
    that is not data parallel (``pp=2.tp=0``). Ranks with the same label do the same work;
    pass it as ``StepReporter(group=...)`` or ``STRAGGLER_GROUP``. A 1-D (pure data-parallel)
    mesh gives "": every rank is a peer of every other."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    coords = mesh.get_coordinate() if hasattr(mesh, "get_coordinate") else None
    if not names or coords is None:
        return ""
    parts = [
        f"{name}={coord}"
        for name, coord in zip(names, coords, strict=True)
        if name.lower() not in data_parallel
    ]
    return ".".join(parts)


def group_from_megatron() -> str:
    """A peer-group label from Megatron-style model parallelism when ``megatron.core`` is
    importable and initialised: the pipeline stage (``pp=3``); "" otherwise. Tensor-parallel
    ranks of one stage do the same work and stay peers."""
    try:
        from megatron.core import parallel_state  # type: ignore[import-not-found]  # noqa: PLC0415
    except ImportError:
        return ""
    try:
        if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
            return ""
        return f"pp={parallel_state.get_pipeline_model_parallel_rank()}"
    except (AssertionError, RuntimeError, AttributeError):  # not initialised
        return ""
