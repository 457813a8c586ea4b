"""The code-free job's straggler is evicted on the dev cluster.

An FSDP2 script with no slurm-straggler code in it (the code-free mode, through the SPANK
option), a 3-node job on the dev cluster, has node3 slowed down for real (a cgroup CPU
quota): the service finds node3 from its compute, evicts it under the ``evict`` policy (the
shipped one, told that node3's slowdown is a fault: how long the shipped values doubt one is
``test_demo``'s), and Slurm runs the job again without node3. The telemetry shows why: node3's
rank computes longer and waits less than it did, the others wait longer.

Plain DDP is the demo's job (``test_demo``). What is specific to FSDP2 with its integration,
Lightning and the Hugging Face Trainer is their telemetry: ``test_stack_telemetry`` runs each
in process on gloo, slowed the same way, and the detector names its straggler there; the
stacks' example scripts also run under srun with the `stack.sbatch` script this test submits
(issue 39: one real eviction per run for plain DDP and one for code-free mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.demo.run import REPO, run_scenario
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.errors import DevClusterError
from slurm_plugin.slurm.parsers import expand_hostlist
from tests.integration.conftest import copy_policies
from tests.integration.demo_why import check_why

#: A real training job whose timings are asserted: run with nothing beside it.
pytestmark = pytest.mark.alone


pytest.importorskip("torch", reason="the torch extra is installed by `make install`")

#: stack -> (examples/ script, the modules it needs, sbatch options, checkpoint every N steps,
#: node3's CPU quota in %). A checkpoint every ~10 s at the slowed pace: the policy evicts
#: right after one.
STACKS = {
    "fsdp2-code-free": ("fsdp2_plain.py", "torch", ("--straggler-telemetry=auto",), 20, 10),
}


def _requeued(record: dict[str, str]) -> bool:
    """Slurm runs the job again after a requeue."""
    return int(record.get("Restarts") or 0) >= 1 and record.get("JobState") == "RUNNING"


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_slow_node_is_found_from_its_compute_and_evicted(
    stack: str, cluster: DevCluster, tmp_path: Path
) -> None:
    script, needs, submit_args, every, quota = STACKS[stack]
    pytest.importorskip(needs, reason="the stacks' extras are installed by `make install`")
    lines: list[str] = []

    def seen() -> str:
        log_path = tmp_path / "run" / "service.log"
        log = log_path.read_text().splitlines() if log_path.exists() else []
        job_log = tmp_path / "run" / "job.log"
        out = job_log.read_text().splitlines()[-30:] if job_log.exists() else []
        decisions = [x for x in log if "service.cycle" not in x][-40:]
        return "\n".join([*lines[-40:], *decisions, "-- job log --", *out])

    try:
        run = run_scenario(
            Settings(),
            cluster,
            tmp_path / "run",
            policy="evict",
            steps=100_000,  # runs until the test has seen the requeue
            slow_at=40,
            quota_pct=quota,
            redis_db=10,
            say=lines.append,
            timeout_s=600,
            script=REPO / "examples" / "stack.sbatch",
            submit_args=submit_args,
            job_env={"SCRIPT": script, "CKPT_EVERY": str(every)},
            until=_requeued,
            # The stack's telemetry is under test, not how long the shipped policy doubts a
            # slowdown (test_demo runs that): node3 is slow by construction, acted on at once.
            policy_dir=copy_policies(tmp_path / "policies"),
        )
    except DevClusterError as exc:
        pytest.fail(f"{exc}\n{seen()}")
    assert run.onset_ts is not None, seen()
    evictions = [d for d in run.decisions if d.get("action") == "evict"]
    assert [d["node"] for d in evictions] == ["node3"], seen()
    assert evictions[0]["cause"] == "compute", seen()
    assert _requeued(run.job), seen()
    assert "node3" in expand_hostlist(run.job.get("ExcNodeList", "")), seen()
    assert "node3" not in expand_hostlist(run.job["NodeList"]), seen()
    check_why(run)
