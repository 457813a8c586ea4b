"""Recovery inside the allocation (issue 40): a real torch elastic job across 4 dev-cluster
nodes, 3 of them enough (``torchrun --nnodes 3:4``, each node's launcher under
``straggler leave-on-advice``), node3 slowed by the demo's CPU quota, submitted with
``--straggler-recovery=advice``. The service advises the job to leave node3; node3's
launcher stops, the other three re-form and resume from the last checkpoint, and the job
completes with no Slurm requeue. Advice not acted on is requeued at its deadline, as today:
the same elastic job on 3 nodes of 2 ranks (the 4-node dev cluster has no room for a 4-node
job without node3) whose launchers do not act on advice (and over a fake Slurm, rule by
rule: test_advice.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.demo.run import REPO, DemoRun, run_scenario, summarize
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.errors import DevClusterError
from slurm_plugin.model.records import StepRecord
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import advice
from slurm_plugin.store.telemetry_store import connect
from tests.integration.conftest import NOT_NOISE, copy_policies

pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

pytestmark = pytest.mark.cluster

#: The longest the job may take from the advice to its first step without node3, s: the
#: launcher's read of the advice (every 2 s), torch elastic's failure detection and new
#: rendezvous (last call 2 s, heartbeats 1 s), the workers' start and checkpoint load;
#: measured ~20-30 s here (2 cores shared by 4 nodes), documented in the README.
RECOVERY_BOUND_S = 90.0


def _seen(work: Path, lines: list[str]) -> str:
    """What a failure shows: the run's progress, the service's decisions, the job's output."""
    log = work / "service.log"
    service = log.read_text().splitlines() if log.exists() else []
    output = work / "job.log"
    job = output.read_text().splitlines() if output.exists() else []
    keep = [x for x in service if "service.cycle" not in x]
    return "\n".join([*lines[-30:], *keep[-40:], *job[-40:]])


def _run(
    cluster: DevCluster,
    work: Path,
    lines: list[str],
    *,
    steps: int,
    redis_db: int,
    policy_dir: Path,
    submit_args: tuple[str, ...] = (),
    job_env: dict[str, str] | None = None,
) -> DemoRun:
    """examples/elastic_train.sbatch under `--straggler-recovery=advice`, node3 slowed to a
    tenth of a CPU at step 60."""
    try:
        return run_scenario(
            Settings(),
            cluster,
            work,
            policy="evict",
            steps=steps,
            slow_at=60,
            quota_pct=10,
            redis_db=redis_db,
            say=lines.append,
            timeout_s=600,
            script=REPO / "examples" / "elastic_train.sbatch",
            submit_args=["--straggler-recovery=advice", *submit_args, *NOT_NOISE],
            job_env=job_env,
            policy_dir=policy_dir,
        )
    except DevClusterError as exc:
        pytest.fail(f"{exc}\n{_seen(work, lines)}")


@pytest.mark.alone  # its recovery is timed against RECOVERY_BOUND_S
def test_an_elastic_job_leaves_the_slow_node_without_a_requeue(
    cluster: DevCluster, tmp_path: Path
) -> None:
    lines: list[str] = []
    seen = functools.partial(_seen, tmp_path / "run", lines)
    run = _run(
        cluster,
        tmp_path / "run",
        lines,
        steps=300,  # ~80 steps to the recovery (the slowed ones take ~25 s), ~15 s after it
        redis_db=11,
        policy_dir=copy_policies(tmp_path / "policies"),
    )
    assert run.job.get("JobState") == "COMPLETED", seen()
    assert run.job.get("Restarts") == "0", seen()
    advised = [d for d in run.decisions if d.get("action") in {"advise", "evict"}]
    assert len(advised) == 1, seen()
    (decision,) = advised
    assert (decision["action"], decision["state"]) == ("advise", "acted"), seen()
    assert json.loads(decision["nodes"]) == ["node3"]
    acted_ts = max(
        float(e["updated_at"])
        for e in run.audit
        if e.get("id") == decision["id"] and e.get("state") == "acted"
    )
    advised_ts = min(
        float(e["updated_at"])
        for e in run.audit
        if e.get("id") == decision["id"] and e.get("action") == "advise"
    )
    # node3's ranks are gone: nothing of node3 stamped after the job reported leaving it.
    late = [r for r in run.records if r.node == "node3" and r.ts > acted_ts]
    assert late == [], seen()
    after = sorted(r.ts for r in run.records if r.ts > advised_ts + 1.0 and r.node != "node3")
    assert after, seen()
    # The first step of the three: the newest step number resets to the checkpoint's.
    resumed = [line for line in run.output.splitlines() if "resumed from checkpoint" in line]
    assert resumed, seen()
    assert "on 3 ranks" in run.output, seen()
    # The re-formed group numbers its ranks anew: believed on their new nodes, none dropped.
    url = cluster.redis_url.rsplit("/", 1)[0] + "/11"
    state = ServiceState(connect(url, decode=True)).job_state(run.job_id)
    assert state.ignored.get("rank_moved", 0) == 0, state.ignored
    gap = _recovery_s(run.records, advised_ts)
    healthy = summarize(run)["onset_to_healthy_s"]
    print(  # noqa: T201 - the measured figures
        f"advice to the first step on 3 nodes: {gap:.1f} s; onset to a healthy step: {healthy} s"
    )
    assert gap <= RECOVERY_BOUND_S, seen()


@pytest.mark.alone  # a real training job of six ranks
def test_an_elastic_job_that_ignores_the_advice_is_requeued_at_its_deadline(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """The elastic job of the test above, its launchers not under `leave-on-advice`, 3 nodes
    of 2 ranks: advised to leave node3, it does not, and at the advice's deadline it is
    requeued without node3 as under ``recovery = "requeue"``, resumes from its checkpoint
    on node1, node2 and node4 and completes (Restarts=1); the advice is withdrawn."""
    lines: list[str] = []
    seen = functools.partial(_seen, tmp_path / "run", lines)
    deadline_s = 15
    policies = copy_policies(tmp_path / "policies")
    evict = policies / "evict.toml"
    evict.write_text(
        evict.read_text().replace("[actions]\n", f"[actions]\nadvice_deadline_s = {deadline_s}\n")
    )
    run = _run(
        cluster,
        tmp_path / "run",
        lines,
        steps=200,
        redis_db=12,
        policy_dir=policies,
        submit_args=("--nodes=3",),
        job_env={"NPROC_PER_NODE": "2", "LEAVE_ON_ADVICE": "0"},
    )
    assert run.job.get("JobState") == "COMPLETED", seen()
    assert run.job.get("Restarts") == "1", seen()
    assert run.job.get("ExcNodeList") == "node3", seen()
    summary = summarize(run)
    assert "node3" not in summary["final_nodes"], seen()
    assert summary["resumed_from_step"] is not None, seen()
    assert summary["resumed_from_step"] > 0, seen()
    acted = [d for d in run.decisions if d.get("action") in {"advise", "evict"}]
    assert len(acted) == 1, seen()
    (decision,) = acted
    assert (decision["action"], decision["after"]) == ("evict", "advice deadline"), seen()
    assert decision["state"] == "verified", seen()
    assert json.loads(decision["nodes"]) == ["node3"]
    # Requeued at the deadline, not before it.
    assert float(decision["held_ts"]) - float(decision["advice_deadline_ts"]) > -1.5, decision
    url = cluster.redis_url.rsplit("/", 1)[0] + "/12"
    assert advice.read(connect(url, decode=True), run.job_id) is None


def _recovery_s(records: list[StepRecord], advised_ts: float) -> float:
    """From the advice to the first step of the group re-formed without node3: the first
    record of another node stamped after node3's last one (the others' steps in flight when
    node3 left end within a second of it)."""
    last = max((r.ts for r in records if r.node == "node3"), default=advised_ts)
    first = min((r.ts for r in records if r.node != "node3" and r.ts > last + 1.0), default=None)
    return float("inf") if first is None else first - advised_ts
