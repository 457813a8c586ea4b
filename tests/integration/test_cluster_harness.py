"""The test harness is a real Slurm cluster and a real Redis: these tests ask them, not us."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from slurm_plugin.config import load_settings
from slurm_plugin.devcluster import DevCluster
from tests.integration.conftest import Slurm, slurmctld_pid, wait_for, wait_gone


def test_up_is_idempotent_and_reports_four_idle_nodes(cluster: DevCluster) -> None:
    """A second `up` on a running cluster restarts nothing and still reports 4 idle nodes."""
    before = {d.name: d.pid for d in cluster.status().daemons}
    status = cluster.up()
    assert status.ready
    assert status.nodes == {f"node{i}": "idle" for i in range(1, 5)}
    assert {d.name: d.pid for d in status.daemons} == before
    assert status.env["SLURM_CONF"] == str(cluster.slurm_conf)


def test_up_right_after_slurmctld_was_told_to_stop_leaves_a_controller(
    cluster: DevCluster, slurm: Slurm
) -> None:
    """`up` while a stopped slurmctld is still shutting down (its pid file names a live
    process: here held with SIGSTOP, the SIGTERM pending, then let go) starts a new one once
    the old one is gone, and the nodes answer. Before, `up` took the old one for running and
    left the cluster without a controller."""
    pid = slurmctld_pid(cluster)
    os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGTERM)
    with ThreadPoolExecutor(1) as pool:
        status = pool.submit(cluster.up)
        time.sleep(2)  # up() is waiting on a controller that neither answers nor exits
        os.kill(pid, signal.SIGCONT)
        wait_gone(pid, "the stopped slurmctld to exit")
        assert status.result(timeout=90).ready
    assert slurmctld_pid(cluster) != pid
    assert "started slurmctld again (it was stopping)" in status.result().notes
    assert set(slurm.run("sinfo", "-h", "-o", "%T").stdout.split()) == {"idle"}


def test_two_node_job_runs_on_two_distinct_hosts(slurm: Slurm, job_dir: Path) -> None:
    """sbatch -N2 runs one task on each of two nodes, and each sees its own hostname."""
    out = job_dir / "hosts.out"
    job = slurm.sbatch("-N2", f"--output={out}", "--wrap", "srun hostname")
    record = slurm.wait_job(job, "COMPLETED")
    hostnames = sorted(out.read_text().split())
    assert len(hostnames) == 2
    assert hostnames[0] != hostnames[1]
    assert hostnames == sorted(slurm.job_nodes(job))
    assert record["ExitCode"] == "0:0"


@pytest.mark.release
def test_failing_prolog_drains_the_node_and_the_job_runs_elsewhere(
    slurm: Slurm, cluster: DevCluster, job_dir: Path
) -> None:
    """A prolog exiting 1 on node1 drains node1 ("Prolog error"); the job reruns on others."""
    cluster.inject_prolog_failure("node1")
    out = job_dir / "hosts.out"
    job = slurm.sbatch("-N3", f"--output={out}", "--wrap", "srun hostname")

    wait_for(lambda: slurm.node_state("node1") == "drained", 60, "node1 to be drained")
    assert slurm.node("node1")["Reason"].startswith("Prolog error")
    record = slurm.wait_job(job, "COMPLETED", timeout_s=90)
    assert int(record["Restarts"]) >= 1
    assert sorted(out.read_text().split()) == ["node2", "node3", "node4"]


def test_redis_round_trip_through_the_configured_url(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings read STRAGGLER_REDIS_URL; a value written there is read back from the server."""
    monkeypatch.setenv("STRAGGLER_REDIS_URL", redis_url)
    settings = load_settings()
    assert settings.redis.url == redis_url
    client = redis.Redis.from_url(settings.redis.url, socket_timeout=settings.redis.timeout_s)
    client.set("stg:test:roundtrip", "ok", ex=60)
    assert client.get("stg:test:roundtrip") == b"ok"
    assert client.config_get("port")["port"] == redis_url.split(":")[2].split("/", maxsplit=1)[0]
    client.close()
