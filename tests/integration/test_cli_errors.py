"""Every admin command when Redis is unreachable and when slurmctld is stopped: a non-zero exit
and at most three lines naming what failed, never a traceback (issue 18)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import click
import pytest

from slurm_plugin.cli.main import cli
from slurm_plugin.devcluster import DevCluster
from tests.integration.conftest import REPO, free_port, stop_slurmctld

# Every leaf command of the click tree that reads or writes Redis, with arguments.
REDIS_COMMANDS = {
    "status": [],
    "nodes": [],
    "node show": ["node1"],
    "node forgive": ["node1"],
    "node mark": ["node1", "--state", "ok"],
    "jobs": [],
    "job show": ["1"],
    "pause": ["--for", "1m"],
    "resume": [],
    "audit": [],
    "policy list": [],
    "policy show": ["observe"],
    "policy apply": [str(REPO / "policies" / "evict.toml")],
    "policy diff": [str(REPO / "policies" / "evict.toml")],
    "policy revert": ["evict"],
    "export": ["1"],
    "serve": ["--once"],
    "advice": ["1"],
}
# Every leaf command that asks Slurm.
SLURM_COMMANDS = ["jobs", "node show", "node forgive", "node mark", "serve"]
# Commands that touch neither (or run the dev cluster / a daemon of their own).
NEITHER = {
    "config show",
    "backtest",
    "policy validate",
    "sbatch-options",
    "demo",
    "devcluster up",
    "devcluster down",
    "devcluster status",
    "devcluster env",
    "sidecar",
    "relay",
}
# Commands that wait Redis out rather than fail (tested below): a node's launcher under
# leave-on-advice must never stop because Redis is away.
WAITS_REDIS_OUT = {"leave-on-advice"}


def _leaves(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[str]:
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _leaves(sub, (*path, name))
    else:
        yield " ".join(path)


def test_the_lists_cover_the_whole_command_tree() -> None:
    """A new command must say here whether it touches Redis (then it is tested below)."""
    assert set(_leaves(cli)) == set(REDIS_COMMANDS) | NEITHER | WAITS_REDIS_OUT


def test_leave_on_advice_runs_its_launcher_with_redis_away() -> None:
    """Redis refuses connections: the launcher still runs to its end and its status is the
    command's, with a warning at most and never a traceback."""
    env = {**os.environ, "STRAGGLER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    argv = ["leave-on-advice", "--job", "1", "--node", "node1", "--every", "0.2", "--"]
    launcher = [sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(4)"]
    result = subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli.main", *argv, *launcher],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 4, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "leave.advice_unread" in result.stderr


def _run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli.main", *command.split(), *REDIS_COMMANDS[command]],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _assert_one_line_failure(result: subprocess.CompletedProcess[str], what: str) -> None:
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0, lines
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert 1 <= len(lines) <= 3, lines
    assert what in lines[-1], lines


@pytest.mark.parametrize("command", sorted(REDIS_COMMANDS))
def test_redis_unreachable(cluster: DevCluster, command: str) -> None:
    """Redis refuses connections: each command says so on one line, exit 3."""
    env = {
        **os.environ,
        **cluster.env(),
        "STRAGGLER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "STRAGGLER_SERVICE_POLICY_DIR": str(REPO / "policies"),
    }
    result = _run(command, env)
    _assert_one_line_failure(result, "Redis at redis://127.0.0.1:")
    assert result.returncode == 3


@pytest.fixture(scope="module")
def without_slurmctld(cluster: DevCluster) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Each of SLURM_COMMANDS run once with slurmctld stopped (SIGTERM, as an admin's restart
    does), all at the same time: each waits ~10 s for Slurm's own retries, which need not
    add up. The cluster comes back afterwards."""
    env = {
        **os.environ,
        **cluster.env(),
        "STRAGGLER_SERVICE_POLICY_DIR": str(REPO / "policies"),
        "STRAGGLER_SLURM_COMMAND_TIMEOUT_S": "20",
    }
    stop_slurmctld(cluster)
    try:
        with ThreadPoolExecutor(len(SLURM_COMMANDS)) as pool:
            runs = pool.map(lambda command: _run(command, env), SLURM_COMMANDS)
            results = dict(zip(SLURM_COMMANDS, runs, strict=True))
        yield results
    finally:
        cluster.up()


@pytest.mark.parametrize("command", SLURM_COMMANDS)
def test_slurmctld_stopped(
    without_slurmctld: dict[str, subprocess.CompletedProcess[str]], command: str
) -> None:
    """slurmctld is away: the commands that ask Slurm fail on one line (Slurm's silence is
    never read as "no jobs" or "no such node") and change nothing."""
    result = without_slurmctld[command]
    _assert_one_line_failure(result, "error:")
    assert result.returncode == 2
