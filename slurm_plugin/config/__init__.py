"""One typed, validated settings object for every entry point.

Sources, highest precedence first: explicit keyword arguments, ``STRAGGLER_*`` environment
variables, a TOML file (``--config``, else ``STRAGGLER_CONFIG``, else
``/etc/slurm-straggler/config.toml`` when it exists; pydantic-settings' TOML source), then the
defaults. One table per owner (``[redis]``, ``[telemetry]``, ``[service]``, ``[health]``,
``[slurm]``; the rails ``[safety]`` and ``[persistence]``; :mod:`slurm_plugin.config.tables`),
each key with one variable, ``STRAGGLER_<TABLE>_<KEY>``. Tables merge key by key across
sources. Unknown keys in the file are errors that name the key and the file. The flat names of
0.1 are read for one more release (:data:`~slurm_plugin.config.tables.LEGACY`) and logged.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import structlog
from pydantic import Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from slurm_plugin.config.tables import (
    DEV_ONLY,
    GROUPS,
    LEGACY,
    RENAMED,
    HealthSettings,
    HookSettings,
    RedisSettings,
    ServiceSettings,
    SlurmSettings,
    TelemetrySettings,
)
from slurm_plugin.errors import ConfigError
from slurm_plugin.model import redis_url as urls
from slurm_plugin.policy.rails import ClusterRails, PersistencePolicy, SafetyPolicy
from slurm_plugin.tomlfile import describe, read_toml

log = structlog.get_logger(__name__)

DEFAULT_CONFIG_PATH = Path("/etc/slurm-straggler/config.toml")
CONFIG_ENV = "STRAGGLER_CONFIG"
# The settings file of the load_settings() call in progress (the sources are built per call).
_SETTINGS_FILE: ContextVar[Path | None] = ContextVar("settings_file", default=None)
_FILE_ALONE: ContextVar[bool] = ContextVar("settings_file_alone", default=False)


class Settings(BaseSettings):
    """Everything an entry point needs, one table per owner: ``[redis]``, ``[telemetry]``,
    ``[service]``, ``[health]``, ``[slurm]``, the service's rails ``[safety]`` and
    ``[persistence]``, and the site's node ``[hooks]``."""

    model_config = SettingsConfigDict(
        env_prefix="STRAGGLER_",
        # STRAGGLER_REDIS_URL is redis.url, STRAGGLER_HEALTH_BUDGET_S health.budget_s: the
        # first "_" after the prefix splits the group from the name.
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        allow_inf_nan=False,
        frozen=True,
        validate_default=True,
    )

    redis: RedisSettings = Field(default_factory=RedisSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)
    safety: SafetyPolicy = Field(
        default_factory=SafetyPolicy,
        description="Cluster-wide rails ([safety] table): eviction budget, spare nodes, "
        "partition drain limit, circuit breaker. No policy sets them.",
    )
    persistence: PersistencePolicy = Field(
        default_factory=PersistencePolicy,
        description="When the shared node history calls a node persistent, and forgives it "
        "([persistence] table). No policy sets them.",
    )
    hooks: HookSettings = Field(default_factory=HookSettings)
    deployment_id: str = Field(
        default="",
        pattern=r"^[a-z0-9-]{0,16}$",
        description="This deployment's name in every mark it leaves on Slurm and in its lock "
        "(a-z, 0-9, -; at most 16): two deployments sharing one Slurm never undo each other's "
        "marks. Empty: derived from the Redis URL's endpoint and database.",
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
        # The flat names of 0.1 are read from each source and nested there, so that a source
        # of higher precedence wins whichever form either uses.
        path = _SETTINGS_FILE.get()
        init, legacy_env = _Nested(init_settings, "argument"), _LegacyEnv(settings_cls)
        if path is None:
            return (init, env_settings, legacy_env)
        file = _Nested(_SettingsFile(settings_cls, path), f"key in {path}")
        if _FILE_ALONE.get():
            return (file,)
        return (init, env_settings, legacy_env, file)

    @property
    def rails(self) -> ClusterRails:
        """The cluster-wide rails as one object."""
        return ClusterRails(
            safety=self.safety,
            persistence=self.persistence,
            drain_persistent=self.service.drain_persistent,
        )

    @model_validator(mode="after")
    def _credentials_on_database_zero(self) -> Settings:
        # A job's ACL user may append to its own keys only; SELECT is not among its commands,
        # so with any other database every rank's telemetry would stop without a word.
        if self.telemetry.job_credentials and redis_database(self.redis.url) != 0:
            raise ValueError(
                "telemetry.job_credentials needs redis.url on database 0 (a job's Redis user "
                "may not SELECT another): use .../0, or a Redis of its own for this deployment"
            )
        return self

    @property
    def deployment(self) -> str:
        """``deployment_id``, or 6 hex digits of redis.url's endpoint (never its password)."""
        if self.deployment_id:
            return self.deployment_id
        try:
            where = urls.endpoint(self.redis.url)
        except ValueError:
            where = "?"
        return hashlib.sha256(where.encode()).hexdigest()[:6]

    def slurm_command(self, name: str) -> str:
        """The argv[0] for a Slurm client command, honouring ``slurm.bin_dir``."""
        return str(self.slurm.bin_dir / name) if self.slurm.bin_dir else name

    def slurm_env(self) -> dict[str, str]:
        """The environment for Slurm commands: ours plus SLURM_CONF when configured."""
        env = dict(os.environ)
        if self.slurm.conf is not None:
            env["SLURM_CONF"] = str(self.slurm.conf)
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


#: Flat names seen by the load_settings() call in progress: old name -> where it came from.
_SEEN_LEGACY: ContextVar[dict[str, str] | None] = ContextVar("settings_legacy", default=None)


def nest(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with every flat name of 0.1 moved into its table (a value already in the
    table wins: it is the new form, written on purpose); a development setting is an error
    that names its environment variable."""
    out = dict(values)
    for old in [k for k in out if k in DEV_ONLY]:
        raise ConfigError(
            f"{old} is a development setting, no longer read from the settings: use "
            f"${DEV_ONLY[old]}",
            field=old,
        )
    for old in [k for k in out if k in LEGACY]:
        group, name = LEGACY[old]
        table = out.get(group)
        table = dict(table) if isinstance(table, Mapping) else {}
        flat = out.pop(old)
        if name in table:
            _check_unused(old, group, name, flat, where)
        table.setdefault(name, flat)
        out[group] = table
        seen = _SEEN_LEGACY.get()
        if seen is not None:
            seen.setdefault(old, where)  # load_settings() logs it
        else:
            warnings.warn(
                f"setting {old} is now [{group}] {name}; the flat name goes after this release",
                DeprecationWarning,
                stacklevel=2,
            )
    return out


def _check_unused(old: str, group: str, name: str, value: Any, where: str) -> None:
    """A flat value that its table's value overrides is still checked: an invalid one said
    nothing, and came back the day the table's line went."""
    try:
        GROUPS[group].model_validate({name: value})
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"] if exc.errors() else str(exc)
        raise ConfigError(
            f"{old} ({where}): {reason} (the value of [{group}] {name} is the one used; "
            "remove the flat name)",
            field=old,
        ) from None


class _Nested(PydanticBaseSettingsSource):
    """Another source's values with the flat names of 0.1 nested (:func:`nest`)."""

    def __init__(self, inner: PydanticBaseSettingsSource, where: str) -> None:
        super().__init__(inner.settings_cls)
        self.inner, self.where = inner, where

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return nest(self.inner(), self.where)


class _LegacyEnv(PydanticBaseSettingsSource):
    """``STRAGGLER_<OLD_NAME>`` for the flat names that did not become ``GROUP_NAME``
    (``STRAGGLER_POLICY_DIR`` is now ``STRAGGLER_SERVICE_POLICY_DIR``); lists and tables as
    JSON, as before."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for old in RENAMED:
            raw = os.environ.get(_env_name(old))
            if raw is None:
                continue
            try:
                value = json.loads(raw) if raw.lstrip()[:1] in {"[", "{"} else raw
            except ValueError:
                value = raw  # the model's own check says what is wrong with it
            found = nest({**found, old: value}, f"environment variable {_env_name(old)}")
        return found


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
    """True when settings values carry a credential: a password in the Redis URL (``[redis]
    url``, or the flat ``redis_url``), in its userinfo or in its query (``?password=``)."""
    table = values.get("redis")
    urls_given = [table.get("url") if isinstance(table, Mapping) else None, values.get("redis_url")]
    return any(_url_holds_secret(url) for url in urls_given)


def _url_holds_secret(url: Any) -> bool:
    if not isinstance(url, str) or "://" not in url:
        return False
    if urls.raw_userinfo_password(url):
        return True  # a password the parser would cut at a raw "?", "#" or "/" is one still
    try:
        parts = urlsplit(url)
        in_query = any(_secret_param(k) and v for k, v in parse_qsl(parts.query))
        return bool(urls.password_of(url)) or in_query
    except ValueError:
        return True  # unparsable: treat as secret, the URL check reports it later


def redact_url(url: str) -> str:
    """``url`` with every password (userinfo or query) replaced by ``***``, for output and
    messages. The userinfo runs to the last ``@``: a password with a raw ``?``, ``#`` or ``/``
    (which the URL check refuses) is hidden whole too, never cut at that character."""
    if "://" not in url:
        return url
    scheme, _, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    prefix = ""
    if at and any(mark in userinfo for mark in ":=?#/"):
        cut = min((i for i in (userinfo.find(c) for c in ":?#/") if i >= 0), default=0)
        prefix, rest = f"{userinfo[:cut]}:***@", tail
    elif at:
        prefix, rest = f"{userinfo}@", tail
    rest, mark, query = rest.partition("?")
    if query:
        pairs = (p.partition("=") for p in query.split("&"))
        query = "&".join(
            f"{k}{eq}{'***' if eq and _secret_param(unquote(k)) else v}" for k, eq, v in pairs
        )
    return f"{scheme}://{prefix}{rest}{mark}{query}"


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
    """Build the settings from all sources; raise :class:`ConfigError` naming field and file.
    A flat name of 0.1 (``redis_url``, ``STRAGGLER_POLICY_DIR``) still works for this
    release, and is logged once with the name that replaces it."""
    path = resolve_config_path(config_path)
    if path is not None and not path.is_file():
        read_toml(path, "settings file")  # raises: not found, a directory, not readable
    if path is not None:
        _check_file_alone(path)
    token, seen = _SETTINGS_FILE.set(path), _SEEN_LEGACY.set({})
    try:
        settings = Settings(**overrides)
        renamed = dict(_SEEN_LEGACY.get() or {})
    except SettingsError as exc:  # an environment value that is not the JSON a list needs
        group = next((g for g in Settings.model_fields if f'"{g}"' in str(exc)), "?")
        named = sorted(k for k in os.environ if k.startswith(_env_name(group)))
        raise ConfigError(
            f"environment variable {' or '.join(named) or _env_name(group)} is not valid: "
            'lists and tables are JSON there, e.g. [48, 79] or {"incidents": 3}',
            field=group,
        ) from exc
    except ValidationError as exc:
        message, field = describe(exc)
        root = (field or "").split(".")[0]
        named = [n for n in _env_names(field or "") if n in os.environ]
        from_env = bool(named) and root not in overrides
        raise ConfigError(
            f"{message} (from environment variable {named[0]})" if from_env else message,
            path=None if from_env else path,
            field=field,
        ) from exc
    finally:
        _SEEN_LEGACY.reset(seen)
        _SETTINGS_FILE.reset(token)
    for old, where in renamed.items():
        group, name = LEGACY[old]
        log.warning(
            "settings.renamed",
            old=old,
            new=f"[{group}] {name}",
            env=_env_name(f"{group}_{name}"),
            source=where,
            hint="the flat name is read for one more release",
        )
    return settings


def _check_file_alone(path: Path) -> None:
    """The settings file validated whole, on its own: a typo in a key the environment also
    sets is still the file's error (it would come back the day that variable goes)."""
    token, alone = _SETTINGS_FILE.set(path), _FILE_ALONE.set(True)
    seen = _SEEN_LEGACY.set({})  # the whole load logs the file's flat names, once
    try:
        Settings()  # the file and the defaults, never the environment
    except ValidationError as exc:
        message, field = describe(exc)
        raise ConfigError(message, path=path, field=field) from exc
    finally:
        _SEEN_LEGACY.reset(seen)
        _FILE_ALONE.reset(alone)
        _SETTINGS_FILE.reset(token)


def _env_name(name: str) -> str:
    return f"STRAGGLER_{name}".upper()


def _env_names(field: str) -> list[str]:
    """The environment variables that can set ``field`` (``redis.url``), most precise first."""
    parts = field.split(".")
    names = [_env_name("_".join(parts[:2]))] if len(parts) > 1 else []
    names.append(_env_name(parts[0]))
    old = next((o for o, new in LEGACY.items() if list(new) == parts[:2]), None)
    return names + ([_env_name(old)] if old in RENAMED else [])


__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "HealthSettings",
    "RedisSettings",
    "ServiceSettings",
    "Settings",
    "SlurmSettings",
    "TelemetrySettings",
    "load_settings",
    "redact_url",
]
