"""Console scripts ``straggler-prolog`` and ``straggler-epilog``: fast start, exit code = verdict.

They import neither click nor redis nor pynvml at start-up, and leave with ``os._exit`` so a
hung NVML thread cannot keep the process alive past its verdict.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

#: syslog facility daemon (3) * 8 + severity: warning (4), error (3).
_PRIORITY = {"warning": 3 * 8 + 4, "error": 3 * 8 + 3}
_DEFAULT_SYSLOG = Path("/dev/log")


def to_syslog(kind: str, level: str, message: str, path: Path | None = _DEFAULT_SYSLOG) -> None:
    """One line to the local syslog socket (journald or rsyslog; RFC 3164 form), so that the
    admin sees what a passing prolog or epilog warned about: slurmd keeps only a failing one's
    output. Best effort: no socket, no line, never an error."""
    if path is None:
        return
    line = f"<{_PRIORITY[level]}>straggler-{kind}[{os.getpid()}]: {message}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.5)
            sock.sendto(line.encode("utf-8", "replace")[:8000], str(path))
    except OSError:
        return


def run_hook(kind: str, nvml: Any = None) -> int:
    """The prolog or epilog (``kind``) as slurmd runs it; ``nvml`` (node -> NVML) replaces
    pynvml (the dev cluster's fake GPUs). Returns the exit code: 0 pass, 1 fail."""
    try:
        from slurm_plugin.config import load_settings  # noqa: PLC0415
        from slurm_plugin.logging import configure_logging  # noqa: PLC0415

        configure_logging("info", json=True)
        settings = load_settings()
    except Exception as exc:  # noqa: BLE001 - a broken config is our problem: fail open
        message = f"configuration problem, passing: {exc}"
        sys.stderr.write(f"straggler-{kind}: {message}\n")
        to_syslog(kind, "error", message)
        return 0
    import structlog  # noqa: PLC0415

    from slurm_plugin.health.hook import run_epilog, run_prolog  # noqa: PLC0415

    log = structlog.get_logger(f"straggler.{kind}")
    syslog = settings.health.syslog_socket
    try:
        result = (run_prolog if kind == "prolog" else run_epilog)(os.environ, settings, nvml)
    except Exception as exc:
        log.exception(f"{kind}.crashed")
        to_syslog(kind, "error", f"crashed, passing: {type(exc).__name__}: {exc}", syslog)
        return 0
    for problem in result.problems:
        log.error(f"{kind}.own_problem", problem=problem, node=result.node)
        to_syslog(kind, "error", f"job {result.job_id}: our problem, passing: {problem}", syslog)
    for finding in result.findings:
        if finding.severity != "drain":
            to_syslog(kind, "warning", f"job {result.job_id}: warning: {finding}", syslog)
    if result.exit_code:
        to_syslog(kind, "error", f"job {result.job_id}: fails: {result.summary()}", syslog)
    event = f"{kind}.{'fail' if result.exit_code else 'pass'}"
    log.info(
        event,
        node=result.node,
        job_id=result.job_id,
        exit_code=result.exit_code,
        elapsed_s=round(result.elapsed_s, 3),
        summary=result.summary(),
        findings=[str(f) for f in result.findings],
    )
    return result.exit_code


def prolog_main() -> None:
    """Entry point of ``straggler-prolog``."""
    sys.stdout.flush()
    code = run_hook("prolog")
    sys.stderr.flush()
    os._exit(code)


def epilog_main() -> None:
    """Entry point of ``straggler-epilog``."""
    code = run_hook("epilog")
    sys.stderr.flush()
    os._exit(code)
