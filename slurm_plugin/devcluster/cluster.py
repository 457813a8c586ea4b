"""Bring a real local Slurm cluster (munge, slurmctld, N slurmd) and a redis-server up and down.

Each compute node is a real ``slurmd -N nodeN`` in its own UTS namespace, so ``hostname`` inside
jobs and prologs answers ``nodeN``. All state lives under one base directory; daemons are found
again through their pid files, and processes are only ever stopped when we started them (a pid
file of ours, or a UTS namespace we created for a node).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from string import Template

import structlog

from slurm_plugin.config import Settings
from slurm_plugin.devcluster import procs
from slurm_plugin.devcluster.accounting import PROGRAMS as ACCOUNTING_PROGRAMS
from slurm_plugin.devcluster.accounting import Accounting
from slurm_plugin.devcluster.conf import hook_script, requeue_settings, write_if_changed
from slurm_plugin.devcluster.settings import DevSettings
from slurm_plugin.devcluster.status import READY_STATES, ClusterStatus, DaemonStatus
from slurm_plugin.errors import CommandError, DevClusterError
from slurm_plugin.slurm.release import SlurmRelease, parse_version
from slurm_plugin.slurm.runner import run_command
from slurm_plugin.store.telemetry_store import ping

#: The code-free mode's sitecustomize directory (SPANK ``autoload=``).
AUTOLOAD_DIR = Path(__file__).resolve().parents[1] / "telemetry" / "autoload"

log = structlog.get_logger(__name__)

REQUIRED_PROGRAMS = (
    "munged",
    "slurmctld",
    "slurmd",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
    "redis-server",
    "unshare",
)
#: slurm.conf's ClusterName (contrib/devcluster/slurm.conf.in).
CLUSTER_NAME = "stgdev"
#: How far apart the ports of two dev clusters side by side (lanes) are: lane k adds k times
#: this to every port (nodes 1..9 take the ports 17001..17009 in lane 0).
LANE_PORT_STEP = 10


def default_template_dir() -> Path:
    """``contrib/devcluster`` of the source checkout this package runs from."""
    return Path(__file__).resolve().parents[2] / "contrib" / "devcluster"


class DevCluster:
    """A local development cluster rooted at ``base``. Lane K (0..9) takes every port given
    here ``K * LANE_PORT_STEP`` higher, its nodes' too, and a hosts block of its own: two
    clusters side by side (:meth:`from_settings` also puts it in a directory of its own)."""

    def __init__(
        self,
        base: Path,
        *,
        nodes: int = 4,
        lane: int = 0,
        redis_port: int = 16379,
        slurmctld_port: int = 16817,
        slurmdbd_port: int = 16819,
        mysql_port: int = 16306,
        template_dir: Path | None = None,
        hosts_file: Path = Path("/etc/hosts"),
        command_timeout_s: float = 15.0,
    ) -> None:
        if not 1 <= nodes <= 9:
            raise DevClusterError(f"nodes must be 1..9 (ports 17001..17009 in lane 0), not {nodes}")
        if not 0 <= lane <= 9:
            raise DevClusterError(f"lane must be 0..9, not {lane}")
        offset = LANE_PORT_STEP * lane
        self.base = base.resolve()
        self.lane = lane
        self.node_names = [f"node{i}" for i in range(1, nodes + 1)]
        self.node_port_base = 17000 + offset
        self.redis_port = redis_port + offset
        self.slurmctld_port = slurmctld_port + offset
        self.template_dir = template_dir or default_template_dir()
        self.hosts_file = hosts_file
        self.timeout_s = command_timeout_s
        self.accounting = Accounting(
            self.base,
            cluster_name=CLUSTER_NAME,
            munge_socket=self._munge_socket(),
            dbd_port=slurmdbd_port + offset,
            mysql_port=mysql_port + offset,
            env=lambda: {"SLURM_CONF": str(self.slurm_conf)},
            timeout_s=command_timeout_s,
        )

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: object) -> DevCluster:
        """A cluster where ``STRAGGLER_DEVCLUSTER_*`` puts it, with the settings' Slurm
        command timeout. A lane other than 0 lives beside the directory (``DIR-laneK``) and
        takes its ports ``K * LANE_PORT_STEP`` higher: two clusters side by side (the test
        tiers run half of the cluster tests on each)."""
        dev = DevSettings()
        base = dev.dir if dev.lane == 0 else dev.dir.with_name(f"{dev.dir.name}-lane{dev.lane}")
        return cls(
            base,
            lane=dev.lane,
            redis_port=dev.redis_port,
            slurmctld_port=dev.slurmctld_port,
            command_timeout_s=settings.slurm.command_timeout_s,
            **kwargs,  # type: ignore[arg-type]
        )

    # -- paths -----------------------------------------------------------------------------
    @property
    def slurm_conf(self) -> Path:
        """The generated slurm.conf."""
        return self.base / "etc" / "slurm.conf"

    @property
    def redis_url(self) -> str:
        """The URL of the cluster's redis-server (database 0)."""
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self) -> dict[str, str]:
        """The variables to export to use this cluster."""
        return {"SLURM_CONF": str(self.slurm_conf), "STRAGGLER_REDIS_URL": self.redis_url}

    def _slurm_env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def _pidfile(self, daemon: str) -> Path:
        if daemon == "munged":
            return self.base / "munge" / "run" / "munged.pid"
        if daemon in self.accounting.daemons():
            return self.accounting.daemons()[daemon]
        return self.base / "run" / f"{daemon}.pid"

    def _daemon_names(self) -> list[str]:
        extra = [*self.accounting.daemons()] if self.accounting_on else []
        return ["munged", "redis", "slurmctld", *(f"slurmd-{n}" for n in self.node_names), *extra]

    @property
    def accounting_on(self) -> bool:
        """Whether this cluster runs with slurmdbd (``up(accounting=True)`` switched it on)."""
        return (self.base / "etc" / "slurmdbd.conf").exists()

    # -- fault injection (tests and the demo) ----------------------------------------------
    def inject_prolog_failure(self, node: str) -> None:
        """Make the prolog on ``node`` exit 1 until :meth:`clear_faults`."""
        if node not in self.node_names:
            raise DevClusterError(f"unknown node {node!r}; nodes are {', '.join(self.node_names)}")
        (self.base / "faults").mkdir(parents=True, exist_ok=True)
        (self.base / "faults" / f"prolog-fail-{node}").touch()

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        for marker in (self.base / "faults").glob("*"):
            marker.unlink()

    # -- up ----------------------------------------------------------------------------------
    def up(
        self,
        *,
        prolog: Path | None = None,
        epilog: Path | None = None,
        plugstack: Sequence[str] | None = None,
        spank: bool = False,
        accounting: bool | None = None,
        wait_s: float = 60.0,
    ) -> ClusterStatus:
        """Start whatever is not running yet and wait until every node is usable (idempotent).

        ``spank`` builds ``contrib/spank`` and loads the plugin through plugstack.conf, with any
        extra ``plugstack`` lines. When neither is given, plugstack.conf stays as it is (an
        idempotent ``up`` never unloads a plugin). ``accounting`` runs MariaDB and slurmdbd
        (:mod:`.accounting`); None keeps what the cluster had.
        """
        started = time.monotonic()
        missing = [p for p in REQUIRED_PROGRAMS if shutil.which(p) is None]
        if missing:
            raise DevClusterError(
                f"missing programs: {', '.join(missing)} (run `make install` as root to get them)"
            )
        if accounting:
            missing = [p for p in ACCOUNTING_PROGRAMS if shutil.which(p) is None]
            if missing:
                raise DevClusterError(f"accounting needs: {', '.join(missing)} (make install)")
        self._make_dirs()
        self._write_hosts()
        if accounting:
            self.accounting.write_config()
        elif accounting is not None and self.accounting_on:
            self.accounting.stop()
            (self.base / "etc" / "slurmdbd.conf").unlink()
        if spank:
            plugstack = [self._build_spank(), *(plugstack or ())]
        slurm_changed = self._write_configs(prolog, epilog, plugstack)
        notes: list[str] = []
        if slurm_changed and any(
            procs.is_alive(procs.read_pid(self._pidfile(d))) for d in self._daemon_names()[2:]
        ):
            notes.append("configuration changed: restarted the Slurm daemons")
            self._stop_slurm()
        self._start_munge()
        self._start_redis()
        if self.accounting_on:
            self.accounting.start()
        self._start_slurmctld()
        for node in self.node_names:
            self._start_slurmd(node)
        self._wait_ready(time.monotonic() + wait_s, notes)
        return replace(self.status(), elapsed_s=round(time.monotonic() - started, 3), notes=notes)

    def _build_spank(self) -> str:
        """Compile the SPANK plugin (warnings are errors) and return its plugstack line."""
        source = self.template_dir.parent / "spank"
        run_command(["make", "-s", "-C", str(source)], timeout_s=120)
        policies = self.template_dir.parents[1] / "policies"
        names = sorted(p.stem for p in policies.glob("*.toml")) or ["observe"]
        return (
            f"optional {source / 'straggler_spank.so'} policies={','.join(names)} default=observe"
            f" autoload={AUTOLOAD_DIR}"
        )

    def _make_dirs(self) -> None:
        for sub in ("etc", "run", "log", "state/ctld", "state/redis", "faults", "munge/run"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for node in self.node_names:
            (self.base / "state" / node).mkdir(parents=True, exist_ok=True)
        (self.base / "munge" / "etc").mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (self.base, self.base / "munge", self.base / "munge" / "run"):
            path.chmod(0o755)  # munged insists that everyone may traverse its socket directory

    def _write_hosts(self) -> None:
        block = procs.hosts_block(
            {n: f"127.0.1.{i}" for i, n in enumerate(self.node_names, 1)}, self.lane
        )
        text = self.hosts_file.read_text()
        new = procs.strip_hosts_block(text, self.lane)
        new = (new if new.endswith("\n") or not new else new + "\n") + block
        if new != text:
            procs.write_in_place(self.hosts_file, new)

    def _render(self, name: str, **values: object) -> str:
        template = self.template_dir / name
        try:
            return Template(template.read_text()).substitute(values)
        except OSError as exc:
            raise DevClusterError(f"cannot read template {template}: {exc.strerror}") from exc
        except (KeyError, ValueError) as exc:
            raise DevClusterError(f"bad template {template}: {exc}") from exc

    def _write_configs(
        self, prolog: Path | None, epilog: Path | None, plugstack: Sequence[str] | None
    ) -> bool:
        """Write every config file; True when slurm.conf or plugstack.conf changed."""
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr=127.0.1.{i} Port={self.node_port_base + i} "
            "CPUs=2 RealMemory=1000 State=UNKNOWN"
            for i, n in enumerate(self.node_names, 1)
        )
        slurm = self._render(
            "slurm.conf.in",
            base=self.base,
            ctl_host=socket.gethostname().split(".")[0],
            ctl_port=self.slurmctld_port,
            munge_socket=self._munge_socket(),
            nodes=nodes,
            accounting=self.accounting.slurm_conf_lines()
            if self.accounting_on
            else "AccountingStorageType=accounting_storage/none",
            **requeue_settings(self.release()),
        )
        redis_conf = self._render("redis.conf.in", base=self.base, redis_port=self.redis_port)
        changed = write_if_changed(self.slurm_conf, slurm)
        stack = self.base / "etc" / "plugstack.conf"
        if plugstack is not None or not stack.exists():
            changed |= write_if_changed(stack, "".join(f"{line}\n" for line in plugstack or ()))
        changed |= self._write_cgroup_conf()
        write_if_changed(self.base / "etc" / "redis.conf", redis_conf)
        for hook, target in (("prolog", prolog), ("epilog", epilog)):
            write_if_changed(
                self.base / "etc" / hook, hook_script(hook, target, self.base / "faults")
            )
            (self.base / "etc" / hook).chmod(0o755)
        key = self.base / "munge" / "etc" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        return changed

    def release(self) -> SlurmRelease:
        """The release of the installed slurmd (``slurmd -V`` needs no configuration)."""
        result = run_command(["slurmd", "-V"], timeout_s=self.timeout_s)
        return parse_version(result.stdout or result.stderr)

    def _write_cgroup_conf(self) -> bool:
        """Without a cgroup filesystem (a container, a namespace) slurmd refuses to start unless
        cgroup.conf says ``CgroupPlugin=disabled``, which 22.05 rejects: write it only where the
        release accepts it and no cgroup hierarchy is mounted; True when the file changed."""
        path = self.base / "etc" / "cgroup.conf"
        if procs.cgroup_mounted() or not self.release().cgroup_plugin_disabled:
            if path.exists():
                path.unlink()
                return True
            return False
        return write_if_changed(path, "CgroupPlugin=disabled\n")

    def _munge_socket(self) -> Path:
        return self.base / "munge" / "run" / "munge.sock"

    def _alive(self, daemon: str) -> bool:
        return procs.is_alive(procs.read_pid(self._pidfile(daemon)))

    def _spawn(self, argv: Sequence[str], daemon: str) -> None:
        """Run a self-daemonising program and wait until its pid file names a live process."""
        result = run_command(argv, timeout_s=self.timeout_s, env=self._slurm_env(), check=False)
        deadline = time.monotonic() + self.timeout_s
        while not self._alive(daemon):
            if time.monotonic() > deadline:
                detail = (result.stderr or result.stdout).strip()
                raise DevClusterError(
                    f"{daemon} did not start (exit {result.returncode}: {detail or 'no output'}); "
                    f"see {self.base / 'log'}"
                )
            time.sleep(0.05)
        log.info("devcluster.started", daemon=daemon, pid=procs.read_pid(self._pidfile(daemon)))

    def _start_munge(self) -> None:
        if self._alive("munged"):
            return
        m = self.base / "munge"
        self._spawn(
            [
                "munged",
                f"--key-file={m / 'etc' / 'munge.key'}",
                f"--socket={self._munge_socket()}",
                f"--pid-file={self._pidfile('munged')}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'etc' / 'munged.seed'}",
                "--force",
            ],
            "munged",
        )

    def _start_redis(self) -> None:
        if not self._alive("redis"):
            self._spawn(["redis-server", str(self.base / "etc" / "redis.conf")], "redis")

    def _start_slurmctld(self) -> None:
        if not self._alive("slurmctld"):
            self._spawn(["slurmctld", "-f", str(self.slurm_conf)], "slurmctld")

    def _start_slurmd(self, node: str) -> None:
        daemon = f"slurmd-{node}"
        if self._alive(daemon):
            return
        script = 'hostname "$1" && exec slurmd -f "$2" -N "$1"'
        self._spawn(
            ["unshare", "--uts", "/bin/sh", "-c", script, "sh", node, str(self.slurm_conf)], daemon
        )
        pid = procs.read_pid(self._pidfile(daemon))
        namespace = procs.uts_namespace(pid) if pid else None
        if namespace is None or namespace == procs.uts_namespace(os.getpid()):
            raise DevClusterError(f"{daemon} is not in a UTS namespace of its own")
        (self.base / "run" / f"{daemon}.uts").write_text(namespace)

    def _node_states(self) -> dict[str, str]:
        try:
            out = run_command(
                ["sinfo", "-h", "-N", "-o", "%N %T"],
                timeout_s=self.timeout_s,
                env=self._slurm_env(),
            ).stdout
        except CommandError:
            return {}
        states = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def _wait_ready(self, deadline: float, notes: list[str]) -> None:
        resumed: set[str] = set()
        leaving: set[int | None] = set()
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            # One told to stop still holds its pid file while it saves its state (seconds under
            # load) and may answer sinfo meanwhile: wait until it is gone, then start another.
            pid = procs.read_pid(self._pidfile("slurmctld"))
            if procs.told_to_stop(pid) or (pid in leaving and procs.is_alive(pid)):
                leaving.add(pid)
                time.sleep(0.1)
                continue
            if not procs.is_alive(pid):
                if procs.listening(self.slurmctld_port):
                    # Its pid gone (or its pid file), the old one's last threads still hold
                    # the port: a new one started now could not bind it and would die.
                    time.sleep(0.1)
                    continue
                self._start_slurmctld()
                notes.append("started slurmctld again (it was stopping)")
            states = self._node_states()
            for node, state in states.items():
                # A dev cluster starts clean: nodes left drained/down by earlier runs come back.
                if (
                    state.startswith(("drain", "down"))
                    and not state.endswith("*")
                    and node not in resumed
                ):
                    run_command(
                        ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                        timeout_s=self.timeout_s,
                        env=self._slurm_env(),
                        check=False,
                    )
                    resumed.add(node)
                    notes.append(f"resumed {node} (was {state})")
            if (
                set(states) == set(self.node_names)
                and all(s in READY_STATES for s in states.values())
                and self._alive("slurmctld")  # answered by the controller the pid file names
                and self._redis_ok()
            ):
                return
            time.sleep(0.1)
        raise DevClusterError(f"nodes not ready in time: {states or 'sinfo did not answer'}")

    def _redis_ok(self) -> bool:
        return ping(self.redis_url, timeout_s=1)

    # -- status and down -----------------------------------------------------------------------
    def status(self) -> ClusterStatus:
        """The daemons, node states and Redis health right now."""
        daemons = [
            DaemonStatus(d, procs.read_pid(self._pidfile(d)), self._alive(d))
            for d in self._daemon_names()
        ]
        slurm_up = any(d.alive for d in daemons if d.name == "slurmctld")
        return ClusterStatus(
            base=str(self.base),
            daemons=daemons,
            nodes=self._node_states() if slurm_up else {},
            redis_ok=self._redis_ok() if daemons[1].alive else False,
            env=self.env(),
        )

    def _stop_slurm(self) -> list[str]:
        stopped = []
        if self._alive("slurmctld"):
            out = run_command(
                ["squeue", "-h", "-o", "%i"],
                timeout_s=self.timeout_s,
                env=self._slurm_env(),
                check=False,
            ).stdout.split()
            if out:
                run_command(
                    ["scancel", *out], timeout_s=self.timeout_s, env=self._slurm_env(), check=False
                )
                _wait_until(
                    lambda: (
                        not run_command(
                            ["squeue", "-h", "-o", "%i"],
                            timeout_s=self.timeout_s,
                            env=self._slurm_env(),
                            check=False,
                        ).stdout.strip()
                    ),
                    15.0,
                )
                stopped.append(f"cancelled jobs {' '.join(out)}")
        namespaces = [
            p.read_text() for p in (self.base / "run").glob("slurmd-*.uts") if p.is_file()
        ]
        namespaces = [ns for ns in namespaces if ns != procs.uts_namespace(os.getpid())]
        for daemon in [*(f"slurmd-{n}" for n in self.node_names), "slurmctld"]:
            pid = procs.read_pid(self._pidfile(daemon))
            if procs.is_alive(pid):
                procs.terminate([pid] if pid else [])
                stopped.append(daemon)
        leftovers = procs.pids_in_namespaces(namespaces)
        if leftovers:
            procs.terminate(leftovers, timeout_s=5.0)
            stopped.append(f"{len(leftovers)} job processes left in node namespaces")
        return stopped

    def down(self, *, keep_state: bool = False) -> list[str]:
        """Stop everything we started, remove our /etc/hosts block and (unless kept) the state."""
        stopped = self._stop_slurm() if self.base.exists() else []
        stopped += self.accounting.stop()
        for daemon in ("redis", "munged"):
            pid = procs.read_pid(self._pidfile(daemon))
            if procs.is_alive(pid):
                procs.terminate([pid] if pid else [])
                stopped.append(daemon)
        text = self.hosts_file.read_text()
        if (stripped := procs.strip_hosts_block(text, self.lane)) != text:
            procs.write_in_place(self.hosts_file, stripped)
        if not keep_state and self.base.exists():
            shutil.rmtree(self.base)
        return stopped


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
