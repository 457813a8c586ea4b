"""Verdicts over probe facts (pure). A finding with severity ``drain`` fails the prolog."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from slurm_plugin.health.fabric import COUNTERS, PortSample
from slurm_plugin.probes.gpu import RECOVERY_ACTIONS, GpuSample

Severity = Literal["drain", "warn"]
IDLE_THROTTLE = {
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
}


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth a warning) on this node."""

    check: str
    severity: Severity
    message: str
    device: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    def __str__(self) -> str:
        where = f"{self.device}: " if self.device else ""
        return f"{self.check}: {where}{self.message}"


@dataclass(frozen=True)
class GpuThresholds:
    """Limits from settings."""

    expected_count: int | None = None
    max_temp_c: int = 87
    min_sm_clock_max_mhz: int | None = None
    critical_xids: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


def check_gpus(samples: Sequence[GpuSample], t: GpuThresholds) -> list[Finding]:
    """Every GPU finding."""
    found: list[Finding] = []
    if t.expected_count is not None and len(samples) != t.expected_count:
        found.append(
            Finding("gpu_count", "drain", f"{len(samples)} of {t.expected_count} GPUs visible")
        )
    for g in samples:
        found += _memory_and_xids(g, t)
        found += _clocks_and_links(g, t)
    return found


def _memory_and_xids(g: GpuSample, t: GpuThresholds) -> list[Finding]:
    dev = f"gpu{g.index}"
    found: list[Finding] = []
    if g.ecc_uncorrected_volatile:
        found.append(
            Finding("ecc", "drain", f"{g.ecc_uncorrected_volatile} uncorrectable ECC errors", dev)
        )
    if g.retired_pages_pending:
        found.append(Finding("retired_pages", "drain", "page retirement pending", dev))
    if g.recovery_action:
        name = RECOVERY_ACTIONS.get(g.recovery_action, str(g.recovery_action))
        found.append(Finding("recovery_action", "drain", f"driver asks for {name}", dev))
    if g.remap_failed:
        found.append(Finding("row_remap", "drain", "row remapping failed", dev))
    elif g.remap_pending:
        found.append(Finding("row_remap", "drain", "row remapping pending (reset)", dev))
    bad = sorted({x for x in g.xids if x in t.critical_xids})
    if bad:
        found.append(Finding("xid", "drain", f"critical XID {bad}", dev))
    other = sorted({x for x in g.xids if x not in t.critical_xids})
    if other:
        found.append(Finding("xid", "warn", f"XID {other}", dev))
    return found


def _clocks_and_links(g: GpuSample, t: GpuThresholds) -> list[Finding]:
    dev = f"gpu{g.index}"
    found: list[Finding] = []
    throttled = sorted(IDLE_THROTTLE & set(g.throttle_reasons))
    if throttled:
        found.append(Finding("throttle", "drain", f"throttled at idle: {throttled}", dev))
    floor = t.min_sm_clock_max_mhz or g.sm_clock_default_mhz
    if g.sm_clock_max_mhz is not None and floor and g.sm_clock_max_mhz < floor:
        found.append(
            Finding(
                "sm_clock", "drain", f"max SM clock {g.sm_clock_max_mhz} MHz < {floor} MHz", dev
            )
        )
    if g.pcie_gen is not None and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max:
        found.append(Finding("pcie", "drain", f"PCIe gen {g.pcie_gen} of {g.pcie_gen_max}", dev))
    if g.pcie_width is not None and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
        found.append(Finding("pcie", "drain", f"PCIe x{g.pcie_width} of x{g.pcie_width_max}", dev))
    if g.nvlinks_down:
        found.append(Finding("nvlink", "drain", f"{g.nvlinks_down} NVLink links down", dev))
    if g.temperature_c is not None and g.temperature_c >= t.max_temp_c:
        found.append(
            Finding(
                "temperature", "drain", f"{g.temperature_c} C at idle (limit {t.max_temp_c})", dev
            )
        )
    return found


def check_fabric(
    ports: Sequence[PortSample],
    previous: dict[str, dict[str, int]],
    *,
    expected_hcas: int | None,
    hcas: int,
    expected_rate_gbps: float | None,
) -> list[Finding]:
    """Port state, rate and error counters (compared with the last check)."""
    found: list[Finding] = []
    if expected_hcas is not None and hcas != expected_hcas:
        found.append(Finding("hca_count", "drain", f"{hcas} of {expected_hcas} HCAs present"))
    for p in ports:
        for problem in p.problems:
            found.append(Finding("sysfs", "drain", problem, p.name))
        if p.state is not None and p.state != "ACTIVE":
            found.append(Finding("port_state", "drain", f"state {p.state}", p.name))
        if p.phys_state is not None and p.phys_state != "LinkUp":
            found.append(Finding("port_state", "drain", f"phys_state {p.phys_state}", p.name))
        if (
            expected_rate_gbps is not None
            and p.rate_gbps is not None
            and p.rate_gbps < expected_rate_gbps
        ):
            found.append(
                Finding(
                    "port_rate",
                    "drain",
                    f"{p.rate_gbps:g} Gb/s, expected {expected_rate_gbps:g}",
                    p.name,
                )
            )
        before = previous.get(p.name, {})
        for name in COUNTERS:
            now, then = p.counters.get(name), before.get(name)
            if now is not None and then is not None and now > then:
                severity: Severity = "drain" if name in {"link_downed", "symbol_error"} else "warn"
                found.append(Finding("port_errors", severity, f"{name} +{now - then}", p.name))
    return found


def verdict(findings: Sequence[Finding]) -> int:
    """The prolog's exit code: 1 when any finding drains, else 0."""
    return 1 if any(f.severity == "drain" for f in findings) else 0
