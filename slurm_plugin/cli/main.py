"""Entry point of the ``straggler`` command: global options, settings, logging, subcommands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import redis
import structlog
from pydantic import BaseModel

from slurm_plugin._version import __version__
from slurm_plugin.cli.admin import COMMANDS as ADMIN_COMMANDS
from slurm_plugin.cli.advice import COMMANDS as ADVICE_COMMANDS
from slurm_plugin.cli.backtest import backtest
from slurm_plugin.cli.demo import demo
from slurm_plugin.cli.devcluster import devcluster
from slurm_plugin.cli.output import emit_json, emit_table
from slurm_plugin.cli.telemetry import export, relay, sidecar
from slurm_plugin.config import Settings, load_settings, redact_url, resolve_config_path
from slurm_plugin.errors import StragglerError
from slurm_plugin.logging import configure_logging

log = structlog.get_logger(__name__)


class _Group(click.Group):
    """Turns every error into one clear line with a hint and a non-zero exit, never a
    traceback (``--log-level debug`` logs it)."""

    def main(  # type: ignore[override]
        self, args: list[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> Any:
        """click's usage errors (an unknown option, a missing argument, an unreadable
        ``--config``) on one line too, with the command's --help as the hint."""
        if not extra.pop("standalone_mode", True):
            return super().main(args, prog_name, standalone_mode=False, **extra)
        try:
            value = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help
                exc.show()
                sys.exit(exc.exit_code)
            where = exc.ctx.command_path if exc.ctx else "straggler"
            _fail(f"error: {_one_line(exc.format_message())} (hint: {where} --help)", 2)
        except click.ClickException as exc:
            _fail(f"error: {_one_line(exc.format_message())}", exc.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        sys.exit(value if isinstance(value, int) else 0)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, BrokenPipeError):
            raise
        except StragglerError as exc:
            _fail(f"error: {exc}", 2)
        except redis.RedisError as exc:
            url = ctx.obj.redis.url if isinstance(ctx.obj, Settings) else "(unknown)"
            _fail(
                f"error: Redis at {redact_url(url)} failed: {_one_line(exc)} (hint: check "
                "redis.url / STRAGGLER_REDIS_URL and that redis-server is running)",
                3,
            )
        except Exception as exc:  # the CLI boundary: one line, never a traceback
            log.debug("cli.unexpected_error", exc_info=True)
            _fail(
                f"error: unexpected {type(exc).__name__}: {_one_line(exc)} (hint: "
                "--log-level debug logs the traceback; please report it)",
                1,
            )
        return None


def _one_line(exc: BaseException | str) -> str:
    """An exception's message (or a text) on one printable line, at most 300 characters."""
    text = " ".join(str(exc).split())
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


def _fail(line: str, code: int) -> None:
    click.echo(line, err=True)
    sys.exit(code)


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
    values["redis"]["url"] = redact_url(values["redis"]["url"])  # never the admin password
    source = ctx.meta["config_path"]
    if as_json:
        emit_json({"config_file": str(source) if source else None, "settings": values})
        return
    click.echo(f"# config file: {source or '(none)'}")
    rows = []
    for name, info in Settings.model_fields.items():
        table = info.annotation
        if isinstance(table, type) and issubclass(table, BaseModel):  # [redis], [safety]...
            rows += [
                {
                    "setting": f"{name}.{key}",
                    "value": values[name][key],
                    "description": sub.description or "",
                }
                for key, sub in table.model_fields.items()
            ]
        else:
            rows.append(
                {"setting": name, "value": values[name], "description": info.description or ""}
            )
    emit_table(rows, ["setting", "value", "description"])


cli.add_command(backtest)
cli.add_command(demo)
cli.add_command(devcluster)
cli.add_command(export)
cli.add_command(sidecar)
cli.add_command(relay)
for _command in [*ADMIN_COMMANDS, *ADVICE_COMMANDS]:
    cli.add_command(_command)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="straggler")


if __name__ == "__main__":
    main()
