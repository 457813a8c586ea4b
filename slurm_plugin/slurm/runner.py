"""Run external commands safely: argv lists only, a timeout on every call, errors typed."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_plugin.errors import CommandError, CommandTimeoutError


@dataclass(frozen=True)
class CommandResult:
    """What a finished command returned."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def run_command(
    argv: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    input_text: str | None = None,
) -> CommandResult:
    """Run ``argv`` (never through a shell) and return its output.

    Raises :class:`CommandTimeoutError` after ``timeout_s``, and :class:`CommandError` when the
    program is missing or, with ``check``, exits non-zero (the message carries its stderr).
    """
    if not argv:
        raise CommandError(argv, "empty command")
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(env) if env is not None else None,
            input=input_text,
            stdin=None if input_text is not None else subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandTimeoutError(argv, timeout_s) from exc
    except OSError as exc:
        raise CommandError(argv, f"cannot run: {exc.strerror or exc}") from exc
    result = CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise CommandError(
            argv,
            f"exit {proc.returncode}: {detail[-1] if detail else 'no output'}",
            returncode=proc.returncode,
        )
    return result
