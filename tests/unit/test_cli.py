"""The CLI shell: version, settings display, clean errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from slurm_plugin import __version__
from slurm_plugin.cli.main import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in ("STRAGGLER_CONFIG", "STRAGGLER_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    return CliRunner()


def test_version(runner: CliRunner) -> None:
    """--version prints the package version."""
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_config_show_json_reports_file_and_values(runner: CliRunner, tmp_path: Path) -> None:
    """`config show --json` prints the effective values and which file they came from."""
    path = tmp_path / "c.toml"
    path.write_text('[redis]\nurl = "redis://cfg:7/1"\n')
    result = runner.invoke(cli, ["--config", str(path), "config", "show", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config_file"] == str(path)
    assert data["settings"]["redis"]["url"] == "redis://cfg:7/1"


def test_config_show_table(runner: CliRunner) -> None:
    """The human form lists every setting with its description."""
    result = runner.invoke(cli, ["config", "show"])
    assert result.exit_code == 0
    assert "redis.url" in result.output
    assert "health.budget_s" in result.output
    assert "safety.max_evictions_per_hour" in result.output
    assert "Timeout for any one Slurm command" in result.output


def test_config_typo_is_one_clear_line(runner: CliRunner, tmp_path: Path) -> None:
    """A settings typo exits 2 with one line naming the key and file, no traceback."""
    path = tmp_path / "c.toml"
    path.write_text("comand_timeout_s = 5\n")
    result = runner.invoke(cli, ["--config", str(path), "config", "show"])
    assert result.exit_code == 2
    assert "comand_timeout_s" in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.output


def _leaves(
    command: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, click.Command]]:
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _leaves(sub, (*path, name))
    else:
        yield " ".join(path), command


def test_every_command_has_json() -> None:
    """Issue 18: `--json` on every command of the click tree."""
    missing = [
        path
        for path, command in _leaves(cli)
        if not any("--json" in p.opts for p in command.params if isinstance(p, click.Option))
    ]
    assert missing == []


def test_json_of_commands_that_need_no_service(runner: CliRunner) -> None:
    """Commands that touch neither Redis nor Slurm print typed JSON with --json."""
    validated = runner.invoke(
        cli, ["policy", "validate", str(REPO / "policies" / "evict.toml"), "--json"]
    )
    assert validated.exit_code == 0, validated.output
    data = json.loads(validated.output)
    assert data["valid"] is True
    assert data["policy"]["actions"]["max_requeues"] == 2
    options = json.loads(runner.invoke(cli, ["sbatch-options", "--json"]).output)
    assert "--straggler-policy" in options["options"]


@pytest.mark.parametrize(
    ("value", "reason"),
    [("0", "more than 0"), ("99999999999999999999d", "at most 3650d"), ("soon", "duration")],
)
def test_durations_are_bounded(runner: CliRunner, value: str, reason: str) -> None:
    """`pause --for` and `audit --since` refuse zero, absurd and unreadable durations in one
    usage error, before anything reaches Redis."""
    for args in (["pause", "--for", value], ["audit", "--since", value]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2, result.output
        assert reason in result.output
        assert "Traceback" not in result.output


def test_environment_and_file_errors_are_one_line(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An infinite timeout, a list that is not JSON and a non-UTF-8 file each give one line
    naming the variable or the file."""
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'description = "\xff"\n')
    cases = [
        ({"STRAGGLER_REDIS_TIMEOUT_S": "inf"}, ["status"], "STRAGGLER_REDIS_TIMEOUT_S"),
        ({"STRAGGLER_HEALTH_CRITICAL_XIDS": "1,2"}, ["status"], "HEALTH_CRITICAL_XIDS"),
        ({}, ["--config", str(bad), "status"], "not UTF-8"),
        ({}, ["policy", "validate", str(bad)], "not UTF-8"),
    ]
    for env, args, expected in cases:
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            result = runner.invoke(cli, args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2, result.output
        assert len(lines) == 1, lines
        assert expected in lines[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["jobs", "--bogus"], "No such option '--bogus'. (hint: straggler jobs --help)"),
        (["policy", "show"], "Missing argument 'NAME'. (hint: straggler policy show --help)"),
        (["pause", "--for"], "Option '--for' requires an argument."),
        (["no-such-command"], "No such command 'no-such-command'."),
    ],
)
def test_usage_errors_are_one_line_with_a_hint(
    runner: CliRunner, argv: list[str], says: str
) -> None:
    """click's own usage errors follow the house rule too: one line, a hint, exit 2."""
    result = runner.invoke(cli, argv, prog_name="straggler")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"error: {says}"), line
    assert "(hint: straggler" in line


def test_a_closed_pipe_is_not_an_error(tmp_path: Path) -> None:
    """`straggler config show | head -1`: the reader went away; no 'unexpected' error line."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_plugin.cli.main", "config", "show"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    proc.wait(timeout=30)
    assert "unexpected" not in err, err
