"""Reading the TOML files an admin writes (settings, policies) and saying what is wrong with
them: one reader and one description of a validation error, for every file we read."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from slurm_plugin.errors import ConfigError


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The table of a TOML file; :class:`ConfigError` naming ``path`` when it cannot be read
    or is not TOML (``what`` says which file it is: "settings file", "policy")."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} not found", path=path) from exc
    except PermissionError as exc:
        raise ConfigError(f"{what} is not readable", path=path) from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{what} is a directory", path=path) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror}", path=path) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", path=path) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from exc


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """Every problem of a validation error on one line (``unknown setting 'x'``,
    ``field: message``) and the dotted name of the first field."""
    problems = []
    first = None
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        first = first or where or None
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown setting {where!r}")
        else:
            problems.append(f"{where}: {message}" if where else message)  # a rule of several
    return "; ".join(problems), first
