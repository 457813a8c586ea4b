"""One instrumentation per process: steps and collective waits timed, DDP models as built.

Every integration (FSDP, Lightning, Hugging Face, the code-free mode) goes through
:func:`instrument`, so a process is instrumented once however many of them it meets: a job
that runs in code-free mode and also calls an integration (or ``attach``) is timed once, and
the explicit call's reporter takes over.
"""

from __future__ import annotations

import atexit
import functools
import threading
from types import ModuleType
from typing import Any

import structlog
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from slurm_plugin.telemetry import waits
from slurm_plugin.telemetry.clocks import clock_for
from slurm_plugin.telemetry.reporter import StepReporter
from slurm_plugin.telemetry.torch import DDPTimer, group_from_megatron, group_from_mesh
from slurm_plugin.telemetry.waits import CollectiveTimer

log = structlog.get_logger(__name__)
_lock = threading.Lock()


class Instrumentation:
    """This process's instrumentation: its reporter, its step timer and its DDP timer."""

    def __init__(
        self,
        reporter: StepReporter | None,
        *,
        start_step: int = 0,
        group: str = "",
        distributed_only: bool = False,
    ) -> None:
        self._reporter = reporter
        self.start_step = start_step
        self.group = group
        #: Report only once ``torch.distributed`` is initialised (the code-free mode: a
        #: job's single-process helpers are not ranks).
        self.distributed_only = distributed_only
        self.ddp: DDPTimer | None = None
        #: The label of the first ``DeviceMesh`` the job built with a dimension that is not
        #: data parallel (code-free mode: :func:`label_from_meshes`).
        self.mesh_group = ""
        self._label(reporter)

    def _label(self, reporter: StepReporter | None) -> None:
        """Give ``reporter`` this process's peer group, unless the job set one itself
        (``STRAGGLER_GROUP``, ``StepReporter(group=...)``): an integration's, Megatron's
        pipeline stage, or the job's device mesh."""
        if reporter is not None and reporter.enabled and not reporter.group:
            reporter.group = self.group or group_from_megatron() or self.mesh_group

    def mesh_built(self, mesh: Any) -> None:
        """The job built a device mesh: the first one with a dimension that is not data
        parallel (``pp``, ``tp``) labels this rank's peer group (``group_from_mesh``)."""
        if not self.mesh_group:
            self.mesh_group = group_from_mesh(mesh)
            self._label(self._reporter)

    @property
    def reporter(self) -> StepReporter:
        """The reporter, built from the job's environment the first time it is needed."""
        if self._reporter is None:
            self._reporter = StepReporter.from_env()
            self._label(self._reporter)
            # Nobody closes a reporter the job never saw: its last steps go out at exit.
            atexit.register(self._at_exit, self._reporter)
        return self._reporter

    @property
    def timer(self) -> CollectiveTimer | None:
        """The step timer, once the first optimizer step made one."""
        return waits.process.timer

    def adopt(self, reporter: StepReporter | None, start_step: int, group: str) -> None:
        """An explicit integration met this process's instrumentation: its reporter (if it
        brings one) and its start step take over."""
        if reporter is not None and reporter is not self._reporter:
            old, self._reporter = self._reporter, reporter
            for timer in (waits.process.timer, self.ddp):
                if timer is not None:
                    timer.reporter = reporter
            if old is not None:
                old.close(timeout_s=1.0)
        self.group = group or self.group
        self._label(self._reporter)
        if start_step:
            self.start_step = max(self.start_step, start_step)
            for timer in (waits.process.timer, self.ddp):
                if timer is not None:
                    timer.step = max(timer.step, start_step)

    # -- hooks -------------------------------------------------------------------------------
    def optimizer_stepped(self, optimizer: Any) -> None:
        """The first optimizer step (of a distributed job, in code-free mode) makes the
        step timer."""
        if waits.process.timer is not None or waits.process.failed:
            return
        if self.distributed_only and not (dist.is_available() and dist.is_initialized()):
            return
        timer = CollectiveTimer(
            self.reporter, clock=clock_for(_on_cuda(optimizer)), start_step=self.start_step
        )
        timer.reporting = not waits.process.ddp_timing
        waits.process.timer = timer

    def ddp_built(self, model: DistributedDataParallel) -> None:
        """Time a DDP model as it is built (the first one: one step stream per rank)."""
        if self.ddp is not None or isinstance(getattr(model, "_straggler_timer", None), DDPTimer):
            return
        self.ddp = DDPTimer(model, self.reporter, start_step=self.start_step)

    def _at_exit(self, reporter: StepReporter) -> None:
        if reporter is not self._reporter:  # an explicit reporter took over: the job's
            return
        try:
            self.finish()
        except Exception as exc:  # noqa: BLE001 - exiting: say it, never raise
            log.warning("telemetry.exit_flush_failed", error=repr(exc))
        reporter.close(timeout_s=2.0)

    def finish(self) -> None:
        """Report every completed step; the reporter stays open (close it, or let the process
        exit: its flusher publishes what is left)."""
        for timer in (waits.process.timer, self.ddp):
            if timer is not None:
                timer.finish()


_current: Instrumentation | None = None


def instrument(
    reporter: StepReporter | None = None,
    *,
    start_step: int = 0,
    group: str = "",
    distributed_only: bool = False,
) -> Instrumentation:
    """Instrument this process (once): every optimizer step is a step, every collective wait
    its ``comm_s``, and every DDP model built from now on is timed (``telemetry.torch``).

    ``reporter`` defaults to ``StepReporter.from_env()`` (built when first needed); ``group``
    is the rank's peer-group label (ranks that do the same work). Calling it again returns
    the same instrumentation, with this call's reporter, start step and group.
    """
    global _current  # noqa: PLW0603 - one instrumentation per process, by design
    with _lock:
        current = _current
        if current is None:
            current = Instrumentation(
                reporter, start_step=start_step, group=group, distributed_only=distributed_only
            )
            _current = current
            fresh = True
        else:
            fresh = False
    if not fresh:
        if not distributed_only:  # an explicit call: it reports whatever the job is
            current.distributed_only = False
        current.adopt(reporter, start_step, group)
        return current
    waits.install_hooks(_optimizer_stepped)
    _time_ddp_as_built()
    return current


def _optimizer_stepped(optimizer: Any) -> None:
    inst = _current
    if inst is not None:
        inst.optimizer_stepped(optimizer)


def current() -> Instrumentation | None:
    """This process's instrumentation, if any."""
    return _current


def _on_cuda(optimizer: Any) -> bool:
    for group in getattr(optimizer, "param_groups", ()):
        for param in group.get("params", ()):
            return bool(getattr(param, "is_cuda", False))
    return False


def _time_ddp_as_built() -> None:
    original = DistributedDataParallel.__init__
    if getattr(original, "__straggler__", False):
        return

    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, *args, **kwargs)
        inst = _current
        if inst is None or waits.process.failed:
            return
        try:
            inst.ddp_built(self)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            waits.process.failed = True
            log.warning("telemetry.hook_failed", where="DDP model built", error=repr(exc))

    __init__.__straggler__ = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]


def label_from_meshes(module: ModuleType, package: ModuleType | None = None) -> None:
    """Code-free mode: every ``init_device_mesh`` of ``module`` (``torch.distributed.device_mesh``;
    also its re-export in ``package``, ``torch.distributed``) tells the instrumentation the
    mesh it built, so a pipeline or tensor-parallel job is labelled by its mesh coordinates
    with no change to its code. The mesh is the job's whatever happens here."""
    original = getattr(module, "init_device_mesh", None)
    if original is None or getattr(original, "__straggler__", False):
        return

    @functools.wraps(original)
    def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
        mesh = original(*args, **kwargs)
        inst = _current
        if inst is not None:
            try:
                inst.mesh_built(mesh)
            except Exception as exc:  # noqa: BLE001 - never raise into training
                log.warning("telemetry.hook_failed", where="device mesh built", error=repr(exc))
        return mesh

    init_device_mesh.__straggler__ = True  # type: ignore[attr-defined]
    setattr(module, "init_device_mesh", init_device_mesh)  # noqa: B010 - any torch module
    if package is not None and getattr(package, "init_device_mesh", None) is original:
        setattr(package, "init_device_mesh", init_device_mesh)  # noqa: B010


__all__ = ["Instrumentation", "current", "instrument", "label_from_meshes"]
