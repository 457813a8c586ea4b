"""Slurm accounting for the development cluster: a private MariaDB and slurmdbd.

With accounting the dev cluster is what production runs: slurmctld keeps its users and their
``AdminLevel`` through slurmdbd, so the service can run as its own account with the rights
``sacctmgr`` grants it (``AdminLevel=Admin``: Operator may neither mark a job nor drain a
node), and a right it lacks shows here first. The
database lives under the cluster's base directory; its server listens on loopback only.
"""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from slurm_plugin.devcluster import procs
from slurm_plugin.devcluster.conf import write_if_changed
from slurm_plugin.errors import CommandError, DevClusterError
from slurm_plugin.slurm.runner import run_command

log = structlog.get_logger(__name__)

#: Programs accounting needs (Debian: mariadb-server, slurmdbd; sacctmgr is in slurm-client).
PROGRAMS = ("mariadb-install-db", "mariadbd", "mariadb", "slurmdbd", "sacctmgr", "useradd")
#: The service account, registered with our Slurm account but no AdminLevel: the deploy guide
#: (and contrib/deploy/check-deploy) grants it Admin, as a site does; the tests grant each level.
SERVICE_ACCOUNT = "straggler"
#: The Slurm account our users belong to.
ACCOUNT = "straggler"
DATABASE = "stgdev_acct_db"


class Accounting:
    """MariaDB and slurmdbd of one dev cluster (``base``), on loopback ports."""

    def __init__(
        self,
        base: Path,
        *,
        cluster_name: str,
        munge_socket: Path,
        dbd_port: int,
        mysql_port: int,
        env: Callable[[], Mapping[str, str]],
        timeout_s: float = 15.0,
    ) -> None:
        self.base = base
        self.cluster_name = cluster_name
        self.munge_socket = munge_socket
        self.dbd_port = dbd_port
        self.mysql_port = mysql_port
        self.env = env
        self.timeout_s = timeout_s
        self.data = base / "state" / "mariadb"

    # -- configuration ---------------------------------------------------------------------
    def slurm_conf_lines(self) -> str:
        """slurm.conf's accounting lines (AccountingStoragePass names the munge socket that
        talks to slurmdbd: AuthInfo's does not reach those connections)."""
        return (
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=127.0.0.1\nAccountingStoragePort={self.dbd_port}\n"
            f"AccountingStoragePass={self.munge_socket}"
        )

    def _password(self) -> str:
        path = self.base / "etc" / "mariadb.pass"
        if not path.exists():
            path.write_text(secrets.token_hex(16))
            path.chmod(0o600)
        return path.read_text().strip()

    def write_config(self) -> None:
        """slurmdbd.conf beside slurm.conf (slurmdbd reads it from there), mode 0600."""
        path = self.base / "etc" / "slurmdbd.conf"
        text = (
            "# slurmdbd.conf of the slurm-straggler development cluster (generated).\n"
            f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
            f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={self.dbd_port}\n"
            "SlurmUser=root\n"
            f"PidFile={self.base / 'run' / 'slurmdbd.pid'}\n"
            f"LogFile={self.base / 'log' / 'slurmdbd.log'}\nDebugLevel=info\n"
            "StorageType=accounting_storage/mysql\n"
            f"StorageHost=127.0.0.1\nStoragePort={self.mysql_port}\n"
            f"StorageUser=slurm\nStoragePass={self._password()}\nStorageLoc={DATABASE}\n"
        )
        write_if_changed(path, text)
        path.chmod(0o600)

    # -- daemons -----------------------------------------------------------------------------
    @property
    def mysql_pidfile(self) -> Path:
        return self.base / "run" / "mariadb.pid"

    @property
    def dbd_pidfile(self) -> Path:
        return self.base / "run" / "slurmdbd.pid"

    def daemons(self) -> dict[str, Path]:
        """Name -> pid file, for status and down."""
        return {"mariadb": self.mysql_pidfile, "slurmdbd": self.dbd_pidfile}

    def start(self) -> None:
        """MariaDB (its data directory made once), its ``slurm`` user, then slurmdbd; then the
        cluster, our account and the service account registered (idempotent)."""
        self._start_mariadb()
        self._start_slurmdbd()
        self._register()

    def _start_mariadb(self) -> None:
        if procs.is_alive(procs.read_pid(self.mysql_pidfile)):
            return
        if not (self.data / "mysql").is_dir():
            self.data.mkdir(parents=True, exist_ok=True)
            self._run(
                [
                    "mariadb-install-db",
                    "--user=root",
                    f"--datadir={self.data}",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ]
            )
        log_file = (self.base / "log" / "mariadb.log").open("ab")
        with log_file:
            # mariadbd does not daemonise itself: a session of its own, reaped by init.
            subprocess.Popen(
                [  # noqa: S607 - from PATH, as every daemon of the dev cluster
                    "mariadbd",
                    "--no-defaults",
                    "--user=root",
                    f"--datadir={self.data}",
                    f"--socket={self.socket}",
                    f"--port={self.mysql_port}",
                    "--bind-address=127.0.0.1",
                    f"--pid-file={self.mysql_pidfile}",
                    "--skip-log-bin",
                    "--innodb-buffer-pool-size=64M",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )
        self._wait(self._sql_ok, "mariadb to answer")
        password = self._password()
        self._sql(
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
            f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
            f"GRANT ALL ON {DATABASE}.* TO 'slurm'@'127.0.0.1';"
        )

    @property
    def socket(self) -> Path:
        return self.base / "run" / "mariadb.sock"

    def _sql(self, statements: str) -> str:
        return self._run(["mariadb", f"--socket={self.socket}", "-N", "-e", statements])

    def _sql_ok(self) -> bool:
        try:
            self._sql("SELECT 1")
        except CommandError:
            return False
        return True

    def _start_slurmdbd(self) -> None:
        if not procs.is_alive(procs.read_pid(self.dbd_pidfile)):
            self._run(["slurmdbd"], check=False)
        self._wait(self._dbd_ok, "slurmdbd to answer")

    def _dbd_ok(self) -> bool:
        try:
            self._run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"])
        except CommandError:
            return False
        return True

    def _register(self) -> None:
        listed = self._run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"])
        if self.cluster_name not in listed.split():
            self._run(["sacctmgr", "-i", "add", "cluster", self.cluster_name])
        accounts = self._run(["sacctmgr", "-n", "-P", "show", "account", "format=account"])
        if ACCOUNT not in accounts.split():
            self._run(["sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={self.cluster_name}"])
        self._ensure_unix_user(SERVICE_ACCOUNT)
        for user in ("root", SERVICE_ACCOUNT):
            self.add_user(user)

    def _ensure_unix_user(self, user: str) -> None:
        """The service account as the deploy guide makes it (a system user, no login, no
        home): slurmctld and slurmdbd know users by uid, so it must exist on this machine."""
        try:
            pwd.getpwnam(user)
        except KeyError:
            self._run(
                [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--home-dir",
                    "/nonexistent",
                    "--shell",
                    "/usr/sbin/nologin",
                    user,
                ]
            )

    def add_user(self, user: str, admin_level: str | None = None) -> None:
        """Associate ``user`` with our account (and set its AdminLevel when given)."""
        shown = self._run(["sacctmgr", "-n", "-P", "show", "user", user, "format=user"])
        if user not in shown.split():
            self._run(["sacctmgr", "-i", "add", "user", user, f"account={ACCOUNT}"])
        if admin_level is not None:
            self._run(
                ["sacctmgr", "-i", "modify", "user", user, "set", f"adminlevel={admin_level}"],
                check=False,  # exit 1 when nothing changed
            )

    def admin_level(self, user: str) -> str:
        """The AdminLevel slurmdbd has for ``user`` ("" when it knows no such user)."""
        out = self._run(["sacctmgr", "-n", "-P", "show", "user", user, "format=adminlevel"])
        return out.strip()

    def stop(self) -> list[str]:
        """Stop slurmdbd, then MariaDB (after slurmctld: it reports to slurmdbd to the end)."""
        stopped = []
        for name, pidfile in (("slurmdbd", self.dbd_pidfile), ("mariadb", self.mysql_pidfile)):
            pid = procs.read_pid(pidfile)
            if procs.is_alive(pid):
                procs.terminate([pid] if pid else [], timeout_s=15.0)
                stopped.append(name)
        return stopped

    # -- helpers -----------------------------------------------------------------------------
    def _run(self, argv: list[str], *, check: bool = True) -> str:
        env = {**os.environ, **self.env()}
        return run_command(argv, timeout_s=self.timeout_s, env=env, check=check).stdout

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise DevClusterError(f"timed out waiting for {what}; see {self.base / 'log'}")
            time.sleep(0.2)
