"""Fault tolerance of the policy service on the real cluster: the service SIGKILLed after each
step of an eviction, scontrol timing out, slurmctld restarting mid-eviction, Redis restarting.

Faults are injected by a wrapper around the real ``scontrol`` (``slurm.bin_dir``): when its
argv matches, it fires once, before or after running the real command. Afterwards, always: the
job runs again without the slow node, requeued exactly once, not held by us, and every
decision in the audit has reached a final state.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_plugin.config import load_settings
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.service.factory import build
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.store import credentials
from tests.integration.cluster_jobs import submit
from tests.integration.conftest import (
    REPO,
    SERVICE_LOG,
    RedisServer,
    Slurm,
    acl_users,
    free_port,
    slurmctld_pid,
    stop_slurmctld,
    wait_cycles,
    wait_for,
    wait_gone,
)

WRAPPER = """#!/bin/sh
# Test wrapper around the real scontrol; fires an armed fault once.
dir="$(dirname "$0")"
hit=no
case " $* " in *" {match}"*) mv "$dir/armed" "$dir/fired" 2>/dev/null && hit=yes ;; esac
if [ "$hit" = yes ] && [ "{when}" = before ]; then {action}; fi
echo "$*" >> "$dir/calls.log"
{real} "$@"
rc=$?
if [ "$hit" = yes ] && [ "{when}" = after ]; then {action}; fi
exit $rc
"""

KILL_SERVICE = "kill -9 $PPID; sleep 5"
HANG = "sleep 20"


@dataclass
class Faults:
    """The wrapper directory, armed with one fault."""

    directory: Path

    def arm(self, match: str, when: str, action: str) -> None:
        real = shutil.which("scontrol")
        assert real is not None
        script = self.directory / "scontrol"
        script.write_text(WRAPPER.format(match=match, when=when, action=action, real=real))
        script.chmod(0o755)
        (self.directory / "armed").touch()

    @property
    def fired(self) -> bool:
        return (self.directory / "fired").exists()

    def calls_after(self, word: str) -> int:
        """Slurm calls (scontrol's, squeue's) made after the first ``word`` call."""
        log = self.directory / "calls.log"
        words = [line.split()[:1] for line in log.read_text().splitlines()] if log.exists() else []
        return len(words) - 1 - words.index([word]) if [word] in words else 0

    def calls(self, word: str) -> int:
        log = self.directory / "calls.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return sum(1 for line in lines if line.split()[:1] == [word])


@pytest.fixture
def faults(tmp_path: Path) -> Iterator[Faults]:
    directory = tmp_path / "bin"
    directory.mkdir()
    for name in ("squeue", "sinfo", "sbatch", "scancel"):
        real = shutil.which(name)
        assert real is not None, name
        (directory / name).symlink_to(real)
    # squeue is logged too: on Slurm 22.05 the service reads a job with it, and its first read
    # after a fault can be the only call it makes to a dead controller.
    (directory / "squeue").unlink()
    (directory / "squeue").write_text(
        f'#!/bin/sh\necho "squeue $*" >> "{directory / "calls.log"}"\n'
        f'exec "{shutil.which("squeue")}" "$@"\n'
    )
    (directory / "squeue").chmod(0o755)
    yield Faults(directory)
    # A wrapper still sleeping in its fault would run its scontrol after the test's clean-up
    # (a requeuehold of a cancelled job): stop them first.
    subprocess.run(["pkill", "-f", str(directory / "scontrol")], check=False)  # noqa: S607


class Services:
    """Starts `straggler serve` processes (a new one after each crash)."""

    def __init__(self, env: dict[str, str], log_dir: Path, item: pytest.Item) -> None:
        self.env = env
        self.log_dir = log_dir
        self.item = item
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        path = self.log_dir / f"service-{len(self.procs)}.log"
        self.item.stash[SERVICE_LOG] = path  # a failing test shows the newest service's log
        log = path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurm_plugin.cli.main", "--log-level", "info", "serve", *args],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=log,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def failed_cycles(self) -> int:
        """Cycles the newest service logged as failed (a dependency away, say)."""
        if not self.procs:
            return 0
        log = self.log_dir / f"service-{len(self.procs) - 1}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return sum(1 for line in lines if "service.cycle_failed" in line)

    def wait_failed_cycles(self, more: int, what: str, timeout_s: float = 30) -> None:
        """Wait until the service has met ``what`` in ``more`` further cycles: the observable
        event before asserting on how it copes, instead of a fixed sleep."""
        target = self.failed_cycles() + more
        wait_for(
            lambda: self.failed_cycles() >= target, timeout_s, f"{more} cycles failing on {what}"
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def services(
    env: dict[str, str], faults: Faults, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Services]:
    values = {
        **env,
        "STRAGGLER_SLURM_BIN_DIR": str(faults.directory),
        "STRAGGLER_SLURM_COMMAND_TIMEOUT_S": "3",
        "STRAGGLER_SERVICE_ACTION_GRACE_S": "6",
    }
    started = Services(values, tmp_path, request.node)
    yield started
    started.stop()


def assert_clean_outcome(slurm: Slurm, state: ServiceState, job: str, faults: Faults) -> None:
    """Requeued once without node3, running, not held; no decision left open."""
    try:
        wait_for(
            lambda: slurm.job(job)["Restarts"] != "0" and slurm.job(job)["JobState"] == "RUNNING",
            90,
            "the job to run again after its eviction",
        )
    except pytest.fail.Exception:
        nodes = slurm.run("sinfo", "-N", "-o", "%N %T %E").stdout
        pytest.fail(f"the job did not run again: {slurm.job(job)}; nodes: {nodes}")
    record = slurm.job(job)
    assert record["Restarts"] == "1", record
    assert record["Priority"] != "0"
    assert "node3" in record.get("ExcNodeList", "")
    assert "node3" not in slurm.job_nodes(job)
    wait_for(lambda: not state.open_decisions(), 60, "every decision to reach a final state")
    decisions = state.job_decisions(job)
    finals = {d.get("state") for d in decisions}
    assert finals <= {"verified", "abandoned", "failed", "recorded"}, decisions
    assert [d for d in decisions if d.get("state") == "verified"], decisions
    assert faults.calls("requeuehold") == 1, "the job was requeued more than once"


STEPS = [
    # (argv match, when, what the test checks happened)
    pytest.param("requeuehold", "before", id="killed-before-requeuehold"),
    pytest.param("requeuehold", "after", id="killed-after-requeuehold"),
    pytest.param("ExcNodeList", "after", id="killed-after-exclude"),
    pytest.param("release", "after", id="killed-after-release"),
]


@pytest.mark.parametrize(("match", "when"), STEPS)
def test_service_killed_during_an_eviction(
    slurm: Slurm,
    job_dir: Path,
    state: ServiceState,
    services: Services,
    faults: Faults,
    match: str,
    when: str,
) -> None:
    """SIGKILL at each step of the eviction; the next service finishes or abandons it."""
    faults.arm(match, when, KILL_SERVICE)
    first = services.start()
    job = submit(slurm, job_dir, "evict")
    wait_for(lambda: faults.fired, 90, f"the fault at {when} {match}")
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    services.start()
    assert_clean_outcome(slurm, state, job, faults)


@pytest.mark.parametrize(
    "when", [pytest.param("after", id="effect-then-hang"), pytest.param("before", id="hang")]
)
def test_scontrol_timing_out_leaves_no_job_held(
    slurm: Slurm,
    job_dir: Path,
    state: ServiceState,
    services: Services,
    faults: Faults,
    when: str,
) -> None:
    """requeuehold hangs past the command timeout, after or before taking effect: the
    service finds out from Slurm and finishes (or gives up and tries again)."""
    faults.arm("requeuehold", when, HANG)
    service = services.start()
    job = submit(slurm, job_dir, "evict")
    wait_for(lambda: faults.fired, 90, "the hanging requeuehold")
    assert_clean_outcome(slurm, state, job, faults)
    assert service.poll() is None, "the service died"
    notes = [d.get("error", "") + d.get("note", "") for d in state.job_decisions(job)]
    assert any("timed out" in n for n in notes), notes


@pytest.mark.parametrize(
    ("match", "word"),
    [("requeuehold", "requeuehold"), ("ExcNodeList", "update"), ("release", "release")],
)
def test_slurmctld_restarted_during_an_eviction(
    cluster: DevCluster,
    slurm: Slurm,
    job_dir: Path,
    state: ServiceState,
    services: Services,
    faults: Faults,
    match: str,
    word: str,
) -> None:
    """slurmctld is stopped right after a step of the eviction (as a restart does: SIGTERM,
    state saved) and comes back seconds later; the steps after it wait for it."""
    pid = slurmctld_pid(cluster)
    # The wrapper waits for the controller to exit, unless the service's own time limit on
    # scontrol ends the wrapper first: the test waits for it below in any case.
    stop = f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.1; done"
    faults.arm(match, "after", stop)
    service = services.start()
    job = submit(slurm, job_dir, "evict")
    try:
        wait_for(lambda: faults.fired, 90, "slurmctld to be killed")
        # The observable event: the service's next Slurm call, made to the dead controller (an
        # outage far longer than that drains the job's nodes with "Kill task failed").
        wait_for(lambda: faults.calls_after(word) >= 1, 30, "a call to the dead controller")
    finally:  # never leave the next tests without a controller (nor this job running)
        if faults.fired:
            wait_gone(pid, "the stopped slurmctld to exit")
        cluster.up()
    assert_clean_outcome(slurm, state, job, faults)
    assert service.poll() is None, "the service died"
    # Issue 38, item 8: the audit says what Slurm did: the eviction it carried out is
    # verified, never failed.
    evictions = [d for d in state.job_decisions(job) if d.get("action") == "evict"]
    assert [d.get("state") for d in evictions] == ["verified"], evictions


AOF = ("--appendonly", "yes", "--appendfsync", "always")


@pytest.fixture
def aof_redis(
    tmp_path: Path, services: Services, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RedisServer]:
    """A private Redis with an fsync'ed append-only file (so a restart keeps its data, as a
    production Redis would), used by the service and by the job's ranks."""
    server = RedisServer(tmp_path / "redis", free_port())
    server.directory.mkdir()
    server.start(*AOF)
    services.env = {**services.env, "STRAGGLER_REDIS_URL": server.url}
    monkeypatch.setenv("STRAGGLER_REDIS_URL", server.url)  # the job's ranks publish here
    yield server
    server.stop()


def test_redis_restarted_while_the_service_runs(
    slurm: Slurm,
    job_dir: Path,
    services: Services,
    faults: Faults,
    aof_redis: RedisServer,
    tmp_path: Path,
) -> None:
    """Redis goes away for a few seconds while ranks publish and the service cycles: the
    service survives, cycles again and still decides about the slow node."""
    faults.arm("no-such-command", "after", "true")
    service = services.start()
    job = submit(slurm, job_dir, "observe")  # observe: detection happens, nothing acts
    slurm.wait_job(job, "RUNNING")
    store = build(load_settings(redis={"url": aof_redis.url}))[2]
    wait_for(lambda: bool(store.latest_steps(job, entries=1)), 60, "the ranks to publish")
    aof_redis.stop()
    services.wait_failed_cycles(2, "Redis being away")
    aof_redis.start(*AOF)
    assert service.poll() is None, "the service died with Redis"
    st = build(load_settings(redis={"url": aof_redis.url}))[1]
    beat = st.last_heartbeat()
    wait_for(
        lambda: (st.last_heartbeat() or {}).get("ts") != (beat or {}).get("ts"),
        20,
        "the service to cycle again",
    )
    log = (tmp_path / "service-0.log").read_text()
    assert "Redis" in log or "redis" in log
    wait_for(
        lambda: any(d.get("node") == "node3" for d in st.job_decisions(job)),
        60,
        "a decision about node3 after the restart",
    )
    assert slurm.job(job)["Restarts"] == "0"  # observe never acts
    assert not st.open_decisions()


def test_redis_restarted_in_the_middle_of_an_eviction(
    slurm: Slurm,
    job_dir: Path,
    services: Services,
    faults: Faults,
    aof_redis: RedisServer,
) -> None:
    """Redis dies right after the requeuehold, before the service could record it: the
    decision in Redis still says 'planned' while Slurm holds the job. Once Redis is back the
    service sees the hold in Slurm and finishes the eviction, without a second requeue."""
    pidfile = aof_redis.directory / f"redis-{aof_redis.port}.pid"
    faults.arm("requeuehold", "after", f'kill -9 "$(cat {pidfile})"')
    service = services.start()
    job = submit(slurm, job_dir, "evict")
    wait_for(lambda: faults.fired, 90, "Redis to be killed after the requeuehold")
    services.wait_failed_cycles(2, "Redis being away")
    assert slurm.job(job)["Priority"] == "0", "the job should be held while Redis is away"
    aof_redis.start(*AOF)
    st = build(load_settings(redis={"url": aof_redis.url}))[1]
    assert_clean_outcome(slurm, st, job, faults)
    assert service.poll() is None, "the service died with Redis"


@pytest.fixture
def bare_redis(
    tmp_path: Path, services: Services, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RedisServer]:
    """A private Redis without persistence: a restart loses everything."""
    server = RedisServer(tmp_path / "bare-redis", free_port())
    server.directory.mkdir()
    server.start("--appendonly", "no", "--save", "")
    services.env = {**services.env, "STRAGGLER_REDIS_URL": server.url}
    monkeypatch.setenv("STRAGGLER_REDIS_URL", server.url)
    yield server
    server.stop()


def test_redis_without_data_restarted_mid_eviction(
    slurm: Slurm,
    job_dir: Path,
    services: Services,
    faults: Faults,
    bare_redis: RedisServer,
) -> None:
    """Issue 18 item 1: Redis (no AOF) dies right after the requeuehold and comes back empty.
    Slurm still holds the job with our eviction mark; within two cycles of the restart the
    service releases it (Slurm is the source of truth) and the audit says why."""
    pidfile = bare_redis.directory / f"redis-{bare_redis.port}.pid"
    faults.arm("requeuehold", "after", f'kill -9 "$(cat {pidfile})"')
    service = services.start()
    job = submit(slurm, job_dir, "evict")
    wait_for(lambda: faults.fired, 90, "Redis to be killed after the requeuehold")
    services.wait_failed_cycles(1, "Redis being away")
    assert slurm.job(job)["Priority"] == "0", "the job should be held while Redis is away"
    bare_redis.start("--appendonly", "no", "--save", "")
    st = build(load_settings(redis={"url": bare_redis.url}))[1]
    wait_cycles(st, 2)
    record = slurm.job(job)
    assert record["Priority"] != "0", record
    entry, verified = [e for e in st.audit() if e.get("action") == "release"]
    assert (entry["job_id"], entry["by"]) == (job, "reconcile")
    assert (verified["id"], verified["state"]) == (entry["id"], "verified")  # read back
    assert marks.decision_of(record["AdminComment"].rsplit(" | ", 1)[-1]) == entry["of"]
    wait_for(lambda: slurm.job(job)["JobState"] == "RUNNING", 60, "the job to run again")
    assert faults.calls("requeuehold") == 1
    assert service.poll() is None, "the service died with Redis"


@pytest.mark.parametrize(("policy", "args"), [("observe", ()), ("evict", ("--dry-run",))])
def test_observe_and_dry_run_change_nothing_on_the_cluster(
    slurm: Slurm,
    job_dir: Path,
    state: ServiceState,
    services: Services,
    faults: Faults,
    policy: str,
    args: tuple[str, ...],
) -> None:
    """Issue 13 on the real cluster: a job with a slow node under observe, and one under evict
    with the service in --dry-run, through a pause window and after it: the scontrol wrapper
    sees no requeuehold, requeue, release, ExcNodeList, node update or AdminComment note: no
    change at all."""
    faults.arm("no-such-command", "after", "true")  # the wrapper only counts
    services.start(*args)
    job = submit(slurm, job_dir, policy)
    slurm.wait_job(job, "RUNNING")
    wait_for(lambda: bool(state.job_decisions(job)), 90, "a decision about node3")
    state.pause(600)
    wait_cycles(state, 3)
    state.resume()
    wait_cycles(state, 3)
    log = faults.directory / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    changing = [
        c
        for c in calls
        if c.split()[:1] in (["requeuehold"], ["requeue"], ["release"], ["hold"])
        or "ExcNodeList=" in c
        or "NodeName=" in c
    ]
    assert changing == []
    notes = [c for c in calls if "AdminComment=" in c]
    assert notes == []
    assert slurm.job(job)["Restarts"] == "0"


def test_slurmctld_stopped_for_30_seconds_forgets_and_revokes_nothing(
    cluster: DevCluster,
    slurm: Slurm,
    job_dir: Path,
    services: Services,
    faults: Faults,
    tmp_path: Path,
    private_redis: RedisServer,
) -> None:
    """Issue 18 item 2 on the real cluster: slurmctld is stopped (SIGTERM) for 30 s while a job
    runs, with job credentials on. Every cycle of the outage fails as "Slurm unknown"; the
    job's credential and the service's state for it stay, the CLI says Slurm is unreachable on
    one line, and once slurmctld is back the service leads again and still knows the job.
    Job credentials need database 0: a Redis of the test's own."""
    faults.arm("no-such-command", "after", "true")
    url = private_redis.url
    services.env = {
        **services.env,
        "STRAGGLER_TELEMETRY_JOB_CREDENTIALS": "true",
        "STRAGGLER_REDIS_URL": url,
    }
    state = build(load_settings(redis={"url": url}))[1]
    service = services.start()
    job = submit(slurm, job_dir, "observe")  # observe: detection happens, nothing acts
    slurm.wait_job(job, "RUNNING")
    credentials.issue(state.client, job)  # what the prolog does with job_credentials = true
    user = credentials.username(job)
    wait_for(lambda: "steps_cursor" in state.job(job), 60, "the service to read the job")
    before = dict(state.job(job))
    signal_sent = time.monotonic()
    stop_slurmctld(cluster)
    cli = subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli.main", "jobs"],
        env={**services.env, "STRAGGLER_SLURM_COMMAND_TIMEOUT_S": "10"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = (cli.stdout + cli.stderr).strip().splitlines()
    assert cli.returncode != 0, lines
    assert len(lines) == 1, lines
    assert "Traceback" not in cli.stderr
    services.wait_failed_cycles(3, "slurmctld being away", timeout_s=60)
    while time.monotonic() - signal_sent < 30:
        assert user in acl_users(state.client), "a credential was revoked while Slurm was away"
        time.sleep(1)
    after = state.job(job)
    assert int(after["steps_cursor"].split("-")[0]) >= int(before["steps_cursor"].split("-")[0])
    assert set(before) <= set(after), "the service dropped its state for the job"
    cluster.up()
    beat = state.last_heartbeat()
    wait_for(
        lambda: (state.last_heartbeat() or {}).get("ts") != (beat or {}).get("ts"),
        60,
        "the service to cycle again",
    )
    assert (state.last_heartbeat() or {}).get("jobs") == 1
    assert slurm.job(job)["JobState"] == "RUNNING"
    assert user in acl_users(state.client)
    log = (tmp_path / "service-0.log").read_text(errors="replace")
    assert "credentials_revoked" not in log
    assert service.poll() is None, "the service died with slurmctld"
