"""Entry point of the ``straggler`` command: global options, settings, logging, subcommands."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from slurm_plugin._version import __version__
from slurm_plugin.cli.admin import COMMANDS as ADMIN_COMMANDS
from slurm_plugin.cli.backtest import backtest
from slurm_plugin.cli.demo import demo
from slurm_plugin.cli.devcluster import devcluster
from slurm_plugin.cli.output import emit_json, emit_table
from slurm_plugin.cli.telemetry import export, sidecar
from slurm_plugin.config import Settings, load_settings, redact_url, resolve_config_path
from slurm_plugin.errors import StragglerError
from slurm_plugin.logging import configure_logging


class _Group(click.Group):
    """Turns our own errors into one clear line and exit status 2, never a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except StragglerError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="straggler")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="STRAGGLER_CONFIG",
    help="Settings file (TOML). Default: $STRAGGLER_CONFIG, else /etc/slurm-straggler/config.toml.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="warning",
    show_default=True,
    help="Log level (logs go to stderr: JSON lines, or readable text on a terminal).",
)
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, log_level: str) -> None:
    """Straggler detection and eviction for GPU training jobs on Slurm."""
    configure_logging(log_level)
    ctx.meta["config_path"] = resolve_config_path(config_path)
    ctx.obj = load_settings(config_path)


@cli.group()
def config() -> None:
    """Inspect the effective settings."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Print every setting with its effective value and the file it was read from."""
    settings: Settings = ctx.obj
    values = settings.model_dump(mode="json")
    values["redis_url"] = redact_url(values["redis_url"])  # never print the admin password
    source = ctx.meta["config_path"]
    if as_json:
        emit_json({"config_file": str(source) if source else None, "settings": values})
        return
    click.echo(f"# config file: {source or '(none)'}")
    emit_table(
        [
            {"setting": name, "value": values[name], "description": info.description or ""}
            for name, info in Settings.model_fields.items()
        ],
        ["setting", "value", "description"],
    )


cli.add_command(backtest)
cli.add_command(demo)
cli.add_command(devcluster)
cli.add_command(export)
cli.add_command(sidecar)
for _command in ADMIN_COMMANDS:
    cli.add_command(_command)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="straggler")


if __name__ == "__main__":
    main()
