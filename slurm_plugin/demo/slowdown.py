"""Make one dev-cluster node really slow: a cgroup CPU quota on its slurmd and children.

Every process in the node's UTS namespace (slurmd, slurmstepd, the job's ranks) moves into a
cgroup with a CPU quota; processes they fork later inherit it. cgroup v1 (``cpu.cfs_quota_us``)
or v2 (``cpu.max``), whichever the machine has.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from slurm_plugin.devcluster import procs
from slurm_plugin.errors import DevClusterError

NAME = "slurm-straggler-demo"
PERIOD_US = 100_000


class CpuQuota:
    """A CPU quota on every process of one dev-cluster node."""

    def __init__(
        self, run_dir: Path, node: str, percent: float, cgroup_root: Path = Path("/sys/fs/cgroup")
    ) -> None:
        self.namespace_file = run_dir / f"slurmd-{node}.uts"
        self.percent = percent
        v1 = cgroup_root / "cpu"
        if (v1 / "cpu.cfs_quota_us").exists():
            self.group, self.v2 = v1 / NAME, False
            self.parent = v1
        elif (cgroup_root / "cgroup.controllers").exists():
            self.group, self.v2 = cgroup_root / NAME, True
            self.parent = cgroup_root
        else:
            raise DevClusterError(f"no cgroup CPU controller under {cgroup_root}")

    def apply(self) -> int:
        """Limit the node; returns how many processes were moved."""
        try:
            namespace = self.namespace_file.read_text().strip()
        except OSError as exc:
            raise DevClusterError(f"node namespace unknown: {exc}") from exc
        self.group.mkdir(exist_ok=True)
        quota = int(PERIOD_US * self.percent / 100)
        if self.v2:
            (self.group / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        else:
            (self.group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (self.group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        moved = 0
        for pid in procs.pids_in_namespaces([namespace]):
            with contextlib.suppress(OSError):  # a process may exit meanwhile
                (self.group / "cgroup.procs").write_text(f"{pid}\n")
                moved += 1
        return moved

    def remove(self) -> None:
        """Move everything back and delete the group."""
        if not self.group.exists():
            return
        with contextlib.suppress(OSError):
            for line in (self.group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.parent / "cgroup.procs").write_text(f"{line}\n")
        with contextlib.suppress(OSError):
            self.group.rmdir()
