"""The SPANK plugin on the real cluster: options, validation, and where the values go."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.devcluster.cluster import AUTOLOAD_DIR
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.release import parse_version
from slurm_plugin.slurm.scheduler import ScontrolScheduler
from tests.integration.conftest import Slurm, install_prolog, wait_cycles, wait_for

#: What differs per Slurm release: make test-releases runs it on each.
pytestmark = pytest.mark.release

REPO = Path(__file__).resolve().parents[2]
OPTIONS = (
    "--straggler-policy",
    "--straggler-max-requeues",
    "--straggler-min-slowdown",
    "--straggler-notify",
    "--straggler-telemetry",
)


def test_srun_help_lists_the_options(slurm: Slurm) -> None:
    """srun --help shows every option (sbatch --help does not list SPANK options)."""
    text = slurm.run("srun", "--help").stdout
    for option in OPTIONS:
        assert option in text


@pytest.mark.parametrize("command", ["sbatch", "srun"])
def test_invalid_policy_is_refused_at_submit(slurm: Slurm, command: str, job_dir: Path) -> None:
    """A bad policy name fails the submission and the message lists the valid names."""
    args = ["--wrap", "true"] if command == "sbatch" else ["true"]
    result = slurm.run(
        command, "--straggler-policy=fastest", f"--output={job_dir / 'x'}", *args, check=False
    )
    assert result.returncode != 0
    assert "valid policies: evict,evict-aggressive,observe,off" in result.stderr
    bad = slurm.run(command, "--straggler-max-requeues=-2", *args, check=False)
    assert bad.returncode != 0
    assert "must be an integer 0..100" in bad.stderr


def test_tasks_see_their_policy(slurm: Slurm, job_dir: Path) -> None:
    """Tasks get STRAGGLER_POLICY (the chosen one, else the plugin's default)."""
    chosen = job_dir / "chosen.out"
    plain = job_dir / "plain.out"
    a = slurm.sbatch(
        "--straggler-policy=evict",
        "--straggler-notify=log",
        f"--output={chosen}",
        "--wrap",
        "srun env",
    )
    b = slurm.sbatch(f"--output={plain}", "--wrap", "srun env")
    slurm.wait_job(a, "COMPLETED")
    slurm.wait_job(b, "COMPLETED")
    assert "STRAGGLER_POLICY=evict" in chosen.read_text()
    assert "STRAGGLER_NOTIFY=log" in chosen.read_text()
    assert "STRAGGLER_POLICY=observe" in plain.read_text()


def test_code_free_telemetry_is_put_on_the_tasks_python_path(slurm: Slurm, job_dir: Path) -> None:
    """--straggler-telemetry=auto: the autoload directory first on PYTHONPATH (the job's own
    entries kept after it) and STRAGGLER_AUTO=1; without it (the plugin's default, off),
    STRAGGLER_AUTO=0 and PYTHONPATH untouched; a bad value fails the submission."""
    auto, plain = job_dir / "auto.out", job_dir / "plain.out"
    env_line = "srun sh -c 'echo PYTHONPATH=$PYTHONPATH; echo STRAGGLER_AUTO=$STRAGGLER_AUTO'"
    a = slurm.sbatch(
        "--straggler-telemetry=auto",
        "--export=ALL,PYTHONPATH=/opt/job",
        f"--output={auto}",
        "--wrap",
        env_line,
    )
    b = slurm.sbatch("--export=ALL,PYTHONPATH=/opt/job", f"--output={plain}", "--wrap", env_line)
    slurm.wait_job(a, "COMPLETED")
    slurm.wait_job(b, "COMPLETED")
    assert f"PYTHONPATH={AUTOLOAD_DIR}:/opt/job\n" in auto.read_text()
    assert "STRAGGLER_AUTO=1\n" in auto.read_text()
    assert "PYTHONPATH=/opt/job\n" in plain.read_text()
    assert "STRAGGLER_AUTO=0\n" in plain.read_text()
    bad = slurm.run("sbatch", "--straggler-telemetry=yes", "--wrap", "true", check=False)
    assert bad.returncode != 0
    assert "must be auto or off" in bad.stderr


@pytest.fixture
def healthy_prolog(cluster: DevCluster, redis_url: str, tmp_path: Path) -> Iterator[Path]:
    """Our prolog (healthy fake GPUs), which registers each job's SPANK choices."""
    base = tmp_path / "prolog"
    install_prolog(cluster, base, redis_url, {})
    yield base
    cluster.up()
    shutil.rmtree(base, ignore_errors=True)


def test_options_are_registered_and_bound_the_service(
    healthy_prolog: Path,
    cluster: DevCluster,
    slurm: Slurm,
    job_dir: Path,
    state: ServiceState,
    service: subprocess.Popen[bytes],
) -> None:
    """--straggler-policy=evict --straggler-max-requeues=1: registered by the prolog; the
    service evicts the job once (node3) and not a second time (node2 slow too). Each run's
    SLUID (25.11 on) is registered by its prolog, and the eviction bound to the run it acted
    on."""
    job = slurm.sbatch(
        "-N3",
        "--ntasks-per-node=2",
        "--requeue",
        "-t",
        "30",
        "--straggler-policy=evict",
        "--straggler-max-requeues=1",
        f"--output={job_dir / 'job.log'}",
        "--chdir",
        str(REPO),
        "--wrap",
        f"srun {sys.executable} -m tests.integration._fake_rank 300 node3,node2 1.5",
    )
    slurm.wait_job(job, "RUNNING")
    meta = state.job_meta(job)
    assert (meta.policy, meta.options) == ("evict", {"max_requeues": "1"})
    # The prolog registers the run Slurm names (25.11 on; none before), as squeue lists it.
    scheduler = ScontrolScheduler(Settings(slurm={"conf": cluster.slurm_conf}))
    first_run = scheduler.job(job).sluid
    assert meta.run == (first_run or "")
    assert (first_run is not None) == parse_version(
        slurm.run("scontrol", "--version").stdout
    ).run_ids

    def decisions() -> list[dict[str, str]]:
        return state.job_decisions(job)

    wait_for(lambda: slurm.job(job)["Restarts"] == "1", 60, "the first eviction")

    def after_restart() -> list[dict[str, str]]:
        """Decisions about stragglers detected after the job was requeued."""
        # Only once the eviction's hold is recorded: before, every decision would count
        # (Slurm may show Restarts=1 before the executor saves held_ts).
        held = [
            float(d["held_ts"])
            for d in decisions()
            if d.get("action") == "evict" and d.get("held_ts")
        ]
        since = min(held) if held else float("inf")
        return [d for d in decisions() if float(d.get("detected_ts") or 0) > since]

    # The straggler of the second attempt (node2) is the one expected; on 2 shared cores the
    # detector has also named node4 (issue 14: attribution under noise). Either way the job's
    # --straggler-max-requeues=1 must hold it back.
    try:
        wait_for(lambda: bool(after_restart()), 90, "a detection after the restart")
    except pytest.fail.Exception:  # say why: the job's record, the nodes, the service's log
        record = {k: slurm.job(job).get(k) for k in ("JobState", "Reason", "NodeList")}
        nodes = slurm.run("sinfo", "-N", "-h", "-o", "%N %T %E").stdout.split("\n")
        log = (job_dir / "service.log").read_text(errors="replace").splitlines()
        said = [x[:300] for x in log if '"service.cycle"' not in x][-15:]
        pytest.fail(f"no decision after the restart: {record} {nodes} {said}")
    wait_cycles(state)  # cycles that could have evicted a second time, and did not
    evictions = [d for d in decisions() if d.get("action") == "evict"]
    assert [d["node"] for d in evictions] == ["node3"]
    second = after_restart()[0]
    assert "already evicted 1 times (max 1)" in second["reasons"]
    assert slurm.job(job)["Restarts"] == "1"
    # The eviction is bound to the run it acted on (what recovery checks the job against);
    # the second run, which our requeue made, is registered with its own id.
    assert state.record(evictions[0]["id"]).job_sluid == first_run
    second_run = scheduler.job(job).sluid
    assert state.job_meta(job).run == (second_run or "")
    if second_run is not None:
        assert second_run != first_run
