"""CPU signals of a node: pressure stall information and cgroup CPU throttling.

The filesystem root is injectable so tests can build the files; absent files mean the kernel
does not expose the signal, and the value is None.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CpuSample:
    """CPU pressure (share of time some task waited for a CPU) and cgroup throttling."""

    pressure_some_avg10: float | None
    pressure_some_total_us: int | None
    cgroup_nr_throttled: int | None
    cgroup_throttled_us: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _pressure(text: str | None) -> tuple[float | None, int | None]:
    if text is None:
        return None, None
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            try:
                return float(fields["avg10"]), int(fields["total"])
            except (KeyError, ValueError):
                return None, None
    return None, None


def _cgroup_stat(root: Path) -> tuple[int | None, int | None]:
    # cgroup v2: cpu.stat has nr_throttled and throttled_usec.
    # cgroup v1: cpu/cpu.stat has nr_throttled and throttled_time (ns).
    for path, time_key, to_us in (
        (root / "sys/fs/cgroup/cpu.stat", "throttled_usec", 1),
        (root / "sys/fs/cgroup/cpu/cpu.stat", "throttled_time", 1000),
    ):
        text = _read(path)
        if text is None:
            continue
        values = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                values[parts[0]] = int(parts[1])
        if "nr_throttled" in values:
            throttled = values.get(time_key)
            return values["nr_throttled"], None if throttled is None else throttled // to_us
    return None, None


def sample_cpu(root: Path = Path("/")) -> CpuSample:
    """Read the CPU signals under ``root``."""
    avg10, total = _pressure(_read(root / "proc/pressure/cpu"))
    nr_throttled, throttled_us = _cgroup_stat(root)
    return CpuSample(avg10, total, nr_throttled, throttled_us)
