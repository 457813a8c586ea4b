"""The development cluster's settings (`straggler devcluster`, `make demo`, the tests), kept
out of the production model: ``STRAGGLER_DEVCLUSTER_*`` environment variables only."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The variable the dev cluster's prolog reads its fake GPUs from (`devcluster/fake_prolog`).
FAKE_NVML_ENV = "STRAGGLER_DEVCLUSTER_FAKE_NVML"


class DevSettings(BaseSettings):
    """Where the local cluster lives and which ports it takes."""

    model_config = SettingsConfigDict(
        env_prefix="STRAGGLER_DEVCLUSTER_", extra="forbid", frozen=True
    )

    dir: Path = Field(
        default=Path("/tmp/slurm-straggler-devcluster"),  # noqa: S108 - a documented dev default
        description="Base directory of the local development cluster (all its state lives here).",
    )
    redis_port: int = Field(
        default=16379, ge=1, le=65535, description="Port of the development cluster's redis-server."
    )
    slurmctld_port: int = Field(
        default=16817, ge=1, le=65535, description="Port of the development cluster's slurmctld."
    )
    lane: int = Field(
        default=0,
        ge=0,
        le=9,
        description="Which of several dev clusters side by side: lane K lives in DIR-laneK and "
        "takes every port 10 x K higher (the test tiers split the cluster tests over two).",
    )
