"""Trust: TLS with a self-signed certificate, Redis ACLs, and per-job credentials issued by the
prolog, used by a job running as another user, and revoked by the epilog."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest
import redis

from slurm_plugin.devcluster import DevCluster, procs
from slurm_plugin.model import keys
from slurm_plugin.service.evidence import gather_evidence
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.runner import run_command
from slurm_plugin.store import credentials, nodes, registration
from slurm_plugin.store.nodes import NodeRecord
from slurm_plugin.store.telemetry_store import TelemetryStore, Tls, connect, ping
from tests.integration.conftest import REPO, RedisServer, Slurm, free_port, wait_for


@dataclass
class SecureRedis(RedisServer):
    """redis-server on TLS only, the default user off, one admin user."""

    password: str = ""
    clients: list[redis.Redis] = field(default_factory=list)

    @property
    def cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def url(self) -> str:
        return f"rediss://admin:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def tls(self) -> Tls:
        return Tls(self.cert)

    def ping(self) -> bool:
        return ping(self.url, timeout_s=0.5, tls=self.tls)

    def admin(self) -> redis.Redis:
        client = connect(self.url, tls=self.tls, decode=True, retries=0)
        assert isinstance(client, redis.Redis)
        self.clients.append(client)
        return client

    def stop(self) -> None:
        """Kill the server and wait for its process to go (not for PINGs to fail: a TLS
        handshake with a dying server makes redis-py leak the half-open SSL socket)."""
        for client in self.clients:
            client.close()
        pid = procs.read_pid(self.directory / f"redis-{self.port}.pid")
        if pid is not None and procs.is_alive(pid):
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not procs.is_alive(pid), 10, "the TLS redis-server to stop")


def acl_user(admin: redis.Redis, job_id: str) -> object:
    """ACL GETUSER of the job's user (None once deleted)."""
    return admin.execute_command("ACL", "GETUSER", credentials.username(job_id))  # type: ignore[no-untyped-call]


def _try_ping(url: str, tls: Tls | None = None) -> None:
    """PING once with a fresh client, closed whatever happens."""
    client = connect(url, tls=tls, retries=0, timeout_s=1)
    try:
        client.ping()
    finally:
        client.close()


def make_certificate(directory: Path) -> None:
    """A self-signed certificate for 127.0.0.1 (also its own CA)."""
    run_command(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(directory / "server.key"), "-out", str(directory / "server.pem"),
        ],
        timeout_s=30,
    )  # fmt: skip
    (directory / "server.pem").chmod(0o644)


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    """A directory every user can traverse (pytest's own tmp_path is private to root): the
    job's user must reach the CA certificate and its credential file under it."""
    path = Path(tempfile.mkdtemp(prefix="straggler-security-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def secure_redis(shared: Path) -> Iterator[SecureRedis]:
    directory = shared / "redis"
    directory.mkdir()
    directory.chmod(0o755)
    make_certificate(directory)
    server = SecureRedis(directory, free_port(), password=secrets.token_hex(16))
    server.start(
        "--port", "0", "--tls-port", str(server.port),
        "--tls-cert-file", str(server.cert), "--tls-key-file", str(directory / "server.key"),
        "--tls-ca-cert-file", str(server.cert), "--tls-auth-clients", "no",
        "--user", "default", "off",
        "--user", "admin", "on", f">{server.password}", "~*", "&*", "+@all",
    )  # fmt: skip
    yield server
    server.stop()


def test_tls_and_acls_refuse_strangers(secure_redis: SecureRedis) -> None:
    """Only a client that trusts the certificate and has the admin password gets in."""
    assert secure_redis.admin().ping()
    port = secure_redis.port
    url = secure_redis.url
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        _try_ping(url)  # the system trust store does not know our certificate
    with pytest.raises(redis.ConnectionError):
        _try_ping(f"redis://127.0.0.1:{port}/0")  # plain text to the TLS port
    with pytest.raises(redis.AuthenticationError):
        _try_ping(f"rediss://127.0.0.1:{port}/0", secure_redis.tls)  # default user is off
    with pytest.raises(redis.AuthenticationError):
        _try_ping(f"rediss://admin:wrong@127.0.0.1:{port}/0", secure_redis.tls)


def _wire_hooks(cluster: DevCluster, base: Path, server: SecureRedis) -> Path:
    """Our prolog and epilog with a root-only settings file holding the admin credential."""
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    config = base / "admin.toml"
    config.write_text(
        f'[redis]\nurl = "{server.url}"\ntls_ca_file = "{server.cert}"\n'
        f'[telemetry]\njob_credentials = true\njob_credentials_dir = "{base / "jobs"}"\n'
        f'[health]\ngpu = "off"\nstate_dir = "{base / "state"}"\n'
    )
    config.chmod(0o600)
    for hook in ("prolog", "epilog"):
        target = base / f"run-{hook}"
        target.write_text(
            "#!/bin/sh\n"
            f"export STRAGGLER_CONFIG={config}\n"
            f"export STRAGGLER_{hook.upper()}_BIN={Path(sys.executable).parent}/straggler-{hook}\n"
            f"exec {REPO / hook / f'straggler-{hook}.sh'}\n"
        )
        target.chmod(0o755)
    cluster.up(prolog=base / "run-prolog", epilog=base / "run-epilog")
    return config


@pytest.fixture
def hooks(
    cluster: DevCluster, slurm: Slurm, secure_redis: SecureRedis, shared: Path
) -> Iterator[Path]:
    """The secure Redis wired into the cluster's prolog and epilog; back to plain after."""
    config = _wire_hooks(cluster, shared / "hooks", secure_redis)
    yield config
    slurm.cancel_all()
    cluster.up()


def test_world_readable_admin_settings_are_refused(hooks: Path) -> None:
    """The CLI refuses the admin settings file once others can read it."""
    argv = [sys.executable, "-m", "slurm_plugin.cli.main", "--config", str(hooks), "config"]
    ok = subprocess.run([*argv, "show"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    hooks.chmod(0o644)
    refused = subprocess.run([*argv, "show"], capture_output=True, text=True, check=False)
    assert refused.returncode != 0
    assert "chmod 600" in refused.stderr
    assert "0644" in refused.stderr


JOB_SCRIPT = """#!/bin/sh
cred="{jobs}/$SLURM_JOB_ID.toml"
url=$(sed -n 's/^url = "\\(.*\\)"$/\\1/p' "$cred")
r() {{ redis-cli --tls --cacert {ca} -u "$url" --no-auth-warning "$@" 2>&1 | head -c 200; }}
j="$SLURM_JOB_ID"
echo "whoami=$(id -un)"
echo "xadd_own=$(r XADD "stg:job:{{$j}}:steps" '*' x 1)"
echo "expire_own=$(r EXPIRE "stg:job:{{$j}}:steps" 100)"
echo "xadd_other=$(r XADD 'stg:job:{{999}}:steps' '*' x 1)"
echo "read_own=$(r XRANGE "stg:job:{{$j}}:steps" - +)"
echo "write_meta=$(r HSET "stg:job:{{$j}}:meta" nodes node9)"
echo "write_node=$(r HSET stg:node:node1 state persistent)"
echo "acl=$(r ACL LIST)"
echo "config=$(r CONFIG GET maxmemory)"
echo "keys=$(r KEYS '*')"
echo "flush=$(r FLUSHALL)"
touch {done}/$j
sleep 30
"""


def test_job_credentials_issued_confined_and_revoked(
    hooks: Path, slurm: Slurm, secure_redis: SecureRedis, shared: Path
) -> None:
    """A job running as nobody gets an append-only credential for its own streams, readable
    by nobody else; the epilog revokes it."""
    job_dir = shared / "job"
    job_dir.mkdir(mode=0o777)
    job_dir.chmod(0o777)
    jobs = hooks.parent / "jobs"
    script = job_dir / "job.sh"
    script.write_text(JOB_SCRIPT.format(jobs=jobs, ca=secure_redis.cert, done=job_dir))
    script.chmod(0o755)
    out = job_dir / "job.out"
    submitted = run_command(
        [
            "runuser", "-u", "nobody", "--", "sbatch", "--parsable", "-N", "2",
            f"--chdir={job_dir}", f"--output={out}", str(script),
        ],
        timeout_s=30,
        env=slurm.cluster.env() | {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    slurm.jobs.append(job_id)
    wait_for((job_dir / job_id).exists, 60, "the job to try its credential")
    admin = secure_redis.admin()
    cred = credentials.credential_path(job_id, jobs)
    info = cred.stat()
    assert (info.st_uid, oct(info.st_mode & 0o777)) == (65534, "0o600")
    other = subprocess.run(  # another user than the job's cannot read it
        ["runuser", "-u", "daemon", "--", "cat", str(cred)],  # noqa: S607 - system tool
        capture_output=True,
        check=False,
    )
    assert other.returncode != 0
    assert b"Permission denied" in other.stderr
    assert acl_user(admin, job_id)
    assert registration.read(admin, job_id).user == "nobody"
    lines = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert lines["whoami"] == "nobody"
    assert "-" in lines["xadd_own"]
    assert "NOPERM" not in lines["xadd_own"]
    assert lines["expire_own"] == "1"
    for denied in ("xadd_other", "read_own", "write_meta", "write_node", "acl", "config"):
        assert "NOPERM" in lines[denied], (denied, lines[denied])
    assert "NOPERM" in lines["keys"]
    assert "NOPERM" in lines["flush"]
    assert registration.read(admin, job_id).nodes != "node9"
    assert NodeRecord(admin, "node1").fields().get(nodes.STATE) != "persistent"
    assert admin.xlen(keys.job_steps(job_id)) == 1
    slurm.run("scancel", job_id)
    wait_for(
        lambda: not cred.exists() and acl_user(admin, job_id) is None,
        60,
        "the epilog to revoke the credential",
    )
    assert not admin.exists(keys.job_credential(job_id))


REPORTER_JOB = """#!/bin/sh
# The environment names no usable Redis: only the job's credential file can make this work.
export STRAGGLER_REDIS_URL=redis://127.0.0.1:1/0 STRAGGLER_CONFIG=/nonexistent.toml
export STRAGGLER_TELEMETRY_JOB_CREDENTIALS_DIR={jobs} PYTHONPATH={repo}
exec {python} -c '
from slurm_plugin.telemetry.reporter import StepReporter
with StepReporter.from_env() as rep:
    assert rep.enabled, "reporter disabled"
    for step in range(5):
        rep.record(step, 0.1, compute_s=0.08, comm_s=0.02)
    assert rep.flush(10), "flush failed"
print("published", rep.published)
'
"""


def test_reporter_publishes_with_the_job_credential(
    hooks: Path, slurm: Slurm, secure_redis: SecureRedis, job_dir: Path
) -> None:
    """StepReporter.from_env finds the credential file and publishes over TLS with it."""
    script = job_dir / "reporter.sh"
    script.write_text(
        REPORTER_JOB.format(jobs=hooks.parent / "jobs", repo=REPO, python=sys.executable)
    )
    script.chmod(0o755)
    out = job_dir / "reporter.out"
    job_id = slurm.sbatch(f"--output={out}", str(script))
    slurm.wait_job(job_id, "COMPLETED", timeout_s=60)
    assert "published 5" in out.read_text()
    admin = secure_redis.admin()
    assert admin.xlen(keys.job_steps(job_id)) == 1
    assert acl_user(admin, job_id) is None


def test_only_root_written_hardware_evidence_corroborates(
    state: ServiceState, redis_url: str
) -> None:
    """The node sidecar's sample and the prolog's check corroborate; GPU samples in the job's
    own stream (writable with the job's credential) are reported, never trusted."""
    store = TelemetryStore(connect(redis_url))
    now = time.time()
    sample = {
        "node": "node3",
        "ts": now - 5,
        "gpus": [{"index": 1, "throttle_reasons": ["hw_slowdown"]}],
    }
    forged = {"node": "node3", "gpus": [{"index": 1, "xids": [79]}]}
    store.publish("77", gpu_samples=[forged])

    def gather() -> tuple[list[str], list[str]]:
        return gather_evidence(state, store, "77", "node3", [1], now, 60.0)

    trusted, reported = gather()
    assert (trusted, reported) == ([], ["gpu1 xid 79"])
    NodeRecord(state.client, "node3").record_sample(json.dumps(sample))
    trusted, _ = gather()
    assert trusted == ["gpu1 hw_slowdown"]
    # Issue 25: a sample from a sidecar that stopped a week ago (or one with no time) is shown
    # as stale and corroborates nothing.
    for ts in (now - 7 * 86400, None, float("nan")):
        NodeRecord(state.client, "node3").record_sample(json.dumps({**sample, "ts": ts}))
        trusted, reported = gather()
        assert trusted == [], ts
        assert reported[-1].startswith("stale sidecar sample ("), reported
        assert reported[-1].endswith("gpu1 hw_slowdown"), reported
    NodeRecord(state.client, "node3").record_sample("{not json")
    assert gather() == ([], [])


def test_forged_events_never_break_a_cycle(
    slurm: Slurm, job_dir: Path, state: ServiceState, env: dict[str, str]
) -> None:
    """Events a job controls (garbage JSON, a checkpoint with a non-numeric or infinite ts)
    are skipped; the cycle succeeds and moves past them."""
    from slurm_plugin.config import load_settings  # noqa: PLC0415
    from slurm_plugin.service.factory import build  # noqa: PLC0415
    from slurm_plugin.service.loop import Service  # noqa: PLC0415
    from tests.integration.cluster_jobs import submit  # noqa: PLC0415

    job = submit(slurm, job_dir, "observe", seconds=60)
    slurm.wait_job(job, "RUNNING")
    store = TelemetryStore(connect(env["STRAGGLER_REDIS_URL"]))
    stream = keys.job_events(job)
    store.client.xadd(stream, {"json": "{not json"})
    store.client.xadd(stream, {"nothing": "here"})
    store.publish(job, events=[{"name": "checkpoint_end", "ts": "garbage"}])
    store.client.xadd(stream, {"json": '{"name": "checkpoint_end", "ts": Infinity}'})
    store.client.xadd(stream, {"json": '{"name": "checkpoint_end", "ts": 9e9, "loss": NaN}'})
    store.publish(job, events=[{"name": "checkpoint_end", "ts": 1234.5}])
    settings = load_settings()
    report = Service(settings, *build(settings)).cycle()
    assert report.error is None, report.error
    service_state = state.job(job)
    assert service_state["last_checkpoint_ts"] == "1234.500"
    # Issue 25: Python's JSON reads NaN and Infinity; the service refuses them, and counts
    # every malformed event where `job show` finds it.
    assert service_state["ignored_malformed_event"] == "4", service_state
    newest = cast("list[tuple[bytes, object]]", store.client.xrevrange(stream, count=1))
    assert service_state["events_cursor"] == newest[0][0].decode()


def test_service_revokes_credentials_of_vanished_jobs(
    slurm: Slurm, job_dir: Path, env: dict[str, str], private_redis: RedisServer
) -> None:
    """An epilog that never ran (node crash) leaves an ACL user behind; the service revokes
    credentials whose job Slurm no longer lists, and keeps those of live jobs (job credentials
    need database 0: a Redis of the test's own)."""
    from slurm_plugin.config import load_settings  # noqa: PLC0415
    from slurm_plugin.service.factory import build  # noqa: PLC0415
    from slurm_plugin.service.loop import Service  # noqa: PLC0415
    from tests.integration.cluster_jobs import submit  # noqa: PLC0415

    job = submit(slurm, job_dir, "observe", seconds=60)
    slurm.wait_job(job, "RUNNING")
    admin = connect(private_redis.url, decode=True)
    assert isinstance(admin, redis.Redis)
    credentials.issue(admin, job)
    credentials.issue(admin, "999999")
    settings = load_settings(telemetry={"job_credentials": True}, redis={"url": private_redis.url})
    try:
        report = Service(settings, *build(settings)).cycle()
        assert report.error is None, report.error
        assert acl_user(admin, "999999") is None
        assert not admin.exists(keys.job_credential("999999"))
        assert acl_user(admin, job) is not None
    finally:
        credentials.revoke(admin, job)
        credentials.revoke(admin, "999999")
        admin.close()
