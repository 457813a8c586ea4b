"""Where a rank runs, from Slurm's (or torchrun's) environment: what its records carry."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from slurm_plugin.errors import StragglerError
from slurm_plugin.model.records import check_group, non_negative_int

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in its job."""

    rank: int
    node: str
    gpu: int
    attempt: int
    world: int
    group: str


def rank_env(env: Mapping[str, str]) -> RankEnv:
    """The rank's place from ``env``; a malformed number raises :class:`StragglerError`, a
    malformed group is dropped with a warning."""
    group = env.get("STRAGGLER_GROUP", "")
    try:
        check_group(group) if group else None
    except StragglerError as exc:  # publish without a group rather than not at all
        log.warning("telemetry.group_ignored", error=str(exc))
        group = ""
    return RankEnv(
        rank=_env_int(env, "SLURM_PROCID", "RANK", default=0),
        node=env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
        gpu=_env_int(env, "SLURM_LOCALID", "LOCAL_RANK", default=0),
        attempt=_env_int(env, "SLURM_RESTART_COUNT", default=0),
        world=_env_int(env, "SLURM_NTASKS", "WORLD_SIZE", default=0),
        group=group,
    )


def _env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        text = env.get(name)
        if text is None or text == "":
            continue
        return non_negative_int(text, name)
    return default
