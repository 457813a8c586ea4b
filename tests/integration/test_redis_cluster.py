"""The telemetry store against a real 3-master Redis Cluster on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from slurm_plugin import StepReporter
from slurm_plugin.config import load_settings
from slurm_plugin.model import keys
from slurm_plugin.slurm.runner import run_command
from slurm_plugin.store import credentials
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from tests.integration.conftest import RedisServer, free_port, wait_for


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[str]:
    """Three cluster-enabled redis-servers joined with `redis-cli --cluster create`."""
    servers = []
    for i in range(3):
        directory = tmp_path / f"n{i}"
        directory.mkdir()
        server = RedisServer(directory, free_port())
        server.start(
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(directory / "nodes.conf"),
            "--cluster-node-timeout",
            "2000",
        )
        servers.append(server)
    try:
        run_command(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{s.port}" for s in servers),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            timeout_s=30,
        )

        def cluster_ok() -> bool:
            # Every master converges on its own (Redis 8 answers "cluster is down" from a
            # master that has not yet seen the others, after the first one says ok).
            return all(
                redis.Redis(port=s.port).cluster("info").get("cluster_state") == "ok"
                for s in servers
            )

        wait_for(cluster_ok, 20, "cluster_state:ok on every master")
        yield f"redis://127.0.0.1:{servers[0].port}/0"
    finally:
        for server in servers:
            server.stop()


def test_round_trip_through_redis_cluster(
    redis_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With redis_cluster=true the reporter and store work unchanged; a job's keys share a
    slot, and different jobs spread over the masters."""
    monkeypatch.setenv("STRAGGLER_REDIS_URL", redis_cluster)
    monkeypatch.setenv("STRAGGLER_REDIS_CLUSTER", "true")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    settings = load_settings()
    jobs = [str(j) for j in range(100, 112)]
    for job in jobs:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        with StepReporter.from_env() as rep:
            assert rep.enabled
            for step in range(50):
                rep.record(step, 0.1, 0.07, 0.03)
            rep.event("checkpoint_end", step=49)
        assert rep.published == 50

    store = TelemetryStore(connect(settings.redis.url, cluster=True))
    assert isinstance(store.client, RedisCluster)
    slots = set()
    for job in jobs:
        assert [r.step for r in store.iter_steps(job)] == list(range(50))
        job_slots = {store.client.keyslot(k) for k in keys.job_keys(job)}  # type: ignore[no-untyped-call]
        assert len(job_slots) == 1
        slots |= job_slots
        assert store.read_json(keys.job_events(job))[0]["name"] == "checkpoint_end"
    owners = {store.client.get_node_from_key(keys.job_steps(j)).port for j in jobs}  # type: ignore[no-untyped-call]
    assert len(owners) >= 2, "jobs should spread across the cluster's masters"


def test_job_credentials_on_every_cluster_node(
    redis_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ACL users are per server: issue() creates the job's user on every master, the
    reporter publishes with it through the cluster client, and revoke() removes it everywhere."""
    admin = connect(redis_cluster, cluster=True, decode=True)
    ports = [int(n.port) for n in admin.get_nodes()]  # type: ignore[union-attr]
    password = credentials.issue(admin, "4242")
    for port in ports:
        user = redis.Redis(port=port).acl_getuser(credentials.username("4242"))
        assert user is not None, port
    job_url = credentials.job_url(redis_cluster, "4242", password)
    path = credentials.credential_path("4242", tmp_path)
    values = {"redis": {"url": job_url, "cluster": True}}
    credentials.write_file(path, credentials.render("4242", values), os.getuid(), os.getgid())
    monkeypatch.setenv(credentials.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("STRAGGLER_REDIS_URL", "redis://127.0.0.1:1/0")  # unusable on purpose
    with StepReporter.from_env() as rep:
        for step in range(20):
            rep.record(step, 0.1, 0.07, 0.03)
        assert rep.flush(10)
    assert admin.xlen(keys.job_steps("4242")) >= 1
    job_client = connect(job_url, cluster=True)
    with pytest.raises(redis.exceptions.NoPermissionError):
        job_client.xadd(keys.job_steps("4243"), {"x": "1"})
    job_client.close()
    credentials.revoke(admin, "4242")
    for port in ports:
        assert redis.Redis(port=port).acl_getuser(credentials.username("4242")) is None
