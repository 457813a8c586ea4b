"""One typed, validated settings object for every entry point.

Sources, highest precedence first: explicit keyword arguments, ``STRAGGLER_*`` environment
variables, a TOML file (``--config``, else ``STRAGGLER_CONFIG``, else
``/etc/slurm-straggler/config.toml`` when it exists; pydantic-settings' TOML source), then the
defaults below. Tables (``[safety]``) merge key by key across sources. Unknown keys in the file
are errors that name the key and the file.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from contextvars import ContextVar
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from slurm_plugin.errors import ConfigError
from slurm_plugin.model import redis_url as urls
from slurm_plugin.policy.rails import ClusterRails, PersistencePolicy, SafetyPolicy
from slurm_plugin.tomlfile import describe, read_toml

DEFAULT_CONFIG_PATH = Path("/etc/slurm-straggler/config.toml")
CONFIG_ENV = "STRAGGLER_CONFIG"
# The settings file of the load_settings() call in progress (the sources are built per call).
_SETTINGS_FILE: ContextVar[Path | None] = ContextVar("settings_file", default=None)
_FILE_ALONE: ContextVar[bool] = ContextVar("settings_file_alone", default=False)


class Settings(BaseSettings):
    """Everything an entry point needs to reach Redis and Slurm, and how long to wait for them."""

    model_config = SettingsConfigDict(
        env_prefix="STRAGGLER_",
        extra="forbid",
        allow_inf_nan=False,
        frozen=True,
        validate_default=True,
    )

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL (redis://, rediss://, or redis+sentinel://HOST:PORT,.../MASTER/DB "
        "for Redis behind Sentinel): telemetry, node history, audit trail.",
    )
    redis_cluster: bool = Field(
        default=False, description="Treat redis_url as a Redis Cluster seed node."
    )
    redis_tls_ca_file: Path | None = Field(
        default=None,
        description="rediss:// only: CA bundle that signed the server's certificate "
        "(None: the system's trust store).",
    )
    redis_tls_cert_file: Path | None = Field(
        default=None, description="rediss:// only: client certificate, for mutual TLS."
    )
    redis_tls_key_file: Path | None = Field(
        default=None, description="rediss:// only: the client certificate's private key."
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
        "read theirs from here ($STRAGGLER_JOB_CREDENTIALS_DIR overrides on their side).",
    )
    telemetry_enabled: bool = Field(
        default=True, description="Publish in-job step timings (False: reporters do nothing)."
    )
    telemetry_flush_interval_s: float = Field(
        default=1.0, gt=0, le=60, description="How often a reporter flushes its buffer, seconds."
    )
    telemetry_buffer_records: int = Field(
        default=100_000, ge=100, description="Records a reporter keeps while Redis is away."
    )
    telemetry_relay_socket: Path | None = Field(
        default=Path("/run/slurm-straggler/relay.sock"),
        description="The node relay's socket (`straggler relay`): ranks publish through it, so "
        "Redis sees one connection per node; without a relay answering there they publish "
        "to Redis themselves. None: never use a relay.",
    )
    policy_dir: Path = Field(
        default=Path("/etc/slurm-straggler/policies"),
        description="Directory of policy files (*.toml); the service re-reads it every cycle.",
    )
    default_policy: str = Field(
        default="observe", description="Policy of jobs that do not choose one."
    )
    safety: SafetyPolicy = Field(
        default_factory=SafetyPolicy,
        description="Cluster-wide rails ([safety] table; env: JSON): eviction budget, spare "
        "nodes, partition drain limit, circuit breaker. No policy sets them.",
    )
    persistence: PersistencePolicy = Field(
        default_factory=PersistencePolicy,
        description="When the shared node history calls a node persistent, and forgives it "
        "([persistence] table; env: JSON). No policy sets them.",
    )
    drain_persistent: bool = Field(
        default=False,
        description="Drain nodes whose history turns persistent (also needs the default "
        'policy\'s mode = "evict"; never in a dry run).',
    )
    allowed_policies: list[str] | None = Field(
        default=None,
        description="Policies a job may choose (SPANK option or --comment); None: every policy "
        "in policy_dir. A job asking for another one runs under default_policy.",
    )
    service_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between service cycles."
    )
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
    deployment_id: str = Field(
        default="",
        pattern=r"^[a-z0-9-]{0,16}$",
        description="This deployment's name in every mark it leaves on Slurm and in its lock "
        "(a-z, 0-9, -; at most 16): two deployments sharing one Slurm never undo each other's "
        "marks. Empty: derived from redis_url's host, port and database.",
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
    health_expected_gpus: int | None = Field(
        default=None, ge=0, description="GPUs every node must show (None: do not check)."
    )
    health_expected_hcas: int | None = Field(
        default=None, ge=0, description="InfiniBand/RoCE HCAs every node must show."
    )
    health_expected_ib_rate_gbps: float | None = Field(
        default=None, gt=0, description="Rate every active IB port must run at, Gb/s."
    )
    health_budget_s: float = Field(
        default=10.0, gt=0, description="Hard time budget of the prolog's checks, seconds."
    )
    health_nvml_timeout_s: float = Field(
        default=5.0, gt=0, description="NVML must answer within this; else the GPU is hung."
    )
    health_max_temp_c: int = Field(default=87, description="GPU temperature that drains.")
    health_min_sm_clock_max_mhz: int | None = Field(
        default=None, description="Max SM clock below this drains (None: the driver's default)."
    )
    health_critical_xids: list[int] = Field(
        default=[48, 63, 64, 74, 79, 92, 94, 95, 119, 120],
        description="XID codes that drain the node.",
    )
    health_sysfs_root: Path = Field(
        default=Path("/"), description="Root under which /sys/class/infiniband is read."
    )
    health_state_dir: Path = Field(
        default=Path("/var/lib/slurm-straggler"),
        description="Where the prolog keeps counters between checks.",
    )
    health_kmsg_path: Path | None = Field(
        default=Path("/dev/kmsg"),
        description="Kernel log read for the driver's 'NVRM: Xid' lines since the last check "
        "(NVML shows a new process no XID that happened before it started); None: off.",
    )
    health_syslog_socket: Path | None = Field(
        default=Path("/dev/log"),
        description="Syslog socket (journald reads the same) to which the prolog and epilog "
        "send their warnings and own problems: slurmd discards a passing prolog's output. "
        "None: stderr only.",
    )
    health_gpu: Literal["auto", "off"] = Field(
        default="auto", description="auto: check GPUs when NVML is present; off: never."
    )
    redis_timeout_s: float = Field(
        default=2.0, gt=0, description="Socket connect/read timeout for every Redis call, seconds."
    )
    slurm_bin_dir: Path | None = Field(
        default=None,
        description="Directory of scontrol/squeue/sinfo/sbatch; None: look them up on PATH.",
    )
    slurm_conf: Path | None = Field(
        default=None,
        description="slurm.conf for Slurm commands (SLURM_CONF); None keeps Slurm's default.",
    )
    command_timeout_s: float = Field(
        default=15.0, gt=0, description="Timeout for any one Slurm command, seconds."
    )
    # The development cluster's settings (`straggler devcluster`, `make demo`, the tests); a
    # production deployment leaves them alone.
    devcluster_dir: Path = Field(
        default=Path("/tmp/slurm-straggler-devcluster"),  # noqa: S108 - a documented dev default
        description="Base directory of the local development cluster (all its state lives here).",
    )
    devcluster_redis_port: int = Field(
        default=16379, ge=1, le=65535, description="Port of the development cluster's redis-server."
    )
    devcluster_slurmctld_port: int = Field(
        default=16817, ge=1, le=65535, description="Port of the development cluster's slurmctld."
    )
    devcluster_fake_nvml: Path | None = Field(
        default=None,
        description="Development cluster and tests only: a JSON file of fake GPUs per node "
        "(slurm_plugin.probes.fake_nvml) that the prolog checks instead of NVML.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest precedence first: keyword arguments, the environment, the settings file
        # load_settings() was given (pydantic-settings merges them, tables key by key).
        path = _SETTINGS_FILE.get()
        if path is None:
            return (init_settings, env_settings)
        if _FILE_ALONE.get():
            return (_SettingsFile(settings_cls, path),)
        return (init_settings, env_settings, _SettingsFile(settings_cls, path))

    @property
    def rails(self) -> ClusterRails:
        """The cluster-wide rails as one object."""
        return ClusterRails(
            safety=self.safety,
            persistence=self.persistence,
            drain_persistent=self.drain_persistent,
        )

    @model_validator(mode="after")
    def _credentials_on_database_zero(self) -> Settings:
        # A job's ACL user may append to its own keys only; SELECT is not among its commands,
        # so with any other database every rank's telemetry would stop without a word.
        if self.job_credentials and redis_database(self.redis_url) != 0:
            raise ValueError(
                "job_credentials needs redis_url on database 0 (a job's Redis user may not "
                "SELECT another): use .../0, or a Redis of its own for this deployment"
            )
        return self

    @property
    def deployment(self) -> str:
        """``deployment_id``, or 6 hex digits of redis_url's endpoint (never its password)."""
        if self.deployment_id:
            return self.deployment_id
        try:
            where = urls.endpoint(self.redis_url)
        except ValueError:
            where = "?"
        return hashlib.sha256(where.encode()).hexdigest()[:6]

    def slurm_command(self, name: str) -> str:
        """The argv[0] for a Slurm client command, honouring ``slurm_bin_dir``."""
        return str(self.slurm_bin_dir / name) if self.slurm_bin_dir else name

    def slurm_env(self) -> dict[str, str]:
        """The environment for Slurm commands: ours plus SLURM_CONF when configured."""
        env = dict(os.environ)
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = str(self.slurm_conf)
        return env


def redis_database(url: str) -> int | None:
    """The database number ``url`` selects (path ``/N`` or ``?db=N``, ``/MASTER/N`` behind
    Sentinel; 0 when it names none), or None when it is not a number."""
    return urls.database(url)


def resolve_config_path(explicit: Path | None = None) -> Path | None:
    """The settings file to read: the explicit one, else $STRAGGLER_CONFIG, else the default."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get(CONFIG_ENV)
    if from_env:
        return Path(from_env)
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None


class _SettingsFile(TomlConfigSettingsSource):
    """The settings file, read strictly: a file that cannot be read or is not TOML is an error
    naming it, and one that holds a Redis password must be private to its owner."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        path = Path(str(file_path))
        values = read_toml(path, "settings file")
        if holds_secret(values):
            check_private(path)
        return values


def _secret_param(name: str) -> bool:
    """A URL query parameter that carries a credential (``password=``, ``auth=``...)."""
    name = name.lower()
    return "pass" in name or name in {"auth", "token", "secret"}


def holds_secret(values: Mapping[str, Any]) -> bool:
    """True when settings values carry a credential: a password in ``redis_url``, in its
    userinfo or in its query (``?password=``)."""
    url = values.get("redis_url")
    if not isinstance(url, str) or "://" not in url:
        return False
    try:
        parts = urlsplit(url)
        in_query = any(_secret_param(k) and v for k, v in parse_qsl(parts.query))
        return bool(urls.password_of(url)) or in_query
    except ValueError:
        return True  # unparsable: treat as secret, the URL check reports it later


def redact_url(url: str) -> str:
    """``url`` with every password (userinfo or query) replaced by ``***``, for output and
    messages."""
    if "://" not in url:
        return url
    scheme, _, rest = url.partition("://")
    rest, mark, query = rest.partition("?")
    if "@" in rest:
        userinfo, _, host = rest.rpartition("@")
        if ":" in userinfo:
            rest = f"{userinfo.split(':', 1)[0]}:***@{host}"
    if query:
        pairs = (p.partition("=") for p in query.split("&"))
        query = "&".join(
            f"{k}{eq}{'***' if eq and _secret_param(unquote(k)) else v}" for k, eq, v in pairs
        )
    return f"{scheme}://{rest}{mark}{query}"


def check_private(path: Path) -> None:
    """Refuse a settings file that holds a credential unless only its owner can read it and
    that owner is root or the user reading it (another user could have planted it)."""
    info = path.stat()
    if info.st_mode & 0o077:
        raise ConfigError(
            f"holds a Redis password but its mode is {stat.S_IMODE(info.st_mode):04o}: other "
            "users can read or change it; `chmod 600` it",
            path=path,
        )
    if info.st_uid not in {0, os.geteuid()}:
        raise ConfigError(
            f"holds a Redis password but belongs to uid {info.st_uid}, neither root nor us",
            path=path,
        )


def load_settings(config_path: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from all sources; raise :class:`ConfigError` naming field and file."""
    path = resolve_config_path(config_path)
    if path is not None and not path.is_file():
        read_toml(path, "settings file")  # raises: not found, a directory, not readable
    if path is not None:
        _check_file_alone(path)
    token = _SETTINGS_FILE.set(path)
    try:
        return Settings(**overrides)
    except SettingsError as exc:  # an environment value that is not the JSON a list needs
        field = next((f for f in Settings.model_fields if f'"{f}"' in str(exc)), None)
        raise ConfigError(
            f"environment variable {_env_name(field or '?')} is not valid: lists and tables "
            'are JSON there, e.g. [48, 79] or {"incidents": 3}',
            field=field,
        ) from exc
    except ValidationError as exc:
        message, field = describe(exc)
        root = (field or "").split(".")[0]
        from_env = _env_name(root) in os.environ and root not in overrides
        raise ConfigError(
            f"{message} (from environment variable {_env_name(root)})" if from_env else message,
            path=None if from_env else path,
            field=field,
        ) from exc
    finally:
        _SETTINGS_FILE.reset(token)


def _check_file_alone(path: Path) -> None:
    """The settings file validated whole, on its own: a typo in a key the environment also
    sets is still the file's error (it would come back the day that variable goes)."""
    token, alone = _SETTINGS_FILE.set(path), _FILE_ALONE.set(True)
    try:
        Settings()  # the file and the defaults, never the environment
    except ValidationError as exc:
        message, field = describe(exc)
        raise ConfigError(message, path=path, field=field) from exc
    finally:
        _FILE_ALONE.reset(alone)
        _SETTINGS_FILE.reset(token)


def _env_name(field: str) -> str:
    return f"STRAGGLER_{field}".upper()


__all__ = ["CONFIG_ENV", "DEFAULT_CONFIG_PATH", "Settings", "load_settings", "redact_url"]
