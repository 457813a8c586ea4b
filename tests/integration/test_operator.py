"""The service as its own account through slurmdbd: without AdminLevel=Operator Slurm refuses
it; with it the service evicts, drains and resumes (the dev cluster runs with accounting)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_plugin.devcluster import DevCluster
from slurm_plugin.devcluster.accounting import SERVICE_ACCOUNT
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from tests.integration.cluster_jobs import RAILS, one_earlier_incident, submit
from tests.integration.conftest import SERVICE_LOG, Slurm, copy_policies, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def accounting(cluster: DevCluster) -> DevCluster:
    """The cluster with slurmdbd (`make test` starts it so; a plain `up` keeps it)."""
    if not cluster.accounting_on:
        cluster.up(accounting=True)
    return cluster


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A directory the service account can read (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="stg-operator-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def account_bin(shared_dir: Path) -> Path:
    """The package installed (not editable) in a venv of the system's Python, as the deploy
    guide installs it: the tests' own interpreter may live where the account cannot read."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    assert system_python, "no system python3 (apt-get install python3-venv)"
    venv = shared_dir / "venv"
    subprocess.run([system_python, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return venv / "bin"


def _as_account(env: dict[str, str], *argv: str) -> list[str]:
    """argv run as the service account with ``env``'s settings: setpriv execs (runuser would
    fork, and killing it would leave the service running)."""
    keep = {k: v for k, v in env.items() if k.startswith(("STRAGGLER_", "SLURM_CONF"))}
    return [
        "setpriv",
        f"--reuid={SERVICE_ACCOUNT}",
        f"--regid={SERVICE_ACCOUNT}",
        "--init-groups",
        "env",
        "-i",
        "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
        *(f"{k}={v}" for k, v in keep.items()),
        *argv,
    ]


def _scontrol_as_account(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _as_account(env, "scontrol", *args),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_slurm_refuses_the_account_without_operator_and_obeys_it_with(
    accounting: DevCluster, slurm: Slurm, job_dir: Path, env: dict[str, str]
) -> None:
    """What each AdminLevel lets the account do, as slurmctld enforces it: None may not touch
    another user's job; Operator may requeue-hold and release it (as soon as slurmdbd tells
    slurmctld) but may neither drain a node nor set a job's AdminComment."""
    accounting.accounting.add_user(SERVICE_ACCOUNT, admin_level="None")
    job = submit(slurm, job_dir, "observe", nodes=2)
    slurm.wait_job(job, "RUNNING")
    try:
        wait_for(
            lambda: _scontrol_as_account(env, "requeuehold", job).returncode != 0,
            30,
            "Slurm to refuse the account without AdminLevel",
        )
        refused = _scontrol_as_account(env, "requeuehold", job)
        assert "denied" in (refused.stderr + refused.stdout).lower(), refused.stderr
        drain = _scontrol_as_account(
            env, "update", "NodeName=node4", "State=DRAIN", "Reason=straggler: probe"
        )
        assert drain.returncode != 0
        assert slurm.node_state("node4") not in {"drained", "draining"}

        accounting.accounting.add_user(SERVICE_ACCOUNT, admin_level="Operator")
        assert accounting.accounting.admin_level(SERVICE_ACCOUNT) == "Operator"
        wait_for(
            lambda: _scontrol_as_account(env, "requeuehold", job).returncode == 0,
            30,
            "Slurm to let the Operator requeue the job",
        )
        assert slurm.job(job)["Priority"] == "0"
        assert _scontrol_as_account(env, "release", job).returncode == 0
        slurm.wait_job(job, "RUNNING")
        # Neither a node's state nor a job's AdminComment (where the service keeps its marks)
        # is an Operator's to change: both need AdminLevel=Admin.
        reason = "Reason=straggler: operator probe"
        drain = _scontrol_as_account(env, "update", "NodeName=node4", "State=DRAIN", reason)
        assert drain.returncode != 0
        assert "invalid user id" in drain.stderr.lower(), drain.stderr
        assert slurm.node_state("node4") not in {"drained", "draining"}
        denied = _scontrol_as_account(env, "update", f"JobId={job}", "AdminComment=x")
        assert denied.returncode != 0
        assert "denied" in denied.stderr.lower(), denied.stderr
    finally:
        slurm.cancel_all()


def test_the_service_as_its_own_account_drains_resumes_and_evicts_with_admin(
    accounting: DevCluster,
    slurm: Slurm,
    job_dir: Path,
    env: dict[str, str],
    state: ServiceState,
    shared_dir: Path,
    account_bin: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """`straggler serve` as the service account, never root nor SlurmUser. With
    AdminLevel=Operator it does not evict (Slurm refuses our mark on the job: AdminComment is
    for administrators, and a job we cannot mark is never touched) and its drain of node3 (slow
    again after an earlier incident) is refused. With AdminLevel=Admin the same account evicts
    the job, marks it, and drains node3 with our reason; `node forgive`, as the account,
    resumes it."""
    accounting.accounting.add_user(SERVICE_ACCOUNT, admin_level="Operator")
    service_env = {
        **env,
        **RAILS,
        "STRAGGLER_SERVICE_POLICY_DIR": str(copy_policies(shared_dir / "policies")),
    }

    def drains(final: str) -> list[dict[str, str]]:
        entries = [a for a in state.audit() if a.get("action") == "drain"]
        return [a for a in entries if a.get("node") == "node3" and a.get("state") == final]

    one_earlier_incident(state, "node3")
    job = submit(slurm, job_dir, "evict-aggressive")
    slurm.wait_job(job, "RUNNING")
    request.node.stash[SERVICE_LOG] = tmp_path / "service.log"
    straggler = str(account_bin / "straggler")

    def evictions(final: str) -> list[dict[str, str]]:
        found = [d for d in state.job_decisions(job) if d.get("action") == "evict"]
        return [d for d in found if d.get("state") == final]

    with _service(service_env, straggler, tmp_path / "service.log"):
        wait_for(
            lambda: bool(evictions("failed")) and bool(drains("failed")),
            120,
            "the eviction and the drain refused, as Operator",
        )
    refused = evictions("failed")[0]
    assert "AdminLevel=Admin" in refused["error"]
    said = (tmp_path / "service.log").read_text()
    assert '"service.not_slurm_admin"' in said  # at start-up, before the first straggler
    assert "AdminLevel=Operator" in said
    assert "invalid user id" in drains("failed")[0].get("error", "").lower()
    assert slurm.node_state("node3") not in {"drained", "draining"}
    record = slurm.job(job)
    assert (record["JobState"], record["Restarts"]) == ("RUNNING", "0")
    assert not record.get("AdminComment")

    accounting.accounting.add_user(SERVICE_ACCOUNT, admin_level="Admin")
    wait_for(
        lambda: (
            _scontrol_as_account(env, "update", f"JobId={job}", "AdminComment=").returncode == 0
        ),
        30,
        "slurmctld to know the account as Admin",
    )
    one_earlier_incident(state, "node3")  # node3 becomes persistent again in the next incident
    with _service(service_env, straggler, tmp_path / "service-admin.log"):
        wait_for(
            lambda: (
                bool(evictions("verified")) and slurm.node_state("node3") in {"drained", "draining"}
            ),
            120,
            "the eviction and node3's drain, as Admin",
        )
    assert '"service.slurm_rights"' in (tmp_path / "service-admin.log").read_text()
    record = slurm.job(job)
    assert record["Restarts"] == "1"
    assert "node3" in record.get("ExcNodeList", "")
    assert marks.is_ours(record.get("AdminComment", ""))
    assert marks.is_ours(slurm.node("node3")["Reason"])

    forgive = subprocess.run(
        _as_account(service_env, straggler, "node", "forgive", "node3"),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert forgive.returncode == 0, forgive.stderr
    assert "resumed" in forgive.stdout
    wait_for(lambda: slurm.node_state("node3") in {"idle", "mixed", "allocated"}, 30, "node3 back")
    slurm.cancel_all()
    accounting.accounting.add_user(SERVICE_ACCOUNT, admin_level="None")


@contextlib.contextmanager
def _service(env: dict[str, str], straggler: str, log_path: Path) -> Iterator[None]:
    """`straggler serve` as the service account while the block runs."""
    with log_path.open("wb") as log:
        service = subprocess.Popen(
            _as_account(env, straggler, "--log-level", "info", "serve"),
            stdout=log,
            stderr=log,
        )
        try:
            yield
        finally:
            service.kill()
            service.wait()
