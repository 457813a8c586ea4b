"""Dev-cluster helpers that need no cluster: liveness, UTS namespaces, the hosts block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.devcluster import DevCluster, procs
from slurm_plugin.errors import DevClusterError


def test_is_alive_sees_zombies_as_dead() -> None:
    """A zombie answers kill -0 but is not alive for us; a running process is."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while True:  # wait for it to exit without reaping it
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
    os.kill(child.pid, 0)  # the kernel still knows the pid
    assert not procs.is_alive(child.pid)
    child.wait()
    assert procs.is_alive(os.getpid())
    assert not procs.is_alive(None)


def test_told_to_stop_sees_a_sigterm_the_process_has_not_taken_in() -> None:
    """A daemon that takes SIGTERM in a signal thread (slurmctld) and has not run it yet (held
    with SIGSTOP, or busy) is on its way out: the harness must not take its last answers for a
    running controller. A running process with nothing pending is not."""
    waits_for_sigterm = (
        "import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
        "print('blocked', flush=True); sys.stdin.readline(); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", waits_for_sigterm],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "blocked\n"
        assert not procs.told_to_stop(child.pid)
        os.kill(child.pid, signal.SIGTERM)
        assert procs.told_to_stop(child.pid)
        child.communicate("go\n", timeout=10)  # unblocked, it takes the SIGTERM in and dies
        assert child.returncode == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    assert not procs.told_to_stop(child.pid)
    assert not procs.told_to_stop(None)


def test_read_pid(tmp_path: Path) -> None:
    """Pid files are parsed strictly: missing or garbled files give None."""
    good, bad = tmp_path / "good.pid", tmp_path / "bad.pid"
    good.write_text("123\n")
    bad.write_text("12a")
    assert procs.read_pid(good) == 123
    assert procs.read_pid(bad) is None
    assert procs.read_pid(tmp_path / "missing.pid") is None


def test_hosts_block_round_trip(tmp_path: Path) -> None:
    """Our block is appended and removed without touching anyone else's lines."""
    original = "127.0.0.1 localhost\n10.0.0.5 db # keep me\n"
    block = procs.hosts_block({"node1": "127.0.1.1", "node2": "127.0.1.2"})
    assert "127.0.1.2 node2" in block
    assert procs.strip_hosts_block(original + block) == original
    assert procs.strip_hosts_block(original + block + block) == original
    hosts = tmp_path / "hosts"
    hosts.write_text(original + block)
    inode = hosts.stat().st_ino
    procs.write_in_place(hosts, procs.strip_hosts_block(hosts.read_text()))
    assert hosts.read_text() == original
    assert hosts.stat().st_ino == inode


def test_each_lanes_hosts_block_goes_with_its_own_cluster() -> None:
    """Two dev clusters side by side name the same nodes: each keeps a block of its own, so
    the one going down first leaves the other's names resolving."""
    entries = {"node1": "127.0.1.1"}
    original = "127.0.0.1 localhost\n"
    both = original + procs.hosts_block(entries) + procs.hosts_block(entries, lane=1)
    assert procs.strip_hosts_block(both, lane=1) == original + procs.hosts_block(entries)
    assert procs.strip_hosts_block(both) == original + procs.hosts_block(entries, lane=1)
    assert procs.strip_hosts_block(procs.strip_hosts_block(both), lane=1) == original


def test_a_lane_takes_its_own_directory_and_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lane 1 of the settings: the directory beside lane 0's, every port 10 higher."""
    monkeypatch.setenv("STRAGGLER_DEVCLUSTER_DIR", str(tmp_path / "dc"))
    zero = DevCluster.from_settings(Settings())
    monkeypatch.setenv("STRAGGLER_DEVCLUSTER_LANE", "1")
    one = DevCluster.from_settings(Settings())
    assert (zero.base, one.base) == (tmp_path / "dc", tmp_path / "dc-lane1")
    ports = [
        (c.redis_port, c.slurmctld_port, c.accounting.dbd_port, c.accounting.mysql_port)
        for c in (zero, one)
    ]
    assert ports == [(16379, 16817, 16819, 16306), (16389, 16827, 16829, 16316)]
    assert (zero.node_port_base, one.node_port_base) == (17000, 17010)
    assert one.env()["STRAGGLER_REDIS_URL"] == "redis://127.0.0.1:16389/0"
    with pytest.raises(DevClusterError, match="lane must be"):
        DevCluster(tmp_path, lane=10)


def test_terminate_stops_a_process() -> None:
    """terminate() ends a live process that honours SIGTERM without needing SIGKILL."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = procs.terminate([child.pid], timeout_s=5)
    child.wait(timeout=5)
    assert killed == []
    assert child.returncode == -15


def test_fault_injection_validates_node_names(tmp_path: Path) -> None:
    """Only the cluster's own node names can get an injected fault; faults can be cleared."""
    cluster = DevCluster(tmp_path / "dc", nodes=2)
    cluster.inject_prolog_failure("node2")
    assert (tmp_path / "dc" / "faults" / "prolog-fail-node2").exists()
    with pytest.raises(DevClusterError, match="unknown node"):
        cluster.inject_prolog_failure("../../etc/passwd")
    cluster.clear_faults()
    assert list((tmp_path / "dc" / "faults").iterdir()) == []
    with pytest.raises(DevClusterError, match="nodes must be"):
        DevCluster(tmp_path, nodes=0)


def test_cgroup_mounted_reads_mountinfo(tmp_path: Path) -> None:
    """A cgroup v1 or v2 mount under /sys/fs/cgroup counts; sysfs alone or elsewhere does not."""
    info = tmp_path / "mountinfo"
    sysfs = "22 1 0:20 / /sys rw,nosuid - sysfs sysfs rw\n"
    info.write_text(sysfs)
    assert not procs.cgroup_mounted(info)
    info.write_text(sysfs + "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    assert procs.cgroup_mounted(info)
    info.write_text(sysfs + "31 22 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert procs.cgroup_mounted(info)
    info.write_text("32 22 0:28 / /mnt/cg rw - cgroup2 cgroup2 rw\n")
    assert not procs.cgroup_mounted(info)
    assert not procs.cgroup_mounted(tmp_path / "missing")


def test_listening_tells_a_held_port_from_a_free_one() -> None:
    """A port something accepts on is held; once that socket closes it is free."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        assert procs.listening(port)
    finally:
        server.close()
    assert not procs.listening(port)


def test_a_new_controller_waits_until_the_old_ones_port_is_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` after a controller was told to stop: its pid file is gone (or names an exited
    process) while its last threads still hold the port and answer sinfo. A new one is not
    started then (it could not bind the port, and died: CI once saw `up` ready on the old
    one's last answers and the lane left with no controller); it is once the port is free,
    and only its answers make the cluster ready."""
    server = socket.create_server(("127.0.0.1", 0))
    cluster = DevCluster(tmp_path / "dc", nodes=2)
    cluster.slurmctld_port = server.getsockname()[1]
    started: list[float] = []
    monkeypatch.setattr(cluster, "_start_slurmctld", lambda: started.append(time.monotonic()))
    monkeypatch.setattr(cluster, "_alive", lambda daemon: bool(started))
    monkeypatch.setattr(cluster, "_node_states", lambda: dict.fromkeys(cluster.node_names, "idle"))
    monkeypatch.setattr(cluster, "_redis_ok", lambda: True)
    with ThreadPoolExecutor(1) as pool:
        ready = pool.submit(cluster._wait_ready, time.monotonic() + 30, [])
        time.sleep(1.0)
        assert not started  # the old one's port is still held: answers are not ready
        assert not ready.done()
        freed = time.monotonic()
        server.close()
        ready.result(timeout=20)
    assert len(started) == 1
    assert started[0] >= freed
