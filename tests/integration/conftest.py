"""Fixtures that give tests the real local Slurm cluster and a private Redis database."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from slurm_plugin.config import load_settings
from slurm_plugin.demo.run import start_service
from slurm_plugin.devcluster import DevCluster, procs
from slurm_plugin.errors import CommandError
from slurm_plugin.service.factory import build
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.parsers import expand_hostlist, parse_scontrol_record
from slurm_plugin.slurm.release import TESTED
from slurm_plugin.slurm.runner import CommandResult, run_command
from slurm_plugin.store.telemetry_store import ping

#: Set by contrib/test/tiers when it runs the cluster tests on this many dev clusters side by
#: side (pytest-xdist, a file's tests on one worker): worker K uses the cluster of lane K.
LANES_ENV = "STRAGGLER_TEST_CLUSTER_LANES"


def _take_lane() -> None:
    """This xdist worker's dev cluster (``STRAGGLER_DEVCLUSTER_LANE``, which the services,
    jobs and commands the tests start inherit); lane 0 without lanes or outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    lanes = os.environ.get(LANES_ENV, "")
    if worker.startswith("gw") and worker[2:].isdigit() and lanes.isdigit() and int(lanes) > 1:
        os.environ["STRAGGLER_DEVCLUSTER_LANE"] = str(int(worker[2:]) % int(lanes))
        # A SLURM_CONF or STRAGGLER_REDIS_URL exported for lane 0 would win over the cluster's.
        inherited = {"SLURM_CONF", "STRAGGLER_REDIS_URL"} & set(os.environ)
        lane_env = DevCluster.from_settings(load_settings()).env()
        os.environ.update({k: v for k, v in lane_env.items() if k in inherited})


_take_lane()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it is true; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")


def wait_cycles(state: ServiceState, cycles: int = 2, timeout_s: float = 30) -> None:
    """Wait until the service finished ``cycles`` more cycles (its heartbeat moved on that
    often): the observable event before asserting that something did not happen."""
    seen: list[float] = []

    def moved() -> bool:
        beat = state.last_heartbeat()
        ts = beat.get("ts") if beat else None
        if isinstance(ts, int | float) and (not seen or ts != seen[-1]):
            seen.append(ts)
        return len(seen) > cycles

    wait_for(moved, timeout_s, f"{cycles} more service cycles")


@dataclass
class Slurm:
    """Runs Slurm's own commands against the dev cluster and cancels its jobs afterwards."""

    cluster: DevCluster
    jobs: list[str] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True) -> CommandResult:
        # The test's own settings (a private Redis database) win over the cluster defaults.
        env = {**self.cluster.env(), **os.environ}
        return run_command(list(argv), timeout_s=30, env=env, check=check)

    def sbatch(self, *args: str) -> str:
        job_id = self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]
        self.jobs.append(job_id)
        return job_id

    def job(self, job_id: str) -> dict[str, str]:
        return parse_scontrol_record(self.run("scontrol", "-o", "show", "job", job_id).stdout)

    def job_nodes(self, job_id: str) -> list[str]:
        return expand_hostlist(self.job(job_id).get("NodeList", ""))

    def node(self, name: str) -> dict[str, str]:
        return parse_scontrol_record(self.run("scontrol", "-o", "show", "node", name).stdout)

    def node_state(self, name: str) -> str:
        return self.run("sinfo", "-h", "-n", name, "-o", "%T").stdout.strip()

    def wait_job(self, job_id: str, state: str, timeout_s: float = 60) -> dict[str, str]:
        """Wait until the job is in ``state`` (RUNNING means: past its prolog too)."""

        def reached() -> bool:
            record = self.job(job_id)
            ok = record.get("JobState") == state
            return ok and not (state == "RUNNING" and record.get("Reason") == "Prolog")

        wait_for(reached, timeout_s, f"job {job_id} to be {state}")
        return self.job(job_id)

    def cancel_all(self) -> None:
        if self.jobs:
            self.run("scancel", *self.jobs, check=False)


@pytest.fixture(scope="session")
def cluster() -> Iterator[DevCluster]:
    """The dev cluster: reused when already up (make test starts it), else started here."""
    dev = DevCluster.from_settings(load_settings())
    release = dev.release()
    if not release.tested:
        pytest.fail(
            f"Slurm {release} is not a release this project has tested ({', '.join(TESTED)}): "
            "capture its output into tests/unit/golden, run make test-releases with it and add "
            "it to slurm_plugin.slurm.release.TESTED",
            pytrace=False,
        )
    started_here = not dev.status().ready
    dev.up(spank=True)  # idempotent; loads the SPANK plugin if the running cluster lacks it
    yield dev
    if started_here:
        dev.down()


@pytest.fixture
def slurm(cluster: DevCluster) -> Iterator[Slurm]:
    """Slurm commands against the cluster; the test's jobs and faults are cleaned up after it."""
    helper = Slurm(cluster)
    yield helper
    helper.cancel_all()
    cluster.clear_faults()

    def idle() -> bool:
        # A node can turn drained or down while the test's jobs end (a slurmd restarted by
        # the test answers late): resumed as often as it does, within the wait.
        states = {n: helper.node_state(n) for n in cluster.node_names}
        for node, state in states.items():
            if state.startswith(("drain", "down")):
                helper.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        return all(state == "idle" for state in states.values())

    try:
        wait_for(idle, 60, "every node to be idle again")
    except CommandError as exc:
        pytest.fail(f"Slurm did not answer after the test: {exc}\n{controller_diagnosis(cluster)}")
    except pytest.fail.Exception:

        def answer(*argv: str) -> str:
            try:
                return helper.run(*argv, check=False).stdout.strip()
            except CommandError:
                return f"{argv[0]} did not answer"

        nodes = answer("sinfo", "-N", "-h", "-o", "%N %T %E")
        jobs = answer("squeue", "-h", "-o", "%i %T %R")
        pytest.fail(
            f"nodes not idle 60 s after the test: {nodes}; jobs: {jobs or 'none'}\n"
            f"{controller_diagnosis(cluster)}"
        )


def controller_diagnosis(cluster: DevCluster, lines: int = 25) -> str:
    """Whether the cluster's slurmctld process lives, and the end of its log: what a failing
    cluster test prints, since the cluster's files are gone when the tier brings it down."""
    pid = procs.read_pid(cluster.base / "run" / "slurmctld.pid")
    logfile = cluster.base / "log" / "slurmctld.log"
    tail = logfile.read_text(errors="replace").splitlines()[-lines:] if logfile.exists() else []
    head = f"slurmctld pid {pid or 'none'} alive {procs.is_alive(pid)}; its log ends:"
    return "\n".join([head, *tail])


_DATABASES = itertools.cycle(range(1, 16))


@pytest.fixture
def redis_url(cluster: DevCluster) -> Iterator[str]:
    """A URL to a Redis database of the cluster's server that is empty for this test alone."""
    url = cluster.redis_url.rsplit("/", 1)[0] + f"/{next(_DATABASES)}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A directory the jobs (run as root on this machine) can write their output to."""
    tmp_path.chmod(0o777)
    return tmp_path


@dataclass
class RedisServer:
    """A private redis-server for tests that stop and restart it (not the cluster's)."""

    directory: Path
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        run_command(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--daemonize",
                "yes",
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "no",
                "--pidfile",
                str(self.directory / f"redis-{self.port}.pid"),
                "--logfile",
                str(self.directory / f"redis-{self.port}.log"),
                *extra,
            ],
            timeout_s=10,
        )
        wait_for(self.ping, 10, f"redis-server on port {self.port}")

    def ping(self) -> bool:
        return ping(self.url, timeout_s=0.5)

    def stop(self) -> None:
        from slurm_plugin.devcluster import procs  # noqa: PLC0415

        pid = procs.read_pid(self.directory / f"redis-{self.port}.pid")
        if pid is not None and procs.is_alive(pid):
            # SIGKILL: a crash is what the tests simulate, and a cluster node's orderly
            # shutdown takes seconds.
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not self.ping(), 10, f"redis-server on port {self.port} to stop")


def slurmctld_pid(cluster: DevCluster) -> int:
    """The pid of the cluster's running slurmctld (from its pid file)."""
    pid = procs.read_pid(cluster.base / "run" / "slurmctld.pid")
    assert pid is not None, "slurmctld has no pid file"
    return pid


def wait_gone(pid: int, what: str, timeout_s: float = 60) -> None:
    """Wait until process ``pid`` has exited. A slurmctld that was told to stop still holds its
    pid file while it saves its state and flushes accounting (seconds on a loaded machine):
    ``cluster.up()`` before it is gone takes it for running, and no controller is left."""
    wait_for(lambda: not procs.is_alive(pid), timeout_s, what)


def stop_slurmctld(cluster: DevCluster) -> int:
    """Stop the cluster's slurmctld as an admin's restart does (SIGTERM, state saved) and wait
    until it is gone; returns its pid. ``cluster.up()`` brings it back."""
    pid = slurmctld_pid(cluster)
    os.kill(pid, signal.SIGTERM)
    wait_gone(pid, "slurmctld to stop")
    return pid


def acl_users(client: Any) -> set[str]:
    """The Redis server's ACL user names (per-job credentials are ACL users)."""
    names = client.execute_command("ACL", "USERS")
    return {n.decode() if isinstance(n, bytes) else str(n) for n in names}


#: The control tests' stragglers are faults by construction (a node made slow for the whole
#: job): their copies of the shipped policies say so, so the first report is acted on. How a
#: passing burst is told from a fault is tested with the shipped values (test_transient.py,
#: tests/unit/test_decide.py).
FAULT_PRIOR = 0.99

#: A real training job's own minimum slowdown (its SPANK option) where ``FAULT_PRIOR`` makes
#: every flag a fault: a rank of another node lagging ~8 % for a second on these shared cores
#: was once acted on before node3's onset; node3 at a tenth of a CPU is several times slower.
NOT_NOISE = ("--straggler-min-slowdown=30",)


def copy_policies(dst: Path, persistent_prior: float | None = FAULT_PRIOR) -> Path:
    """The shipped policies in ``dst``, with ``persistent_prior`` set in each (None: as
    shipped)."""
    shutil.copytree(REPO / "policies", dst)
    if persistent_prior is not None:
        for path in dst.glob("*.toml"):
            text = path.read_text()
            assert "[actions]\n" in text, path
            path.write_text(
                text.replace("[actions]\n", f"[actions]\npersistent_prior = {persistent_prior}\n")
            )
    return dst


def free_port() -> int:
    """A TCP port on 127.0.0.1, below 55535, free together with port + 10000 (the Redis
    Cluster bus port)."""
    import random  # noqa: PLC0415
    import socket  # noqa: PLC0415

    for _ in range(200):
        port = random.randrange(20000, 55000)  # noqa: S311 - not cryptographic
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair found")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A started private redis-server, stopped after the test."""
    server = RedisServer(tmp_path, free_port())
    server.start()
    yield server
    server.stop()


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(
    cluster: DevCluster, redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> dict[str, str]:
    """Settings for the service, the CLI and the jobs: this test's Redis database and a copy
    of the shipped policies (tests may add one; the service re-reads them every cycle)."""
    policy_dir = copy_policies(tmp_path / "policies")
    values = {
        **cluster.env(),
        "STRAGGLER_REDIS_URL": redis_url,
        "STRAGGLER_SERVICE_POLICY_DIR": str(policy_dir),
        "STRAGGLER_SERVICE_INTERVAL_S": "1",
        "STRAGGLER_TELEMETRY_FLUSH_INTERVAL_S": "0.5",
        "PYTHONPATH": str(REPO),
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **values}


@pytest.fixture
def state(env: dict[str, str]) -> ServiceState:
    """The service's Redis state, as the CLI sees it."""
    return build(load_settings())[1]


SERVICE_LOG = pytest.StashKey[Path]()
#: Lines the service writes every cycle: left out of a failure's log but for the last few.
_ROUTINE = ('"service.cycle"', '"service.records_ignored"')


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test that ran the service shows the end of the service's log: in CI, on a
    release's chroot, it is the only account of what the service saw and did."""
    report = yield
    path = item.stash.get(SERVICE_LOG, None)
    if report.when == "call" and report.failed and path is not None and path.exists():
        lines = path.read_text(errors="replace").splitlines()
        routine = [line for line in lines if any(e in line for e in _ROUTINE)]
        telling = [line for line in lines if not any(e in line for e in _ROUTINE)]
        report.sections.append(
            (
                "service log (all but routine lines, then the last routine ones)",
                "\n".join(telling[-80:] + routine[-6:]),
            )
        )
    return report


@pytest.fixture
def service(
    env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[subprocess.Popen[bytes]]:
    """`straggler serve` as a real process; stopped after the test."""
    request.node.stash[SERVICE_LOG] = tmp_path / "service.log"
    proc, log = start_service(env, tmp_path / "service.log")
    yield proc
    proc.kill()
    proc.wait()
    log.close()


def install_prolog(
    cluster: DevCluster, base: Path, redis_url: str, faults: dict[str, object]
) -> Path:
    """Wire our prolog into the cluster with fake GPUs (``faults`` per node) and a fake IB
    tree; returns the target script. Call ``cluster.up()`` to go back to the plain dispatcher."""
    import json  # noqa: PLC0415

    from slurm_plugin.devcluster.fake_prolog import write_bin  # noqa: PLC0415
    from slurm_plugin.devcluster.settings import FAKE_NVML_ENV  # noqa: PLC0415
    from slurm_plugin.testing import build_ib_tree  # noqa: PLC0415

    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    (base / "gpus.json").write_text(json.dumps({"default": {"gpus": 8}, "nodes": faults}))
    build_ib_tree(base / "root", 8)
    (base / "config.toml").write_text(
        f'[redis]\nurl = "{redis_url}"\n[health]\n'
        f'sysfs_root = "{base / "root"}"\n'
        f'state_dir = "{base / "state"}"\n'
        "expected_gpus = 8\nexpected_hcas = 8\nexpected_ib_rate_gbps = 400\n"
    )
    target = base / "run-prolog"
    target.write_text(
        "#!/bin/sh\n"
        f"export STRAGGLER_CONFIG={base / 'config.toml'}\n"
        f"export {FAKE_NVML_ENV}={base / 'gpus.json'}\n"
        f"export STRAGGLER_PROLOG_BIN={write_bin(base / 'prolog-bin')}\n"
        f"exec {REPO / 'prolog' / 'straggler-prolog.sh'}\n"
    )
    target.chmod(0o755)
    cluster.up(prolog=target)
    return target
