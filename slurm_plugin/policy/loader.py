"""Read policy files; errors name the file and the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from slurm_plugin.errors import ConfigError
from slurm_plugin.policy.rails import rails_in
from slurm_plugin.policy.schema import Policy
from slurm_plugin.tomlfile import describe, read_toml


def load_policy(path: Path) -> Policy:
    """A validated :class:`Policy` from a TOML file (its name defaults to the file stem)."""
    data = read_toml(path, "policy")
    data.setdefault("name", path.stem)
    misplaced = rails_in(data)
    if misplaced:
        raise ConfigError(_rails_error(misplaced), path=path, field=misplaced[0].strip("[]"))
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        message, field = describe(exc)
        raise ConfigError(message, path=path, field=field) from exc


def _rails_error(misplaced: list[str]) -> str:
    return (
        f"{', '.join(misplaced)}: cluster-wide rails belong in the service's configuration "
        "(config.toml), not in a policy a job can pick; move them there"
    )


def load_policies(directory: Path) -> dict[str, Policy]:
    """Every ``*.toml`` policy of a directory by name; any invalid file is an error."""
    if not directory.is_dir():
        raise ConfigError("policy directory not found", path=directory)
    policies = {}
    for path in sorted(directory.glob("*.toml")):
        policy = load_policy(path)
        if policy.name != path.stem:  # gentle.toml saying name = "observe" replaced observe
            raise ConfigError(
                f"says name = {policy.name!r}; a policy file is named for its policy: rename "
                f"it {policy.name}.toml or drop the name",
                path=path,
                field="name",
            )
        policies[policy.name] = policy
    if not policies:
        raise ConfigError("no policy files (*.toml)", path=directory)
    return policies


def policy_from_comment(comment: str) -> str | None:
    """The policy a job chose with the ``--comment`` convention ``straggler:policy=NAME``."""
    for part in comment.replace(";", " ").replace(",", " ").split():
        if part.startswith("straggler:policy="):
            name = part.split("=", 1)[1].strip()
            return name or None
    return None


def active_policies(
    directory: Path, applied: dict[str, str]
) -> tuple[dict[str, Policy], list[str]]:
    """The files' policies overridden by the applied ones (JSON by name); also returns the
    problems with applied policies that had to be skipped."""
    policies = load_policies(directory)
    problems = []
    for name, raw in applied.items():
        try:
            data = json.loads(raw)
            misplaced = rails_in(data) if isinstance(data, dict) else []
            if not misplaced:
                policies[name] = Policy.model_validate(data)
        except ValueError as exc:
            problems.append(f"applied policy {name!r}: {exc}")
        else:
            if misplaced:  # applied before the rails became settings: skipped, never half-used
                problems.append(f"applied policy {name!r}: {_rails_error(misplaced)}")
    return policies, problems


@dataclass(frozen=True)
class JobOptions:
    """A job's own choices (``sbatch --straggler-*``), as text from its registration; None
    for one it did not give."""

    max_requeues: str | None = None
    min_slowdown: str | None = None
    notify: str | None = None
    recovery: str | None = None


def apply_job_overrides(policy: Policy, options: JobOptions) -> Policy:
    """The job's own choices, applied only where they are stricter than the policy: fewer
    requeues, a larger minimum slowdown. ``notify`` picks how the job hears about detections,
    ``recovery`` whether it is advised first (its launcher can leave nodes) or requeued.
    Unparseable values are ignored."""
    actions: dict[str, object] = {}
    detection: dict[str, object] = {}
    try:
        if options.max_requeues:
            actions["max_requeues"] = min(
                policy.actions.max_requeues, max(0, int(options.max_requeues))
            )
        if options.min_slowdown:
            detection["min_slowdown_pct"] = max(
                policy.detection.min_slowdown_pct, float(options.min_slowdown)
            )
    except ValueError:
        return policy
    if options.notify in {"off", "log", "comment"}:
        actions["notify"] = options.notify
    if options.recovery in {"requeue", "advice"}:  # the job's own launcher, its choice
        actions["recovery"] = options.recovery
    if not actions and not detection:
        return policy
    return policy.model_copy(
        update={
            "actions": policy.actions.model_copy(update=actions),
            "detection": policy.detection.model_copy(update=detection),
        }
    )
