"""A fake NVML: what cannot be produced on a machine without a (faulty) GPU, behind the real
interface.

``FakeNvml`` implements the subset of the pynvml module that :class:`~slurm_plugin.probes.gpu.
NvmlProbe` calls, so the probe's real decoding runs against it. Set attributes of a
:class:`FakeGpu` to inject faults (throttling, ECC errors, XIDs). The development cluster's
prolog uses one per node (``devcluster_fake_nvml``); production never does.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class FakeNvmlError(Exception):
    """Raised like pynvml's NVMLError (e.g. "not supported", "timeout")."""


@dataclass(eq=False)  # a handle: identity, like NVML's device pointers
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
    sm_clock_default_mhz: int = 1980
    retired_pages_pending: bool = False
    remap_pending: bool = False
    remap_failed: bool = False
    pcie_gen: int = 5
    pcie_gen_max: int = 5
    pcie_width: int = 16
    pci_bus_id: str = ""  # FakeNvml numbers them 00000000:18:00.0, 19, ... when empty
    pcie_width_max: int = 16
    nvlinks: list[bool] = field(default_factory=lambda: [True] * 18)
    recovery_action: int = 0
    hang: bool = False
    unsupported: set[str] = field(default_factory=set)


@dataclass
class _Event:
    device: FakeGpu
    eventData: int  # noqa: N815 - pynvml's attribute name
    seq: int = 0


class FakeNvml:
    """A stand-in for the ``pynvml`` module."""

    NVMLError = FakeNvmlError

    def __init__(self, gpus: list[FakeGpu] | None = None, *, fail_init: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(uuid=f"GPU-{i}") for i in range(8)]
        self.fail_init = fail_init
        self._events: deque[_Event] = deque()
        self._seq = 0
        self._registered: dict[int, int] = {}  # id(gpu) -> event count at registration
        self.initialised = False
        for index, gpu in enumerate(self.gpus):
            gpu.pci_bus_id = gpu.pci_bus_id or f"00000000:{0x18 + index:02X}:00.0"

    def inject_xid(self, index: int, xid: int) -> None:
        """An XID critical error happens on GPU ``index`` now. As with real NVML, only event
        sets registered before it see it: a process that registers later never does (read the
        kernel log for those, ``health/kmsg.py``)."""
        self._seq += 1
        self._events.append(_Event(self.gpus[index], xid, self._seq))

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
        gpu = self.gpus[index]
        while gpu.hang:  # a hung GPU: NVML never answers
            time.sleep(1)
        return gpu

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

    def nvmlDeviceGetDefaultApplicationsClock(self, gpu: FakeGpu, _clock: int) -> int:  # noqa: N802
        self._check(gpu, "clock")
        return gpu.sm_clock_default_mhz

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGpu) -> int:  # noqa: N802
        self._check(gpu, "retired")
        return int(gpu.retired_pages_pending)

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:  # noqa: N802
        self._check(gpu, "remap")
        return (0, 0, int(gpu.remap_pending), int(gpu.remap_failed))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: FakeGpu) -> int:  # noqa: N802
        return gpu.pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: FakeGpu) -> int:  # noqa: N802
        return gpu.pcie_gen_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: FakeGpu) -> int:  # noqa: N802
        return gpu.pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: FakeGpu) -> int:  # noqa: N802
        return gpu.pcie_width_max

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:  # noqa: N802
        if link >= len(gpu.nvlinks):
            raise FakeNvmlError("Not Supported")
        return int(gpu.nvlinks[link])

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[int]) -> list[Any]:  # noqa: N802
        self._check(gpu, "fields")
        out = []
        for field_id in field_ids:
            value = SimpleNamespace(uiVal=gpu.recovery_action if field_id == 230 else 0)
            out.append(SimpleNamespace(fieldId=field_id, nvmlReturn=0, value=value))
        return out

    def nvmlEventSetCreate(self) -> str:  # noqa: N802
        return "event-set"

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, _types: int, _set: Any) -> None:  # noqa: N802
        self._check(gpu, "events")
        self._registered[id(gpu)] = self._seq

    def nvmlEventSetWait_v2(self, _set: Any, _timeout_ms: int) -> _Event:  # noqa: N802
        while self._events:
            event = self._events.popleft()
            since = self._registered.get(id(event.device))
            if since is not None and event.seq > since:
                return event
        raise FakeNvmlError("Timeout")

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> SimpleNamespace:  # noqa: N802
        self._check(gpu, "pci_info")
        return SimpleNamespace(busId=gpu.pci_bus_id)

    def nvmlEventSetFree(self, _set: Any) -> None:  # noqa: N802
        return None


def fake_nvml_from_spec(path: Path, node: str) -> FakeNvml:
    """A FakeNvml for ``node`` from a JSON spec ``{"default": {"gpus": 8}, "nodes": {"node3":
    {"faults": {"2": {"ecc_uncorrected_volatile": 3}}}}}``: ``gpus`` GPUs with FakeGpu
    defaults, then per-GPU fields overridden by ``faults``. XIDs of earlier jobs are not NVML
    events a new process can see: write them as kernel log lines (``health.kmsg_path``)."""
    spec = json.loads(path.read_text())
    entry = {**spec.get("default", {}), **spec.get("nodes", {}).get(node, {})}
    gpus = [FakeGpu(uuid=f"GPU-{node}-{i}") for i in range(int(entry.get("gpus", 8)))]
    for index, fields in entry.get("faults", {}).items():
        for name, value in fields.items():
            if not hasattr(gpus[int(index)], name):
                raise ValueError(f"{path}: unknown fake GPU field {name!r}")
            setattr(gpus[int(index)], name, value)
    return FakeNvml(gpus, fail_init=bool(entry.get("fail_init", False)))
