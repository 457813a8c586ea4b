"""``straggler policy``: list, show, validate, apply, revert and diff policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from slurm_plugin.cli.common import audit_action, done, json_option
from slurm_plugin.cli.output import emit_json, emit_rows, printable
from slurm_plugin.config import Settings
from slurm_plugin.errors import ConfigError, StragglerError
from slurm_plugin.policy.loader import active_policies, load_policy
from slurm_plugin.service.factory import build
from slurm_plugin.tomlfile import read_toml


@click.group("policy")
def policy() -> None:
    """Inspect and validate policies."""


@policy.command("list")
@json_option
@click.pass_obj
def policy_list(settings: Settings, as_json: bool) -> None:
    """The active policies: the policy directory's, overridden by applied ones."""
    _, state, _ = build(settings)
    applied = state.applied_policies()
    policies, problems = active_policies(settings.service.policy_dir, applied)
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    rows = [
        {
            "name": p.name,
            "mode": p.actions.mode,
            "min_slowdown_pct": p.detection.min_slowdown_pct,
            "default": p.name == settings.service.default_policy,
            "source": "applied" if p.name in applied else "file",
            "description": p.description,
        }
        for p in policies.values()
    ]
    emit_rows(
        rows,
        ["name", "mode", "min_slowdown_pct", "default", "source", "description"],
        as_json=as_json,
    )


@policy.command("show")
@click.argument("name")
@json_option
@click.pass_obj
def policy_show(settings: Settings, name: str, as_json: bool) -> None:
    """One active policy with every field, as JSON (always; --json is accepted)."""
    _, state, _ = build(settings)
    policies, _problems = active_policies(settings.service.policy_dir, state.applied_policies())
    if name not in policies:
        raise StragglerError(
            f"no policy {printable(name[:64])!r}; have {', '.join(sorted(policies))}"
        )
    emit_json(policies[name].model_dump())


@policy.command("validate")
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@json_option
def policy_validate(path: Path, as_json: bool) -> None:
    """Check a policy file; exit 2 with the field and file on error."""
    loaded = load_policy(path)
    message = f"{path}: policy {loaded.name!r} is valid (mode {loaded.actions.mode})"
    done(as_json, message, valid=True, policy=loaded.model_dump())


@policy.command("apply")
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--name",
    "as_name",
    help="The policy this file replaces, when the file's name and its `name =` disagree.",
)
@click.option("--yes", is_flag=True, help="Replace an active policy the file changes.")
@json_option
@click.pass_obj
def policy_apply(
    settings: Settings, path: Path, as_name: str | None, as_json: bool, yes: bool
) -> None:
    """Validate a policy file and make it active (overrides the file of the same name).
    Replacing an active policy shows what changes and needs --yes."""
    if not read_toml(path, "policy"):
        raise ConfigError("the policy file is empty: nothing to apply", path=path)
    loaded = load_policy(path)
    name = _target(path, loaded.name, as_name)
    loaded = loaded.model_copy(update={"name": name})
    _, state, _ = build(settings)
    policies, _problems = active_policies(settings.service.policy_dir, state.applied_policies())
    if name in policies:
        changes = _diff(policies[name].model_dump(), loaded.model_dump())
        for line in changes:
            click.echo(f"  {line}", err=True)
        if changes and not yes:
            raise StragglerError(
                f"policy {name!r} is active and this file changes {len(changes)} value(s), "
                "shown above (hint: check them, then run again with --yes)"
            )
    state.apply_policy(name, loaded.model_dump_json())
    audit_action(state, "policy_apply", policy=name)
    message = f"applied policy {name!r}; the service uses it from its next cycle"
    done(as_json, message, applied=name)


def _target(path: Path, declared: str, as_name: str | None) -> str:
    """The policy a file replaces: its ``name =`` when that is its file's name, else what
    ``--name`` says (one of the two); never silently the one inside the file."""
    if as_name is not None:
        if as_name not in {declared, path.stem}:
            raise StragglerError(
                f"--name {printable(as_name[:64])!r} is neither the file's name "
                f"({path.stem!r}) nor its name = ({declared!r})"
            )
        return as_name
    if declared != path.stem:
        raise StragglerError(
            f"{path.name} says name = {declared!r}: which policy does it replace? "
            f"(hint: --name {declared} or --name {path.stem})"
        )
    return declared


@policy.command("revert")
@click.argument("name")
@json_option
@click.pass_obj
def policy_revert(settings: Settings, name: str, as_json: bool) -> None:
    """Undo `policy apply NAME`: the policy file of that name counts again (if there is one)."""
    _, state, _ = build(settings)
    if not state.revert_policy(name):
        raise StragglerError(
            f"no applied policy {printable(name[:64])!r} (hint: `straggler policy list` shows "
            "source=applied for those)"
        )
    audit_action(state, "policy_revert", policy=name)
    message = f"reverted policy {name!r}; the service uses the file's from its next cycle"
    done(as_json, message, reverted=name)


@policy.command("diff")
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@json_option
@click.pass_obj
def policy_diff(settings: Settings, path: Path, as_json: bool) -> None:
    """What a policy file would change against the active policy of the same name."""
    new = load_policy(path)
    _, state, _ = build(settings)
    policies, _problems = active_policies(settings.service.policy_dir, state.applied_policies())
    current = policies[new.name].model_dump() if new.name in policies else None
    changes = _diff(current, new.model_dump()) if current is not None else []
    if as_json:
        emit_json({"policy": new.name, "new": current is None, "changes": changes})
        return
    for line in [f"{new.name}: new policy"] if current is None else changes or ["no changes"]:
        click.echo(line)


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines
