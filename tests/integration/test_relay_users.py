"""The relay's socket against the node's other users: a process of another user cannot
publish as a job, and no local user can take all of a relay's connections."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from slurm_plugin.model.records import encode_steps
from slurm_plugin.store import registration
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry import relay_peers
from slurm_plugin.telemetry.relay import Relay
from tests.integration import relay_harness as harness
from tests.integration.conftest import RedisServer, wait_for
from tests.integration.relay_harness import JOB

pytestmark = pytest.mark.integration


_SENDER = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(sys.stdin.buffer.read())
print(s.makefile("rb").readline().decode().strip())
"""


def _send_as(uid: int, sock: Path, job: str) -> dict[str, object]:
    """One flush for ``job`` from a process of user ``uid`` whose environment says it runs in
    ``job`` (no Slurm cgroup here): the relay's answer."""
    message = {
        "job_id": job,
        "steps": [encode_steps(0, "claimed", 0, 0, [(1, time.time(), 0.1, 0.08, 0.01, 0.01)])],
        "events": [],
    }
    python = shutil.which("python3", path=_SYSTEM_PATH)
    assert python is not None
    proc = subprocess.run(
        [python, "-c", _SENDER, str(sock)],
        input=(json.dumps(message) + "\n").encode(),
        capture_output=True,
        env={"SLURM_JOB_ID": job, "PATH": _SYSTEM_PATH},
        user=uid,
        timeout=30,
        check=True,
        cwd="/",
    )
    answer: dict[str, object] = json.loads(proc.stdout)
    return answer


#: Where a Python every user can run is found (the project's may live under root's home).
_SYSTEM_PATH = "/usr/bin:/bin:/usr/local/bin"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a sender as another user (root only)")
@pytest.mark.skipif(
    shutil.which("python3", path=_SYSTEM_PATH) is None, reason="no system python3 for the sender"
)
def test_a_process_of_another_user_cannot_publish_as_a_job(private_redis: RedisServer) -> None:
    """Issue 38, item 5: without Slurm's cgroup plugin a process's job is its SLURM_JOB_ID,
    which any process sets. A process of `nobody` claiming root's job 901 is refused (it is
    not the user the prolog registered); one of `nobody` in a job registered as nobody's, and
    one of root, are served; a job nobody registered is served only to root."""
    nobody = pwd.getpwnam("nobody").pw_uid
    client = redis.Redis.from_url(private_redis.url)
    registration.register(client, "901", registration.Registration(user="root"))
    registration.register(client, "902", registration.Registration(user="nobody"))
    shared = Path(tempfile.mkdtemp(prefix="relay-"))  # a directory every user can traverse
    shared.chmod(0o755)
    relay = Relay(TelemetryStore(connect(private_redis.url)), "node1", shared / "relay.sock")
    relay.start()
    try:
        refused = _send_as(nobody, relay.socket_path, "901")
        assert refused["ok"] is False
        assert refused.get("refused") is True
        assert "may not publish for job 901 (its user: root)" in str(refused["error"])
        assert _send_as(nobody, relay.socket_path, "902")["ok"] is True
        assert _send_as(0, relay.socket_path, "901")["ok"] is True
        unknown = _send_as(nobody, relay.socket_path, "903")
        assert unknown["ok"] is False
        assert "no registration" in str(unknown["error"])
        assert _send_as(0, relay.socket_path, "903")["ok"] is True
    finally:
        relay.close()
        shutil.rmtree(shared, ignore_errors=True)
    assert relay.refused == 2
    assert relay.flushes == 3


_HOLDER = """
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


def _hold(uid: int, sock: Path, count: int, job: str | None) -> subprocess.Popen[str]:
    """A process of user ``uid`` (in ``job``, or in none) that opens ``count`` connections to
    the relay and holds them, idle, until its standard input closes."""
    python = shutil.which("python3", path=_SYSTEM_PATH)
    assert python is not None
    env = {"PATH": _SYSTEM_PATH, **({"SLURM_JOB_ID": job} if job else {})}
    proc = subprocess.Popen(
        [python, "-c", _HOLDER, str(sock), str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        user=uid,
        text=True,
        cwd="/",
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.skipif(os.geteuid() != 0, reason="runs holders as another user (root only)")
@pytest.mark.skipif(
    shutil.which("python3", path=_SYSTEM_PATH) is None, reason="no system python3 for holders"
)
def test_no_local_user_blinds_a_nodes_relay(private_redis: RedisServer) -> None:
    """Issue 38, item 4: processes of `nobody` hold idle connections: 300 from no job, 200
    from each of two jobs of its own and 50 from a third. The first are turned away at once
    (they could never publish), the others stop at the bound per job and then per user; root's
    job's 64 ranks on the node still publish every record through the relay."""
    nobody = pwd.getpwnam("nobody").pw_uid
    shared = Path(tempfile.mkdtemp(prefix="relay-"))  # a directory every user can traverse
    shared.chmod(0o755)
    relay = Relay(TelemetryStore(connect(private_redis.url)), "node0", shared / "relay.sock")
    relay.start()
    holders = []
    try:
        for count, job in ((300, None), (200, "902"), (200, "903"), (50, "904")):
            holders.append(_hold(nobody, relay.socket_path, count, job))
        per_job = relay_peers.MAX_PER_JOB
        assert 2 * per_job == relay_peers.MAX_PER_USER
        turned = {"no job": 300, "job": 2 * (200 - per_job), "user": 50}
        wait_for(lambda: dict(relay.admission.turned_away) == turned, 30, "the holders' turn")
        assert relay.admission.served == relay_peers.MAX_PER_USER
        published = harness.published(
            harness.ranks(JOB, JOB, 0, 64, 3.0, relay.socket_path, private_redis.url)
        )
    finally:
        for holder in holders:
            holder.communicate(timeout=30)
        relay.close()
        shutil.rmtree(shared, ignore_errors=True)
    records, repeats, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert (len(records), repeats) == (published, 0)
    assert published >= 64 * 20
    assert {r.node for r in records} == {"node0"}  # every one through the relay
