"""Process and host-file helpers for the development cluster (Linux only).

PID 1 on some machines never reaps exited daemons, so ``kill -0`` succeeds on zombies: liveness
is read from ``/proc/PID/stat`` instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path

HOSTS_BEGIN = "# BEGIN slurm-straggler devcluster (managed; removed by `straggler devcluster down`)"
HOSTS_END = "# END slurm-straggler devcluster"


def hosts_markers(lane: int = 0) -> tuple[str, str]:
    """The lines around the hosts block of the dev cluster of ``lane`` (one block each: a
    cluster going down leaves another lane's names resolving)."""
    if lane == 0:
        return HOSTS_BEGIN, HOSTS_END
    return f"{HOSTS_BEGIN[:-1]}, lane {lane})", f"{HOSTS_END} (lane {lane})"


def read_pid(path: Path) -> int | None:
    """The pid in a pid file, or None when the file is missing or garbled."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def is_alive(pid: int | None) -> bool:
    """True when ``pid`` names a running (not zombie) process."""
    if pid is None or pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may itself contain spaces.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in {"Z", "X"}


_TOLD_TO_STOP = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))


def told_to_stop(pid: int | None) -> bool:
    """True when ``pid`` has a SIGTERM or SIGINT pending that it has not taken in yet (held by
    SIGSTOP, or too busy to run its signal thread): such a daemon is on its way out, yet may
    still answer a request or two before it exits."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (OSError, ValueError):
        return False
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    pending = 0
    for name in ("SigPnd", "ShdPnd"):
        with contextlib.suppress(KeyError, ValueError):
            pending |= int(fields[name].strip(), 16)
    return bool(pending & _TOLD_TO_STOP)


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts connections on ``host:port``: a controller whose process
    has exited (or whose pid file is gone) may still hold its port for a moment with its last
    threads, answer a request, and keep a new one from binding it."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def uts_namespace(pid: int) -> str | None:
    """The UTS namespace id of a process (``uts:[4026532...]``), or None."""
    try:
        return str(Path(f"/proc/{pid}/ns/uts").readlink())
    except OSError:
        return None


def pids_in_namespaces(namespaces: Iterable[str]) -> list[int]:
    """Every live process whose UTS namespace is one of ``namespaces``."""
    wanted = set(namespaces)
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and uts_namespace(int(entry.name)) in wanted:
            pid = int(entry.name)
            if is_alive(pid):
                found.append(pid)
    return found


def terminate(pids: Iterable[int], *, timeout_s: float = 10.0) -> list[int]:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; return the pids that had to be killed."""
    pending = [pid for pid in pids if is_alive(pid)]
    for pid in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [pid for pid in pending if is_alive(pid)]
    for pid in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pending


def hosts_block(entries: dict[str, str], lane: int = 0) -> str:
    """The marked /etc/hosts block of ``lane``'s cluster for ``{hostname: address}``."""
    begin, end = hosts_markers(lane)
    lines = [begin, *(f"{addr} {name}" for name, addr in entries.items()), end]
    return "\n".join(lines) + "\n"


def strip_hosts_block(text: str, lane: int = 0) -> str:
    """``text`` without ``lane``'s marked block (any number of them); other lines, other
    lanes' blocks included, stay untouched."""
    begin, end = hosts_markers(lane)
    kept: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\n")
        if stripped == begin:
            inside = True
        elif stripped == end and inside:
            inside = False
        elif not inside:
            kept.append(line)
    return "".join(kept)


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a file without replacing its inode (/etc/hosts is often a bind mount)."""
    with path.open("r+") as handle:
        handle.seek(0)
        handle.write(text)
        handle.truncate()


def cgroup_mounted(mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """True when a cgroup (v1 or v2) filesystem is mounted at or under /sys/fs/cgroup."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) != 2:
            continue
        mount_point = fields[0].split()[4] if len(fields[0].split()) > 4 else ""
        fstype = fields[1].split()[0] if fields[1].split() else ""
        if fstype in {"cgroup", "cgroup2"} and mount_point.startswith("/sys/fs/cgroup"):
            return True
    return False
