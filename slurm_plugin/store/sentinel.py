"""Clients for Redis behind Sentinel: the master's, and every server's for ACL changes.

A client made here asks the Sentinels where the master is whenever it (re)connects, so after a
failover its next command reaches the new master; a command in flight when the old one died
fails, and the caller's own retry or next cycle goes on. Replication is asynchronous: what the
old master acknowledged but had not yet sent to its replica is gone (docs/deploy.md, "Redis
with Sentinel", says what that costs and which rails bound it).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

from slurm_plugin.model.redis_url import SentinelUrl

#: The connection options copied to a client of another server of the set: login, database,
#: timeouts, retries, decoding and TLS (the rest belongs to the master's pool).
_COPIED = frozenset({"username", "password", "db", "retry", "decode_responses", "encoding_errors"})


def master_client(url: SentinelUrl, options: dict[str, Any]) -> redis.Redis:
    """A client of the master ``url`` names; ``options``: redis-py keyword arguments (timeouts,
    retry, decoding, ``ssl_*`` for TLS), for the master and, their socket and TLS part, for
    the Sentinels."""
    master = dict(options)
    if url.username:
        master["username"] = url.username
    if url.password is not None:
        master["password"] = url.password
    if url.tls:
        master["ssl"] = True
    sentinel_options = {
        k: v for k, v in options.items() if k.startswith(("socket_", "ssl_")) or k == "retry"
    }
    if url.tls:
        sentinel_options["ssl"] = True
    if url.sentinel_username:
        sentinel_options["username"] = url.sentinel_username
    if url.sentinel_password:
        sentinel_options["password"] = url.sentinel_password
    make: Any = Sentinel  # redis-py's Sentinel has no type annotations
    manager = make(list(url.sentinels), sentinel_kwargs=sentinel_options, db=url.db, **master)
    client: redis.Redis = manager.master_for(url.service, redis_class=redis.Redis)
    return client


def every_server(client: Any) -> list[Any]:
    """``client`` and, when it is a Sentinel master client, a client of each replica the
    Sentinels know: ACL users are per server (never replicated), so a job's user must exist
    on whichever server becomes the master. Other clients: ``[client]``."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool):
        return [client]
    options = {
        k: v
        for k, v in pool.connection_kwargs.items()
        if k in _COPIED or k.startswith(("socket_", "ssl_"))
    }
    if "SSL" in pool.connection_class.__name__:
        options["ssl"] = True
    replicas = pool.sentinel_manager.discover_slaves(pool.service_name)
    return [client, *(redis.Redis(host=host, port=port, **options) for host, port in replicas)]
