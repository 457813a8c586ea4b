"""The test harness is a real Slurm cluster and a real Redis: these tests ask them, not us."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from slurm_plugin.config import Settings, load_settings
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.slurm.scheduler import ScontrolScheduler
from tests.integration.conftest import Slurm, wait_for


def test_up_is_idempotent_and_reports_four_idle_nodes(cluster: DevCluster) -> None:
    """A second `up` on a running cluster restarts nothing and still reports 4 idle nodes."""
    before = {d.name: d.pid for d in cluster.status().daemons}
    status = cluster.up()
    assert status.ready
    assert status.nodes == {f"node{i}": "idle" for i in range(1, 5)}
    assert {d.name: d.pid for d in status.daemons} == before
    assert status.env["SLURM_CONF"] == str(cluster.slurm_conf)


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


def test_requeuehold_exclude_release_moves_a_running_job(slurm: Slurm, job_dir: Path) -> None:
    """The eviction sequence restarts a RUNNING job (Restarts=1) on nodes without node3."""
    out = job_dir / "runs.out"
    script = 'echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_NODELIST" >> ' + str(out) + "; sleep 300"
    job = slurm.sbatch("-N3", "--requeue", f"--output={job_dir / 'job.log'}", "--wrap", script)
    slurm.wait_job(job, "RUNNING")
    assert "node3" in slurm.job_nodes(job)

    slurm.run("scontrol", "requeuehold", job)
    wait_for(lambda: slurm.job(job)["JobState"] == "PENDING", 30, "the job to be held")
    slurm.run("scontrol", "update", f"JobId={job}", "ExcNodeList=node3")
    slurm.run("scontrol", "release", job)

    record = slurm.wait_job(job, "RUNNING", timeout_s=60)
    assert record["Restarts"] == "1"
    assert record["ExcNodeList"] == "node3"
    nodes = slurm.job_nodes(job)
    assert len(nodes) == 3
    assert "node3" not in nodes
    wait_for(lambda: len(out.read_text().splitlines()) == 2, 30, "the second run's output")
    first, second = out.read_text().splitlines()
    assert first.startswith("0 ")
    assert second.startswith("1 ")


def test_drain_with_reason_then_resume(slurm: Slurm) -> None:
    """A drained node reports our reason and takes no job; RESUME makes it idle again."""
    reason = "straggler: harness test [dec-test]"
    slurm.run("scontrol", "update", "NodeName=node4", "State=DRAIN", f"Reason={reason}")
    assert slurm.node_state("node4") == "drained"
    assert slurm.node("node4")["Reason"].startswith(reason)

    slurm.run("scontrol", "update", "NodeName=node4", "State=RESUME")
    wait_for(lambda: slurm.node_state("node4") == "idle", 30, "node4 to be idle")
    # Slurm 24.11 keeps the Reason for 20 s or more after RESUME (22.05 and 26.05 clear it):
    # whether a node is drained is read from its state flags, never from its reason.
    scheduler = ScontrolScheduler(Settings(slurm={"conf": slurm.cluster.slurm_conf}))
    node4 = next(n for n in scheduler.nodes() if n.name == "node4")
    assert (node4.drained, node4.usable) == (False, True)


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
