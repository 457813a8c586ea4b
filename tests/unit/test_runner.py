"""The command runner: argv only, a timeout on every call, typed errors."""

from __future__ import annotations

import sys

import pytest

from slurm_plugin.errors import CommandError, CommandTimeoutError
from slurm_plugin.slurm.runner import run_command


def test_output_and_hostile_arguments_pass_verbatim() -> None:
    """Arguments reach the program unchanged: no shell ever interprets them."""
    hostile = "a; rm -rf / $(id) `x` 'q' \"d\""
    result = run_command(
        [sys.executable, "-c", "import sys; print(sys.argv[1])", hostile], timeout_s=10
    )
    assert result.stdout.strip() == hostile
    assert result.returncode == 0


def test_non_zero_exit_raises_with_stderr() -> None:
    """A failing command raises CommandError carrying the exit status and its last stderr line."""
    with pytest.raises(CommandError, match="exit 3: boom") as info:
        run_command(
            [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"],
            timeout_s=10,
        )
    assert info.value.returncode == 3


def test_check_false_returns_the_failure() -> None:
    """With check=False the caller gets the exit status instead of an exception."""
    result = run_command([sys.executable, "-c", "raise SystemExit(4)"], timeout_s=10, check=False)
    assert result.returncode == 4


def test_timeout() -> None:
    """A command that outlives its timeout raises CommandTimeoutError."""
    with pytest.raises(CommandTimeoutError, match=r"timed out after 0\.2 s"):
        run_command([sys.executable, "-c", "import time; time.sleep(5)"], timeout_s=0.2)


def test_missing_program() -> None:
    """A program that does not exist is a CommandError, not an OSError."""
    with pytest.raises(CommandError, match="cannot run"):
        run_command(["/nonexistent/scontrol"], timeout_s=1)
