"""The Scheduler contract, run against every backend (scontrol is the one tested backend: PyPI's
pyslurm builds only against Slurm 25.11, which no Debian release ships). `make test-releases`
runs it on Slurm 22.05, 24.11 and 26.05."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.errors import JobNotFoundError, StragglerError
from slurm_plugin.model.cluster import HOLD_UNCLEAR, REQUEUE_HELD
from slurm_plugin.slurm.release import parse_version
from slurm_plugin.slurm.scheduler import Scheduler, ScontrolScheduler
from tests.integration.conftest import Slurm, wait_for

#: What differs per Slurm release: make test-releases runs it on each.
pytestmark = pytest.mark.release

BACKENDS: dict[str, Callable[[Settings], Scheduler]] = {"scontrol": ScontrolScheduler}


@pytest.fixture(params=sorted(BACKENDS))
def scheduler(request: pytest.FixtureRequest, cluster: DevCluster) -> Scheduler:
    """A backend pointed at the dev cluster."""
    settings = Settings(slurm={"conf": cluster.slurm_conf, "command_timeout_s": 15})
    return BACKENDS[request.param](settings)


def test_jobs_job_and_annotate(scheduler: Scheduler, slurm: Slurm, job_dir: Path) -> None:
    """A running job is listed with its nodes; AdminComment round-trips hostile text."""
    job = slurm.sbatch(
        "-N2", "-J", 'a "b"; c', f"--output={job_dir / 'j.log'}", "--wrap", "sleep 60"
    )
    slurm.wait_job(job, "RUNNING")
    listed = {j.job_id: j for j in scheduler.jobs()}
    assert listed[job].running
    assert listed[job].name == 'a "b"; c'
    assert len(listed[job].nodes) == 2
    text = "straggler: compute node1 +5.0% annotate [d-0123456789ab]"
    scheduler.annotate(job, text)
    assert scheduler.job(job).admin_comment == text


def test_requeue_hold_exclude_release(scheduler: Scheduler, slurm: Slurm, job_dir: Path) -> None:
    """The eviction primitives: held after requeue_hold, exclusions replaced, released; the
    job's second run is told it is one (SLURM_RESTART_COUNT) and runs without the victim.
    Where the release names runs (SLUID, 25.11 on), each run has its own, the same in squeue
    and in the job's environment; elsewhere none."""
    out = job_dir / "runs.out"
    script = (
        'echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_NODELIST ${SLURM_JOB_SLUID:--}" >> '
        + str(out)
        + "; sleep 60"
    )
    job = slurm.sbatch("-N2", "--requeue", f"--output={job_dir / 'j.log'}", "--wrap", script)
    slurm.wait_job(job, "RUNNING")
    first_run = scheduler.job(job).sluid
    victim = scheduler.job(job).nodes[0]
    scheduler.requeue_hold(job)
    wait_for(lambda: scheduler.job(job).held, 30, "the job to be held")
    assert scheduler.hold_reason(job) == REQUEUE_HELD  # ours (squeue says JobHeldUser)
    scheduler.set_excluded(job, [victim])
    assert scheduler.job(job).excluded == (victim,)
    scheduler.release(job)
    wait_for(lambda: scheduler.job(job).running, 60, "the job to run again")
    again = scheduler.job(job)
    assert again.restarts == 1
    assert victim not in again.nodes
    assert len(again.nodes) == 2
    wait_for(lambda: len(out.read_text().splitlines()) == 2, 30, "the second run's output")
    first, second = out.read_text().splitlines()
    assert first.startswith("0 ")
    assert second.startswith("1 ")
    second_run = again.sluid
    assert [line.split()[-1] for line in (first, second)] == [first_run or "-", second_run or "-"]
    if parse_version(slurm.run("scontrol", "--version").stdout).run_ids:
        assert first_run is not None
        assert second_run is not None
        assert first_run != second_run
    else:
        assert (first_run, second_run) == (None, None)


def test_drain_resume_and_errors(scheduler: Scheduler, slurm: Slurm) -> None:
    """Drain with a reason, see it in nodes(), resume; bad names never reach scontrol."""
    scheduler.drain("node2", "straggler: test drain [d-0123456789ab]")
    node = next(n for n in scheduler.nodes() if n.name == "node2")
    assert not node.usable
    assert node.reason == "straggler: test drain [d-0123456789ab]"
    assert slurm.node_state("node2") == "drained"
    scheduler.resume("node2")
    wait_for(
        lambda: next(n for n in scheduler.nodes() if n.name == "node2").usable, 30, "node2 usable"
    )
    # Slurm 24.11 keeps the Reason for 20 s or more after RESUME (22.05 and 26.05 clear it):
    # whether a node is drained is read from its state flags, never from its reason.
    assert not next(n for n in scheduler.nodes() if n.name == "node2").drained
    wait_for(lambda: slurm.node_state("node2") == "idle", 30, "node2 to be idle")
    with pytest.raises(JobNotFoundError):
        scheduler.job("999999")
    with pytest.raises(StragglerError, match="invalid node name"):
        scheduler.drain("node2; reboot", "x")


def test_job_text_cannot_forge_state(scheduler: Scheduler, slurm: Slurm) -> None:
    """The reproduction of issue 15 on the real cluster: a held job whose name, comment and
    --wrap command say `Restarts=7 NodeList=node9 JobState=RUNNING` is seen held, pending, with
    no restarts and no nodes."""
    hostile = "x Restarts=7 NodeList=node9 JobState=RUNNING Priority=9 ExcNodeList=node3"
    job = slurm.sbatch(
        "-N1",
        "--hold",
        "--requeue",
        "-J",
        hostile,
        f"--comment={hostile}",
        "--output=/dev/null",
        "--wrap",
        f"sleep 600 # {hostile}",
    )
    seen = scheduler.job(job)
    assert (seen.state, seen.held, seen.restarts, seen.nodes, seen.excluded) == (
        "PENDING",
        True,
        0,
        (),
        (),
    )
    assert (seen.name, seen.comment) == (hostile, hostile)
    listed = next(j for j in scheduler.jobs() if j.job_id == job)
    assert (listed.state, listed.held, listed.restarts, listed.nodes) == ("PENDING", True, 0, ())


def test_a_hold_of_its_user_or_an_admin_is_told_from_ours(
    scheduler: Scheduler, slurm: Slurm, job_dir: Path
) -> None:
    """After our release a new hold is someone else's: scontrol names it so (the executor
    never releases it, whatever its own retries think), also when the job's comment names
    our hold's reason."""
    job = slurm.sbatch("-N1", "--requeue", f"--output={job_dir / 'j.log'}", "--wrap", "sleep 60")
    slurm.wait_job(job, "RUNNING")
    scheduler.requeue_hold(job)
    wait_for(lambda: scheduler.job(job).held, 30, "the job to be held")
    scheduler.release(job)
    slurm.run("scontrol", "uhold", job)
    assert scheduler.hold_reason(job) == "JobHeldUser"
    slurm.run("scontrol", "release", job)
    slurm.run("scontrol", "hold", job)
    assert scheduler.hold_reason(job) == "JobHeldAdmin"
    assert scheduler.job(job).held
    # Issue 38, item 1: the job's comment says our requeuehold's reason after Slurm's own
    # (the last field wins a naive parse): the admin's hold is unclear, never ours.
    slurm.run("scontrol", "update", f"JobId={job}", "Comment=ckpt Reason=" + REQUEUE_HELD)
    assert scheduler.hold_reason(job) == HOLD_UNCLEAR
