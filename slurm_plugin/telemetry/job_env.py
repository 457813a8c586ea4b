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
    malformed group is dropped with a warning. Slurm's task variables first, torch's when
    torchrun (torch elastic: ``TORCHELASTIC_RUN_ID``) started the process: under
    ``srun torchrun`` every worker of a node inherits its srun task's ``SLURM_PROCID`` and
    ``SLURM_LOCALID``, and only torch's ``RANK`` and ``LOCAL_RANK`` tell them apart."""
    group = env.get("STRAGGLER_GROUP", "")
    try:
        check_group(group) if group else None
    except StragglerError as exc:  # publish without a group rather than not at all
        log.warning("telemetry.group_ignored", error=str(exc))
        group = ""
    torchrun = bool(env.get("TORCHELASTIC_RUN_ID"))
    rank, gpu, world = (
        (("RANK", "SLURM_PROCID"), ("LOCAL_RANK", "SLURM_LOCALID"), ("WORLD_SIZE", "SLURM_NTASKS"))
        if torchrun
        else (
            ("SLURM_PROCID", "RANK"),
            ("SLURM_LOCALID", "LOCAL_RANK"),
            ("SLURM_NTASKS", "WORLD_SIZE"),
        )
    )
    return RankEnv(
        rank=_env_int(env, *rank, default=0),
        node=env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
        gpu=_env_int(env, *gpu, default=0),
        attempt=_env_int(env, "SLURM_RESTART_COUNT", default=0),
        world=_env_int(env, *world, default=0),
        group=group,
    )


def _env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        text = env.get(name)
        if text is None or text == "":
            continue
        return non_negative_int(text, name)
    return default
