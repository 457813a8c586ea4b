"""How fast a requeued job runs again, per release: Slurm 25.11 and later wait
``SchedulerParameters=requeue_delay`` (the dev cluster sets it, and leaves the credential its
default 120 s); older ones wait for the job credential to expire (the dev cluster shortens
``cred_expire``, their only lever)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_plugin.devcluster import DevCluster
from slurm_plugin.devcluster.conf import REQUEUE_DELAY_S
from tests.integration.conftest import Slurm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.release]


def test_an_evicted_job_runs_again_after_the_releases_requeue_delay(
    cluster: DevCluster,
    slurm: Slurm,
    job_dir: Path,
    record_property: Callable[[str, object], None],
) -> None:
    release = cluster.release()
    config = slurm.run("scontrol", "show", "config").stdout
    scheduler = next(line for line in config.splitlines() if line.startswith("SchedulerParameters"))
    auth = next(line for line in config.splitlines() if line.startswith("AuthInfo"))
    if release.requeue_delay:
        assert f"requeue_delay={REQUEUE_DELAY_S}" in scheduler
        assert "cred_expire" not in auth  # Slurm's default lifetime: the delay is requeue_delay's
    else:
        assert f"cred_expire={REQUEUE_DELAY_S}" in auth
    job = slurm.sbatch(
        "-N2", "--requeue", "-t", "10", f"--output={job_dir / 'job-%j.log'}", "--wrap", "sleep 300"
    )
    slurm.wait_job(job, "RUNNING")
    node = slurm.job_nodes(job)[-1]
    held = time.monotonic()
    # The eviction, as the service does it (SLURM-FACTS: requeuehold, exclude, release).
    slurm.run("scontrol", "requeuehold", job)
    wait_for(lambda: slurm.job(job)["Priority"] == "0", 30, "the job to be requeue-held")
    slurm.run("scontrol", "update", f"JobId={job}", f"ExcNodeList={node}")
    released = time.monotonic()
    slurm.run("scontrol", "release", job)
    slurm.wait_job(job, "RUNNING", timeout_s=180)
    running = time.monotonic()
    record_property("release", str(release))
    record_property("hold_to_running_s", round(running - held, 1))
    record_property("release_to_running_s", round(running - released, 1))
    assert node not in slurm.job_nodes(job)
    # The configured delay, the scheduler's pass (sched_interval=2) and a prolog; never the
    # credential's default 120 s.
    assert running - held < REQUEUE_DELAY_S + 20
    slurm.cancel_all()
