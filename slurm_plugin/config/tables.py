"""The settings' tables, one per owner (``[redis]``, ``[telemetry]``, ``[service]``,
``[health]``, ``[slurm]``), and the flat names of 0.1 that still lead to them."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from slurm_plugin.model.redis_url import unencoded_userinfo


class _Group(BaseModel):
    """A table of the settings file: frozen, unknown keys and NaN are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RedisSettings(_Group):
    """``[redis]``: where every component reaches Redis, and how long it waits for it."""

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL (redis://, rediss://, or redis+sentinel://HOST:PORT,.../MASTER/DB "
        "for Redis behind Sentinel): telemetry, node history, audit trail.",
    )
    cluster: bool = Field(default=False, description="Treat url as a Redis Cluster seed node.")

    @field_validator("url")
    @classmethod
    def _password_encoded(cls, value: str) -> str:
        if unencoded_userinfo(value):
            raise ValueError(
                "the password holds a raw '?', '#' or '/', which ends the host part of a URL: "
                "percent-encode them (%3F, %23, %2F)"
            )
        return value

    tls_ca_file: Path | None = Field(
        default=None,
        description="rediss:// only: CA bundle that signed the server's certificate "
        "(None: the system's trust store).",
    )
    tls_cert_file: Path | None = Field(
        default=None, description="rediss:// only: client certificate, for mutual TLS."
    )
    tls_key_file: Path | None = Field(
        default=None, description="rediss:// only: the client certificate's private key."
    )
    timeout_s: float = Field(
        default=2.0, gt=0, description="Socket connect/read timeout for every Redis call, seconds."
    )


class TelemetrySettings(_Group):
    """``[telemetry]``: what the in-job reporters, the node relay and job credentials do."""

    enabled: bool = Field(
        default=True, description="Publish in-job step timings (False: reporters do nothing)."
    )
    flush_interval_s: float = Field(
        default=1.0, gt=0, le=60, description="How often a reporter flushes its buffer, seconds."
    )
    buffer_records: int = Field(
        default=100_000, ge=100, description="Records a reporter keeps while Redis is away."
    )
    relay_socket: Path | None = Field(
        default=Path("/run/slurm-straggler/relay.sock"),
        description="The node relay's socket (`straggler relay`): ranks publish through it, so "
        "Redis sees one connection per node; without a relay answering there they publish "
        "to Redis themselves. None: never use a relay.",
    )
    job_credentials: bool = Field(
        default=False,
        description="The prolog creates a Redis ACL user per job that may only append to that "
        "job's telemetry, writes its credential to job_credentials_dir for the job's user "
        "alone, and the epilog deletes both (docs/security.md).",
    )
    job_credentials_dir: Path = Field(
        default=Path("/run/slurm-straggler/jobs"),
        description="Where the prolog writes per-job credential files (JOBID.toml); ranks "
        "read theirs from here ($STRAGGLER_TELEMETRY_JOB_CREDENTIALS_DIR overrides on their side).",
    )


class ServiceSettings(_Group):
    """``[service]``: the policy service (`straggler serve`) and the admin CLI."""

    policy_dir: Path = Field(
        default=Path("/etc/slurm-straggler/policies"),
        description="Directory of policy files (*.toml); the service re-reads it every cycle.",
    )
    default_policy: str = Field(
        default="observe", description="Policy of jobs that do not choose one."
    )
    allowed_policies: list[str] | None = Field(
        default=None,
        description="Policies a job may choose (SPANK option or --comment); None: every policy "
        "in policy_dir. A job asking for another one runs under default_policy.",
    )
    drain_persistent: bool = Field(
        default=False,
        description="Drain nodes whose history turns persistent (also needs the default "
        'policy\'s mode = "evict"; never in a dry run).',
    )
    interval_s: float = Field(default=2.0, gt=0, description="Seconds between service cycles.")
    decision_retention_s: float = Field(
        default=90 * 24 * 3600.0,
        ge=3600,
        le=10 * 365 * 24 * 3600.0,
        description="How long a decision (and a job's index of its decisions) is kept after its "
        "last change, seconds; the audit stream keeps its own last 100,000 entries.",
    )
    action_grace_s: float = Field(
        default=60.0,
        gt=0,
        description="How long an action whose outcome Slurm did not tell us (timeout, "
        "slurmctld away) is re-checked before it is given up as not done.",
    )
    evidence_max_age_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="A node sidecar's sample older (or newer) than this many seconds is no "
        "evidence about the node: it is shown in the decision, never corroborates a drain.",
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Prometheus metrics port (0: no endpoint)."
    )
    metrics_address: str = Field(
        default="127.0.0.1",
        description="The address the metrics endpoint listens on: loopback unless a Prometheus "
        "elsewhere scrapes it (then this host's address on the monitoring network, or 0.0.0.0).",
    )

    @field_validator("metrics_address")
    @classmethod
    def _an_ip_address(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0)") from None


class HealthSettings(_Group):
    """``[health]``: the prolog's and epilog's checks."""

    expected_gpus: int | None = Field(
        default=None, ge=0, description="GPUs every node must show (None: do not check)."
    )
    expected_hcas: int | None = Field(
        default=None, ge=0, description="InfiniBand/RoCE HCAs every node must show."
    )
    expected_ib_rate_gbps: float | None = Field(
        default=None, gt=0, description="Rate every active IB port must run at, Gb/s."
    )
    budget_s: float = Field(
        default=10.0, gt=0, description="Hard time budget of the prolog's checks, seconds."
    )
    nvml_timeout_s: float = Field(
        default=5.0, gt=0, description="NVML must answer within this; else the GPU is hung."
    )
    max_temp_c: int = Field(default=87, description="GPU temperature that drains.")
    min_sm_clock_max_mhz: int | None = Field(
        default=None, description="Max SM clock below this drains (None: the driver's default)."
    )
    critical_xids: list[int] = Field(
        default=[48, 63, 64, 74, 79, 92, 94, 95, 119, 120],
        description="XID codes that drain the node.",
    )
    sysfs_root: Path = Field(
        default=Path("/"), description="Root under which /sys/class/infiniband is read."
    )
    state_dir: Path = Field(
        default=Path("/var/lib/slurm-straggler"),
        description="Where the prolog keeps counters between checks.",
    )
    kmsg_path: Path | None = Field(
        default=Path("/dev/kmsg"),
        description="Kernel log read for the driver's 'NVRM: Xid' lines since the last check "
        "(NVML shows a new process no XID that happened before it started); None: off.",
    )
    syslog_socket: Path | None = Field(
        default=Path("/dev/log"),
        description="Syslog socket (journald reads the same) to which the prolog and epilog "
        "send their warnings and own problems: slurmd discards a passing prolog's output. "
        "None: stderr only.",
    )
    gpu: Literal["auto", "off"] = Field(
        default="auto", description="auto: check GPUs when NVML is present; off: never."
    )


class SlurmSettings(_Group):
    """``[slurm]``: how Slurm's client commands are run."""

    bin_dir: Path | None = Field(
        default=None,
        description="Directory of scontrol/squeue/sinfo/sbatch; None: look them up on PATH.",
    )
    conf: Path | None = Field(
        default=None,
        description="slurm.conf for Slurm commands (SLURM_CONF); None keeps Slurm's default.",
    )
    command_timeout_s: float = Field(
        default=15.0, gt=0, description="Timeout for any one Slurm command, seconds."
    )


class HookSettings(_Group):
    """``[hooks]``: the site's commands the service runs when a node's straggler state turns
    (``docs/deploy.md``, "Node hooks"): argv lists, never a shell; the event as JSON on
    standard input."""

    on_persistent: list[str] = Field(
        default_factory=list,
        description="Command (argv, the program by absolute path) run once each time a node "
        "becomes a persistent straggler (by the service or an admin's `node mark`); "
        "empty: none.",
    )
    on_forgiven: list[str] = Field(
        default_factory=list,
        description="Command (argv, absolute path) run once each time a persistent node is "
        "forgiven (by time, `node forgive` or `node mark`); empty: none.",
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="A hook still running after this many seconds is killed (its whole "
        "process group) and recorded as failed.",
    )

    @field_validator("on_persistent", "on_forgiven")
    @classmethod
    def _argv(cls, argv: list[str]) -> list[str]:
        if argv and not argv[0].startswith("/"):
            raise ValueError(f"the program must be an absolute path, not {argv[0]!r}")
        if any(not part or "\0" in part for part in argv):
            raise ValueError("an argument is empty or holds a NUL")
        return argv


#: Each group's table, by the name it has in the settings file and the environment
#: (``STRAGGLER_<GROUP>_<NAME>``).
GROUPS: dict[str, type[_Group]] = {
    "redis": RedisSettings,
    "telemetry": TelemetrySettings,
    "service": ServiceSettings,
    "health": HealthSettings,
    "slurm": SlurmSettings,
}
#: The flat names of 0.1 (``redis_url = ...``), still read for one release: old name ->
#: (group, name). The ones not listed became ``GROUP_NAME`` (``health_budget_s``).
RENAMED = {
    "job_credentials": ("telemetry", "job_credentials"),
    "job_credentials_dir": ("telemetry", "job_credentials_dir"),
    "policy_dir": ("service", "policy_dir"),
    "default_policy": ("service", "default_policy"),
    "allowed_policies": ("service", "allowed_policies"),
    "drain_persistent": ("service", "drain_persistent"),
    "decision_retention_s": ("service", "decision_retention_s"),
    "action_grace_s": ("service", "action_grace_s"),
    "evidence_max_age_s": ("service", "evidence_max_age_s"),
    "metrics_port": ("service", "metrics_port"),
    "command_timeout_s": ("slurm", "command_timeout_s"),
}
LEGACY: dict[str, tuple[str, str]] = {
    **{
        f"{group}_{name}": (group, name)
        for group, model in GROUPS.items()
        for name in model.model_fields
        if (group, name) not in RENAMED.values()
    },
    **RENAMED,
}
#: Settings of the development cluster: never the production model's (`straggler devcluster`
#: reads them from its own environment variables).
DEV_ONLY = {
    "devcluster_dir": "STRAGGLER_DEVCLUSTER_DIR",
    "devcluster_redis_port": "STRAGGLER_DEVCLUSTER_REDIS_PORT",
    "devcluster_slurmctld_port": "STRAGGLER_DEVCLUSTER_SLURMCTLD_PORT",
    "devcluster_fake_nvml": "STRAGGLER_DEVCLUSTER_FAKE_NVML (the dev cluster's own prolog)",
}
