"""Read policy files; errors name the file and the field."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import ValidationError

from slurm_plugin.errors import ConfigError
from slurm_plugin.policy.schema import Policy


def load_policy(path: Path) -> Policy:
    """A validated :class:`Policy` from a TOML file (its name defaults to the file stem)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read policy: {exc.strerror}", path=path) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", path=path) from exc
    data.setdefault("name", path.stem)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            problems.append(
                f"unknown setting {where!r}"
                if error["type"] == "extra_forbidden"
                else f"{where}: {error['msg']}"
            )
        raise ConfigError(
            "; ".join(problems), path=path, field=".".join(str(p) for p in exc.errors()[0]["loc"])
        ) from exc
