"""PyTorch DistributedDataParallel integration: per-rank compute and communication wait.

``attach(ddp_model, reporter)`` registers a forward pre-hook and a hook on the gradient that
backward computes last, and leaves DDP's all-reduce (and any communication hook of the job's)
alone. For every training step it measures

* ``compute_s``: from the start of the forward pass until the last gradient bucket is ready
  (the work this rank does before it can synchronise), and
* ``comm_s``: from that moment until the last all-reduce completes (time spent waiting for the
  other ranks plus the transfer): a final callback of the backward pass, after DDP's own,
  which waits for the all-reduce.

A straggler therefore shows high compute and low wait, its healthy peers high wait. Steps are
closed at the next training forward pass (or by :meth:`DDPTimer.finish`), so ``step_s`` spans
forward start to forward start and includes the optimizer and data loading. Forward passes
with gradients disabled (evaluation) are ignored; several forwards before one synchronisation
(gradient accumulation with ``no_sync``) count as one step.

On CPU (gloo) the clock is the wall clock. On CUDA, CUDA events are recorded on the current
stream (never synchronised: a step is reported once its events have completed), because the
host runs ahead of the device.

A communication hook would see each bucket too, but it replaces DDP's C++ all-reduce with a
Python one: ~0.3 ms more per step (``benchmarks/bench_overhead.py``); these two hooks cost
nothing measurable, and the job keeps its own communication hook, if any.
"""

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin.telemetry import waits
from slurm_plugin.telemetry.clocks import Clock, CudaClock, clock_for
from slurm_plugin.telemetry.reporter import StepReporter


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
        process_group: dist.ProcessGroup | None = None,  # unused: kept for old callers
        start_step: int = 0,
    ) -> None:
        self.reporter = reporter
        self.step = start_step
        on_cuda = any(p.is_cuda for p in model.parameters())
        self._clock: Clock = clock_for(on_cuda)
        self._model = model
        self._engine = torch.autograd.Variable._execution_engine
        self._current: _Step | None = None
        self._closed: deque[tuple[_Step, float]] = deque(maxlen=64)
        model.register_forward_pre_hook(self._on_forward)
        last = _last_gradient(model)
        if last is not None:
            last.register_post_accumulate_grad_hook(self._on_last_gradient)  # type: ignore[no-untyped-call]
        model._straggler_timer = self  # type: ignore[assignment]
        waits.process.ddp_timing = True
        if waits.process.timer is not None:  # the collective timer would count steps twice
            waits.process.timer.reporting = False

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

    def _on_last_gradient(self, _param: torch.Tensor) -> None:
        # The rank's last gradient is in: its work for the step is done, the last bucket's
        # all-reduce starts. (Not on a ``no_sync`` micro-batch: nothing is reduced.)
        step = self._current
        if step is None or not self._model.require_backward_grad_sync:
            return
        step.ready = self._clock.mark()
        self._engine.queue_callback(self._after_reducer_queued)

    def _after_reducer_queued(self) -> None:
        # Among the backward's final callbacks, DDP's finalize (which waits for every
        # all-reduce) may come after this one: the mark goes in a callback queued from here,
        # which runs after it either way.
        self._engine.queue_callback(self._synchronised)

    def _synchronised(self) -> None:
        step = self._current
        if step is not None and step.ready is not None:
            step.done = self._clock.mark()

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

    @property
    def completed(self) -> int:
        """Steps completed so far (reported or about to be): the step a checkpoint saves."""
        current = self._current
        return (
            self.step + len(self._closed) + int(current is not None and current.ready is not None)
        )

    def finish(self) -> None:
        """Close the step in progress and report every completed one (call after training)."""
        if self._current is not None and self._current.ready is not None:
            self._closed.append((self._current, time.perf_counter()))
            self._current = None
        if isinstance(self._clock, CudaClock):  # pragma: no cover - GPU only
            torch.cuda.synchronize()
        self._emit_ready()


def _last_gradient(model: DistributedDataParallel) -> torch.Tensor | None:
    """The parameter whose gradient backward computes last: the first one that needs a
    gradient (backward runs from the loss back to the input)."""
    return next((p for p in model.module.parameters() if p.requires_grad), None)


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

    A model already timed (the code-free mode or an integration timed it as it was built) is
    not timed twice: its timer reports to ``reporter`` from now on, from ``start_step``.
    """
    if reporter.enabled and not reporter.group:  # Megatron-style stages are peer groups
        reporter.group = group_from_megatron()
    existing = getattr(model, "_straggler_timer", None)
    if isinstance(existing, DDPTimer):
        existing.reporter = reporter
        existing.step = max(existing.step, start_step)
        return existing
    return DDPTimer(model, reporter, process_group=process_group, start_step=start_step)


#: Mesh dimension names of data parallelism (FSDP2's HSDP meshes, torchtitan's, Megatron's):
#: ranks that differ only along these do the same work.
DATA_PARALLEL_DIMS = ("dp", "ddp", "fsdp", "replicate", "shard", "dp_replicate", "dp_shard", "cp")


def group_from_mesh(mesh: Any, data_parallel: tuple[str, ...] = DATA_PARALLEL_DIMS) -> str:
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


__all__ = ["DATA_PARALLEL_DIMS", "DDPTimer", "attach", "group_from_megatron", "group_from_mesh"]
