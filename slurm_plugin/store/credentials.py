"""Per-job Redis credentials: an ACL user per job that may only append to that job's telemetry.

The prolog (root, admin credentials) calls :func:`issue` on every node of the job: the first
node draws a random password and keeps it in an admin-only key, every node (re)creates the same
ACL user from it, and writes a small settings file that only the job's user can read. Ranks
find the file by job id (:func:`credential_path`) and publish with it. The epilog calls
:func:`revoke`. What the job user may do is exactly :func:`job_rules`: XADD and EXPIRE on its
own steps, events and GPU streams, PING, and the topology/command metadata a Redis Cluster
client needs. No reads of data, no other keys, no admin commands.
"""

from __future__ import annotations

import os
import secrets
import stat
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
import structlog
import tomli_w

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model import keys
from slurm_plugin.model.redis_url import with_user
from slurm_plugin.store.sentinel import every_server

log = structlog.get_logger(__name__)

#: Where ranks look for their credential when $STRAGGLER_TELEMETRY_JOB_CREDENTIALS_DIR is not set.
DEFAULT_DIR = Path("/run/slurm-straggler/jobs")
#: The setting's own variable (``[telemetry] job_credentials_dir``); 0.1's name is still read.
DIR_ENV = "STRAGGLER_TELEMETRY_JOB_CREDENTIALS_DIR"
OLD_DIR_ENV = "STRAGGLER_JOB_CREDENTIALS_DIR"


def _directory(env: Mapping[str, str]) -> Path | None:
    found = env.get(DIR_ENV) or env.get(OLD_DIR_ENV)
    return Path(found) if found else None


USER_PREFIX = "stg-job-"


def username(job_id: str) -> str:
    """The ACL user of a job."""
    return USER_PREFIX + keys.check_job_id(job_id)


def secret_key(job_id: str) -> str:
    """Admin-only string key holding the job's password while the job runs."""
    return keys.job_credential(job_id)


def job_rules(job_id: str) -> list[str]:
    """ACL SETUSER rules: append-only access to the job's own telemetry streams, and reading
    the service's advice to it."""
    return [
        "reset",
        "on",
        "resetchannels",
        "-@all",
        "+xadd",
        "+expire",
        "+ping",
        # Topology and command metadata, which a Redis Cluster client needs to route: they
        # reveal no data.
        "+cluster|slots",
        "+cluster|shards",
        "+command",
        *(f"%W~{key}" for key in keys.job_streams(job_id)),
        # The service's advice to the job (store/advice.py): read-only.
        "+get",
        f"%R~{keys.job_advice(job_id)}",
    ]


def job_url(admin_url: str, job_id: str, password: str) -> str:
    """``admin_url`` with the job's user and password in place of the admin's."""
    return with_user(admin_url, username(job_id), password)


def _all_nodes(client: Any) -> dict[str, Any]:
    """ACL changes go to every node of a Redis Cluster (ACLs are per server)."""
    from redis.cluster import RedisCluster  # noqa: PLC0415

    return {"target_nodes": RedisCluster.ALL_NODES} if isinstance(client, RedisCluster) else {}


#: Keep the job's password when it was issued to the same owner, else issue a new one: one
#: round trip, atomic, so every node of a job agrees on one password.
_ISSUE = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. ':' then return v end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2], 'EX', ARGV[3])
return ARGV[1] .. ':' .. ARGV[2]
"""


def issue(client: Any, job_id: str, owner: str = "", ttl_s: int = keys.JOB_TTL_ACTIVE_S) -> str:
    """Create (or re-create, identically) the job's ACL user; return its password.

    Idempotent and safe to run on every node of the job at once: they agree on one password.
    ``owner`` (the job's uid, and ``uid/SLUID`` where Slurm names the run: 25.11 on) binds
    it: a password left from an older job with this id (its epilog never ran, the controller
    was reinstalled) that another user owned, or another run, is never handed on; a new one
    replaces it, and ``reset`` drops the old one from the ACL user.
    """
    if ":" in owner:
        raise TelemetryError(f"job {job_id}: invalid credential owner {owner[:32]!r}")
    key = secret_key(job_id)
    value = client.eval(_ISSUE, 1, key, owner, secrets.token_urlsafe(32), ttl_s)
    if isinstance(value, bytes):
        value = value.decode()
    password = str(value or "").partition(":")[2]
    if not password:
        raise TelemetryError(f"job {job_id}: credential vanished while being issued")
    _acl(client, "SETUSER", username(job_id), *job_rules(job_id), f">{password}")
    return str(password)


def revoke(client: Any, job_id: str) -> None:
    """Delete the job's ACL user (its open connections are closed by Redis) and password."""
    _acl(client, "DELUSER", username(job_id))
    client.delete(secret_key(job_id))


def _acl(client: Any, *args: str) -> None:
    """An ACL change on every server that may serve the job: each node of a Redis Cluster;
    the master and each replica behind Sentinel (ACLs are not replicated, and a replica
    promoted in a failover must know the job's user). A replica that does not answer is
    logged and skipped: the master has the change, and the job's ranks work until a
    failover to that replica (docs/deploy.md)."""
    servers = every_server(client)
    client.execute_command("ACL", *args, **_all_nodes(client))
    for replica in servers[1:]:
        try:
            replica.execute_command("ACL", *args)
        except redis.RedisError as exc:
            log.warning("credentials.replica_acl_failed", change=args[0], error=str(exc))
        finally:
            replica.close()


def sweep(client: Any, live_job_ids: set[str]) -> list[str]:
    """Revoke the credentials of jobs Slurm no longer knows (an epilog that never ran: a node
    crashed, the epilog timed out). Returns the job ids revoked."""
    answer = client.execute_command("ACL", "USERS", **_all_nodes(client))
    lists = answer.values() if isinstance(answer, dict) else [answer]
    names = {_text(name) for names in lists for name in names or []}
    stale = sorted(
        name.removeprefix(USER_PREFIX)
        for name in names
        if name.startswith(USER_PREFIX) and name.removeprefix(USER_PREFIX) not in live_job_ids
    )
    revoked = []
    for job_id in stale:
        try:
            revoke(client, job_id)
        except TelemetryError:  # a user name we did not make (invalid job id): leave it
            continue
        revoked.append(job_id)
    return revoked


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def credential_path(job_id: str, directory: Path | None = None) -> Path:
    """The file where the job's credential lives on a node."""
    base = directory or _directory(os.environ) or DEFAULT_DIR
    return base / f"{keys.check_job_id(job_id)}.toml"


def render(job_id: str, values: Mapping[str, Mapping[str, Any]]) -> str:
    """The credential file: a settings file (TOML, a table per owner: ``[redis]``...) for the
    job's ranks alone."""
    header = f"# straggler: Redis credential of job {job_id} only; prolog writes, epilog deletes."
    return f"{header}\n{tomli_w.dumps(dict(values))}"


def write_file(path: Path, text: str, uid: int, gid: int) -> None:
    """Write ``text`` atomically as a 0600 file owned by ``uid``:``gid``.

    The directory is created root-owned 0711: users can open a file whose name they know but
    cannot list or plant files. Several prologs of one job may write the same file at once.
    """
    directory = path.parent
    directory.mkdir(mode=0o711, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise TelemetryError(f"{directory} is not a directory we own; refusing to write there")
    if info.st_mode & 0o022:
        directory.chmod(0o711)
    tmp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchown(fd, uid, gid)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


def remove_file(path: Path) -> bool:
    """Delete the credential file; True when one was there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def job_settings(job_id: str, env: Mapping[str, str], load: Callable[..., Any]) -> Any:
    """The settings a rank publishes with: the job's credential file when the prolog wrote one
    (its values beat the environment: the site chose them), else the usual sources."""
    path = credential_path(job_id, _directory(env))
    if not path.is_file():
        return load()
    with path.open("rb") as handle:  # unreadable: PermissionError, an OSError the caller handles
        values = tomllib.load(handle)
    return load(path, **values)
