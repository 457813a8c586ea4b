"""Configuration text of the development cluster: what depends on the Slurm release, and the
prolog and epilog dispatchers."""

from __future__ import annotations

import shlex
from pathlib import Path

from slurm_plugin.slurm.release import SlurmRelease

#: Seconds a requeued job waits before it may run again (requeue_delay, or cred_expire).
REQUEUE_DELAY_S = 5


def requeue_settings(release: SlurmRelease) -> dict[str, str]:
    """How fast a requeued job may start again: ``requeue_delay`` where the release has it
    (25.11 on; the job credential keeps Slurm's default lifetime), else a short credential
    lifetime, the only lever older releases have (docs/deploy.md, Slurm)."""
    if release.requeue_delay:
        return {"cred_expire": "", "requeue_delay": f",requeue_delay={REQUEUE_DELAY_S}"}
    return {"cred_expire": f",cred_expire={REQUEUE_DELAY_S}", "requeue_delay": ""}


def hook_script(hook: str, target: Path | None, faults: Path) -> str:
    """The prolog or epilog dispatcher: fail when a fault was injected for this node, else
    exec ``target`` (or exit 0)."""
    quoted = shlex.quote(str(faults))
    run = f"exec {shlex.quote(str(target.resolve()))}" if target else "exit 0"
    return (
        "#!/bin/sh\n"
        f"# {hook} dispatcher of the slurm-straggler development cluster (generated).\n"
        f'if [ -e {quoted}/{hook}-fail-"$(hostname)" ]; then\n'
        f'  echo "devcluster: injected {hook} failure on $(hostname)" >&2\n'
        "  exit 1\n"
        "fi\n"
        f"{run}\n"
    )


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` unless ``path`` holds it already; True when it changed."""
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True
