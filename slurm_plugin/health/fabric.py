"""InfiniBand/RoCE ports from sysfs (root injectable). Probes only: findings come from checks.

Each port under ``<root>/sys/class/infiniband/<hca>/ports/<n>/`` is read; a missing or garbled
file is recorded as such (the checks turn it into a finding) rather than raising.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

COUNTERS = (
    "link_downed",
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "excessive_buffer_overrun_errors",
)
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


@dataclass(frozen=True)
class PortSample:
    """One port's facts; ``problems`` lists files that could not be read or parsed."""

    hca: str
    port: str
    state: str | None
    phys_state: str | None
    rate_gbps: float | None
    counters: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``hca/port``."""
        return f"{self.hca}/{self.port}"


def _text(path: Path, problems: list[str]) -> str | None:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        problems.append(f"{path.name}: unreadable ({exc.strerror or exc})")
        return None
    if not value:
        problems.append(f"{path.name}: empty")
        return None
    return value


def _state(text: str | None) -> str | None:
    # "4: ACTIVE" -> "ACTIVE"; "5: LinkUp" -> "LinkUp"
    return None if text is None else text.split(":", 1)[-1].strip()


def read_ports(root: Path = Path("/")) -> list[PortSample]:
    """Every port of every HCA under ``root`` (sorted)."""
    base = root / "sys/class/infiniband"
    samples = []
    for port_dir in sorted(base.glob("*/ports/*")):
        problems: list[str] = []
        rate_text = _text(port_dir / "rate", problems)
        match = _RATE.match(rate_text) if rate_text else None
        if rate_text and not match:
            problems.append(f"rate: cannot parse {rate_text[:40]!r}")
        counters = {}
        for name in COUNTERS:
            text = _text(port_dir / "counters" / name, problems)
            if text is None:
                continue
            if text.isdigit():
                counters[name] = int(text)
            else:
                problems.append(f"{name}: not a number {text[:20]!r}")
        samples.append(
            PortSample(
                hca=port_dir.parent.parent.name,
                port=port_dir.name,
                state=_state(_text(port_dir / "state", problems)),
                phys_state=_state(_text(port_dir / "phys_state", problems)),
                rate_gbps=float(match.group(1)) if match else None,
                counters=counters,
                problems=problems,
            )
        )
    return samples


def count_hcas(root: Path = Path("/")) -> int:
    """HCAs under ``root``."""
    base = root / "sys/class/infiniband"
    return sum(1 for p in base.iterdir() if p.is_dir()) if base.is_dir() else 0
