"""Fakes for what cannot be produced on a test machine, behind the real interfaces.

``FakeNvml`` implements the subset of the pynvml module that :class:`~slurm_plugin.health.gpu.
NvmlProbe` calls, so the probe's real decoding runs against it. Set attributes of a
:class:`FakeGpu` to inject faults (throttling, ECC errors, XIDs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


class FakeNvmlError(Exception):
    """Raised like pynvml's NVMLError (e.g. "not supported", "timeout")."""


@dataclass
class FakeGpu:
    """One simulated GPU; every field may be changed by a test."""

    uuid: str = "GPU-00000000-fake"
    name: str = "Fake H100"
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    throttle_mask: int = 0
    temperature_c: int = 45
    power_mw: int = 300_000
    ecc_uncorrected_volatile: int = 0
    pcie_replay_count: int = 0
    unsupported: set[str] = field(default_factory=set)


@dataclass
class _Event:
    device: FakeGpu
    eventData: int  # noqa: N815 - pynvml's attribute name


class FakeNvml:
    """A stand-in for the ``pynvml`` module."""

    NVMLError = FakeNvmlError

    def __init__(self, gpus: list[FakeGpu] | None = None, *, fail_init: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(uuid=f"GPU-{i}") for i in range(8)]
        self.fail_init = fail_init
        self._events: deque[_Event] = deque()
        self.initialised = False

    def inject_xid(self, index: int, xid: int) -> None:
        """Queue an XID critical-error event on GPU ``index``."""
        self._events.append(_Event(self.gpus[index], xid))

    def _check(self, gpu: FakeGpu, what: str) -> None:
        if what in gpu.unsupported:
            raise FakeNvmlError("Not Supported")

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self.fail_init:
            raise FakeNvmlError("Driver Not Loaded")
        self.initialised = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:  # noqa: N802
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:  # noqa: N802
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:  # noqa: N802
        return gpu.name

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, _clock: int) -> int:  # noqa: N802
        self._check(gpu, "clock")
        return gpu.sm_clock_mhz

    def nvmlDeviceGetMaxClockInfo(self, gpu: FakeGpu, _clock: int) -> int:  # noqa: N802
        self._check(gpu, "clock")
        return gpu.sm_clock_max_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:  # noqa: N802
        self._check(gpu, "throttle")
        return gpu.throttle_mask

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, _sensor: int) -> int:  # noqa: N802
        self._check(gpu, "temperature")
        return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:  # noqa: N802
        self._check(gpu, "power")
        return gpu.power_mw

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, _kind: int, _counter: int) -> int:  # noqa: N802
        self._check(gpu, "ecc")
        return gpu.ecc_uncorrected_volatile

    def nvmlDeviceGetPcieReplayCounter(self, gpu: FakeGpu) -> int:  # noqa: N802
        self._check(gpu, "pcie")
        return gpu.pcie_replay_count

    def nvmlEventSetCreate(self) -> str:  # noqa: N802
        return "event-set"

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, _types: int, _set: Any) -> None:  # noqa: N802
        self._check(gpu, "events")

    def nvmlEventSetWait_v2(self, _set: Any, _timeout_ms: int) -> _Event:  # noqa: N802
        if not self._events:
            raise FakeNvmlError("Timeout")
        return self._events.popleft()

    def nvmlEventSetFree(self, _set: Any) -> None:  # noqa: N802
        return None
