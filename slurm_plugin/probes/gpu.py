"""GPU probe over NVML. pynvml is imported lazily; any object with the same functions works
(``slurm_plugin.probes.fake_nvml.FakeNvml`` is one), so the decoding below is tested without a GPU.

Probes gather facts only; judging them is for the checks and the detector.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any

from slurm_plugin.errors import StragglerError

# NVML clock-event ("throttle") reason bits, from nvml.h.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
NVML_NVLINK_MAX_LINKS = 18
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


class NvmlUnavailableError(StragglerError):
    """NVML (the driver library or the pynvml module) is not usable on this node."""


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the reason bits set in ``mask`` (unknown bits as ``bit_0x...``)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    bit = 1
    while unknown:
        if unknown & bit:
            names.append(f"bit_{bit:#x}")
            unknown &= ~bit
        bit <<= 1
    return names


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. Fields are None where the driver does not support them."""

    index: int
    uuid: str
    name: str
    sm_clock_mhz: int | None
    sm_clock_max_mhz: int | None
    throttle_reasons: list[str] = field(default_factory=list)
    temperature_c: int | None = None
    power_w: float | None = None
    ecc_uncorrected_volatile: int | None = None
    pcie_replay_count: int | None = None
    xids: list[int] = field(default_factory=list)
    sm_clock_default_mhz: int | None = None
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlinks_up: int | None = None
    nvlinks_down: int | None = None
    recovery_action: int | None = None
    pci_bus_id: str = ""  # NVML's "00000000:3B:00.0": matches the kernel log's XID lines

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


class NvmlProbe:
    """Reads GPU facts through an NVML binding (default: the ``pynvml`` module)."""

    def __init__(self, nvml: Any | None = None) -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailableError(
                    "pynvml is not installed (pip install 'slurm-straggler[nvml]')"
                ) from exc
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailableError(f"NVML init failed: {exc}") from exc
        self._handles = [
            nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
        ]
        self._events = self._register_xid_events()

    def _register_xid_events(self) -> Any | None:
        try:
            event_set = self._nvml.nvmlEventSetCreate()
            for handle in self._handles:
                self._nvml.nvmlDeviceRegisterEvents(
                    handle, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, event_set
                )
        except Exception:  # noqa: BLE001 - XID events are optional (not all GPUs support them)
            return None
        return event_set

    @property
    def count(self) -> int:
        """Number of GPUs NVML sees."""
        return len(self._handles)

    def _maybe(self, fn_name: str, *args: Any) -> Any:
        try:
            return getattr(self._nvml, fn_name)(*args)
        except Exception:  # noqa: BLE001 - "not supported" on this GPU: report None
            return None

    def _drain_xids(self) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        if self._events is None:
            return found
        for _ in range(64):  # bounded: never spin on a flood of events
            try:
                data = self._nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # noqa: BLE001 - NVMLError_Timeout means "no more events"
                break
            index = next((i for i, h in enumerate(self._handles) if h is data.device), -1)
            found.setdefault(index, []).append(int(data.eventData))
        return found

    def sample(self) -> list[GpuSample]:
        """One sample per GPU, with the XID events that arrived since the last call."""
        xids = self._drain_xids()
        samples = []
        for index, handle in enumerate(self._handles):
            reasons = self._maybe("nvmlDeviceGetCurrentClocksEventReasons", handle)
            if reasons is None:
                reasons = self._maybe("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
            power_mw = self._maybe("nvmlDeviceGetPowerUsage", handle)
            uuid = self._maybe("nvmlDeviceGetUUID", handle)
            name = self._maybe("nvmlDeviceGetName", handle)
            pci = self._maybe("nvmlDeviceGetPciInfo", handle)
            samples.append(
                GpuSample(
                    index=index,
                    uuid=_text(uuid),
                    name=_text(name),
                    sm_clock_mhz=self._maybe("nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM),
                    sm_clock_max_mhz=self._maybe(
                        "nvmlDeviceGetMaxClockInfo", handle, NVML_CLOCK_SM
                    ),
                    throttle_reasons=decode_throttle_reasons(int(reasons)) if reasons else [],
                    temperature_c=self._maybe(
                        "nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU
                    ),
                    power_w=None if power_mw is None else power_mw / 1000.0,
                    ecc_uncorrected_volatile=self._maybe(
                        "nvmlDeviceGetTotalEccErrors",
                        handle,
                        NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        NVML_VOLATILE_ECC,
                    ),
                    pcie_replay_count=self._maybe("nvmlDeviceGetPcieReplayCounter", handle),
                    xids=xids.get(index, []),
                    sm_clock_default_mhz=self._maybe(
                        "nvmlDeviceGetDefaultApplicationsClock", handle, NVML_CLOCK_SM
                    ),
                    **self._memory_health(handle),
                    **self._links(handle),
                    pci_bus_id=_text(getattr(pci, "busId", "")) if pci is not None else "",
                )
            )
        return samples

    def _memory_health(self, handle: Any) -> dict[str, Any]:
        pending = self._maybe("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        remap = self._maybe("nvmlDeviceGetRemappedRows", handle)  # (corr, unc, pending, failed)
        return {
            "recovery_action": self._recovery_action(handle),
            "retired_pages_pending": None if pending is None else bool(pending),
            "remap_pending": None if remap is None else bool(remap[2]),
            "remap_failed": None if remap is None else bool(remap[3]),
        }

    def _recovery_action(self, handle: Any) -> int | None:
        """The driver's recommended recovery action (NVML field 230), where supported."""
        values = self._maybe(
            "nvmlDeviceGetFieldValues", handle, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        )
        if not values or getattr(values[0], "nvmlReturn", 1) != 0:
            return None
        return int(values[0].value.uiVal)

    def _links(self, handle: Any) -> dict[str, Any]:
        states = [
            self._maybe("nvmlDeviceGetNvLinkState", handle, link)
            for link in range(NVML_NVLINK_MAX_LINKS)
        ]
        known = [s for s in states if s is not None]
        return {
            "pcie_gen": self._maybe("nvmlDeviceGetCurrPcieLinkGeneration", handle),
            "pcie_gen_max": self._maybe("nvmlDeviceGetMaxPcieLinkGeneration", handle),
            "pcie_width": self._maybe("nvmlDeviceGetCurrPcieLinkWidth", handle),
            "pcie_width_max": self._maybe("nvmlDeviceGetMaxPcieLinkWidth", handle),
            "nvlinks_up": sum(1 for s in known if s) if known else None,
            "nvlinks_down": sum(1 for s in known if not s) if known else None,
        }

    def close(self) -> None:
        """Release NVML."""
        if self._events is not None:
            self._maybe("nvmlEventSetFree", self._events)
        self._maybe("nvmlShutdown")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
