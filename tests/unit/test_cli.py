"""The CLI shell: version, settings display, clean errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_plugin import __version__
from slurm_plugin.cli.main import cli


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
    path.write_text('redis_url = "redis://cfg:7/1"\n')
    result = runner.invoke(cli, ["--config", str(path), "config", "show", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config_file"] == str(path)
    assert data["settings"]["redis_url"] == "redis://cfg:7/1"


def test_config_show_table(runner: CliRunner) -> None:
    """The human form lists every setting with its description."""
    result = runner.invoke(cli, ["config", "show"])
    assert result.exit_code == 0
    assert "redis_url" in result.output
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
