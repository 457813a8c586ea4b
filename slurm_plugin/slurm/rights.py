"""Whether this process may do what the service does to Slurm, asked once at start-up.

Evicting needs a job's AdminComment (our mark) and draining needs a node's state: both are a
Slurm administrator's (root, ``SlurmUser``, or ``AdminLevel=Admin`` in accounting). Operator
may requeue but neither, so a service that is not an administrator would find out at its
first straggler; it says so when it starts instead (docs/deploy.md, The service account).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping

from slurm_plugin.errors import CommandError
from slurm_plugin.slurm.runner import run_command

#: What ``sacctmgr show user`` prints for an administrator.
ADMINISTRATOR = "Administrator"


def administrator(
    scontrol: str, sacctmgr: str, env: Mapping[str, str], timeout_s: float = 10.0
) -> tuple[bool | None, str]:
    """(True, who) when this process is a Slurm administrator, (False, why) when Slurm says
    it is not, (None, why) when it cannot tell (no accounting, Slurm not answering)."""
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    if uid == 0:
        return True, "root"
    try:
        config = run_command([scontrol, "show", "config"], timeout_s=timeout_s, env=env).stdout
    except CommandError as exc:
        return None, f"scontrol show config: {exc}"
    slurm_user = next(
        (
            line.split("=", 1)[1].strip()
            for line in config.splitlines()
            if line.startswith("SlurmUser")
        ),
        "",
    )
    if slurm_user.split("(")[0] == name:
        return True, f"{name} is SlurmUser"
    try:
        level = run_command(
            [sacctmgr, "-n", "-P", "show", "user", name, "format=adminlevel"],
            timeout_s=timeout_s,
            env=env,
        ).stdout.strip()
    except CommandError as exc:
        return None, f"{name}: no AdminLevel from accounting ({exc})"
    if level == ADMINISTRATOR:
        return True, f"{name} has AdminLevel=Admin"
    return False, f"{name} has AdminLevel={level or 'None'}"
