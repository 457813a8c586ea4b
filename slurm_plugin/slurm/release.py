"""Which Slurm release answers, and what that release can do: the one place where release
differences are decided (detected from ``scontrol --version``).

Release facts that need no switch are handled everywhere: 24.11 keeps a node's Reason for 20 s
or more after RESUME, so "drained" is read from state flags only (``NodeInfo.drained``).
Parsers that can tell a shape from the document itself (``sinfo --json`` groups nodes under
``"sinfo"`` from 23.02 on, numbers become ``{set, infinite, number}`` objects) do so; what cannot be
seen in a document (which commands exist) is asked of :class:`SlurmRelease`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_plugin.errors import SlurmError

# Releases whose output the adapter was run against on a real cluster (make test-releases and
# ../shared/slurm-outputs): 22.05.8 (Debian 12), 24.11.5 (Debian 13), 26.05.5 (Debian sid).
TESTED = ("22.05", "24.11", "26.05")

_VERSION = re.compile(r"\b(\d{2})\.(\d{2})(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class SlurmRelease:
    """A Slurm release (``24.11.5`` -> major 24, minor 11, micro 5)."""

    major: int
    minor: int
    micro: int = 0

    @property
    def series(self) -> str:
        """``24.11``: the release series, as Slurm names it."""
        return f"{self.major:02d}.{self.minor:02d}"

    def __str__(self) -> str:
        return f"{self.series}.{self.micro}"

    @property
    def tested(self) -> bool:
        """A series this project runs its tests against."""
        return self.series in TESTED

    @property
    def scontrol_json(self) -> bool:
        """``scontrol show job J --json`` exists (from 23.02 on; 22.05 rejects ``--json``)."""
        return (self.major, self.minor) >= (23, 2)

    @property
    def cgroup_plugin_disabled(self) -> bool:
        """``CgroupPlugin=disabled`` is accepted in cgroup.conf (22.05 rejects the value)."""
        return (self.major, self.minor) >= (23, 2)

    @property
    def run_ids(self) -> bool:
        """Every run of a job has its unique id, SLUID (25.11 on): in ``squeue --json`` and
        the prolog's and job's environment (``SLURM_JOB_SLUID``); a requeue makes a new run.
        The parsers read it where a document has it; this says whether one must be there."""
        return (self.major, self.minor) >= (25, 11)

    @property
    def requeue_delay(self) -> bool:
        """``SchedulerParameters=requeue_delay=SECONDS`` exists (25.11 on): how long a requeued
        job waits before it may start again. Earlier releases wait for the job credential to
        expire (``AuthInfo=cred_expire``, 120 s by default), which is most of an eviction's
        cost."""
        return (self.major, self.minor) >= (25, 11)


def parse_version(text: str) -> SlurmRelease:
    """``slurm 22.05.8`` / ``slurm-wlm 24.11.5`` (``scontrol --version``) -> a release."""
    match = _VERSION.search(text)
    if match is None:
        raise SlurmError(f"cannot read a Slurm version from {text.strip()[:60]!r}")
    return SlurmRelease(int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))
