"""A real Redis replication set behind Sentinel on loopback: a master, a replica and three
``redis-server --sentinel``, for the failover tests."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from slurm_plugin.devcluster import procs
from slurm_plugin.slurm.runner import run_command
from tests.integration.conftest import RedisServer, free_port, wait_for

SERVICE = "stg"
#: How long a master may not answer before the Sentinels call it down (and fail over).
DOWN_AFTER_MS = 1000


@dataclass
class SentinelSet:
    directory: Path
    servers: list[RedisServer] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        master = RedisServer(self.directory, free_port())
        master.start()
        replica = RedisServer(self.directory, free_port())
        replica.start("--replicaof", "127.0.0.1", str(master.port))
        self.servers = [master, replica]
        for _ in range(3):
            port = free_port()
            conf = self.directory / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize yes\ndir {self.directory}\n"
                f"pidfile {self.directory}/sentinel-{port}.pid\n"
                f"logfile {self.directory}/sentinel-{port}.log\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            run_command(["redis-server", str(conf), "--sentinel"], timeout_s=10)
            self.sentinel_ports.append(port)
        wait_for(self._settled, 20, "the Sentinels to know the master and its replica")

    def _settled(self) -> bool:
        try:
            for port in self.sentinel_ports:
                sentinel: Any = redis.Redis(port=port, socket_timeout=1)
                if int(sentinel.sentinel_master(SERVICE).get("num-slaves", 0)) < 1:
                    return False
            return bool(
                redis.Redis(port=self.servers[1].port).info("replication")["master_link_status"]
                == "up"
            )
        except redis.RedisError:
            return False

    def master_port(self) -> int:
        """Where the Sentinels say the master is now."""
        sentinel: Any = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1)
        return int(sentinel.sentinel_get_master_addr_by_name(SERVICE)[1])

    def kill_master(self) -> float:
        """SIGKILL the master (a crash: nothing flushed); returns when, for timing."""
        port = self.master_port()
        victim = next(s for s in self.servers if s.port == port)
        pid = procs.read_pid(victim.directory / f"redis-{port}.pid")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def wait_failover(self, old_port: int, timeout_s: float = 30) -> float:
        """Wait until the Sentinels name another master that answers as one; returns when."""

        def moved() -> bool:
            try:
                port = self.master_port()
                role = redis.Redis(port=port, socket_timeout=1).info("replication")["role"]
            except redis.RedisError:
                return False
            return port != old_port and role == "master"

        wait_for(moved, timeout_s, "the Sentinels to fail over")
        return time.monotonic()

    def stop(self) -> None:
        for port in self.sentinel_ports:
            pid = procs.read_pid(self.directory / f"sentinel-{port}.pid")
            if pid is not None and procs.is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for server in self.servers:
            pid = procs.read_pid(server.directory / f"redis-{server.port}.pid")
            if pid is not None and procs.is_alive(pid):
                os.kill(pid, signal.SIGKILL)
