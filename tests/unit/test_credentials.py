"""Per-job credentials: names, ACL rules, the URL and the credential file."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

import pytest

from slurm_plugin.errors import RedisUnavailableError, TelemetryError
from slurm_plugin.store import credentials
from slurm_plugin.store.telemetry_store import Tls, connect


def test_rules_grant_append_only_on_the_jobs_streams() -> None:
    """The job user may XADD/EXPIRE its own three streams, GET its advice and PING; nothing
    else (read-only on the advice: a job never writes what the service advises it)."""
    rules = credentials.job_rules("42")
    assert rules[:4] == ["reset", "on", "resetchannels", "-@all"]
    assert {r for r in rules if r.startswith("+")} == {
        "+xadd",
        "+expire",
        "+ping",
        "+get",
        "+cluster|slots",
        "+cluster|shards",
        "+command",
    }
    assert {r for r in rules if r.startswith("%")} == {
        "%W~stg:job:{42}:steps",
        "%W~stg:job:{42}:events",
        "%W~stg:job:{42}:gpu",
        "%R~stg:job:{42}:advice",
    }
    assert not any(r.startswith(("~", "%RW", "allkeys", "&")) for r in rules)


def test_hostile_job_id_is_refused() -> None:
    """A job id that could widen the key pattern never reaches ACL SETUSER."""
    for bad in ("*", "1}*", "1 ~*", "1\n"):
        with pytest.raises(TelemetryError):
            credentials.job_rules(bad)


def test_job_url_replaces_the_admin_credentials() -> None:
    """Scheme, host, port and database stay; the user and (quoted) password are the job's."""
    url = credentials.job_url("rediss://admin:adm@redis.example:6380/3", "7", "p/w:@x")
    assert url == "rediss://stg-job-7:p%2Fw%3A%40x@redis.example:6380/3"
    assert "adm" not in url
    assert credentials.job_url("redis://[::1]:1/0", "7", "p") == "redis://stg-job-7:p@[::1]:1/0"


def test_credential_file_is_private_and_a_settings_file(tmp_path: Path) -> None:
    """0600, owned by the job's user, in a 0711 directory; parses as settings TOML."""
    uid, gid = (65534, 65534) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    path = credentials.credential_path("9", tmp_path / "jobs")
    text = credentials.render("9", {"redis": {"url": 'redis://u:p"q@h:1/0', "cluster": False}})
    credentials.write_file(path, text, uid, gid)
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert (info.st_uid, info.st_gid) == (uid, gid)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o711
    assert tomllib.loads(path.read_text()) == {
        "redis": {"url": 'redis://u:p"q@h:1/0', "cluster": False}
    }
    assert [p.name for p in path.parent.iterdir()] == ["9.toml"]
    assert credentials.remove_file(path) is True
    assert credentials.remove_file(path) is False


def test_credential_directory_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks find the file through $STRAGGLER_TELEMETRY_JOB_CREDENTIALS_DIR (0.1's
    $STRAGGLER_JOB_CREDENTIALS_DIR still works), else the default."""
    monkeypatch.delenv(credentials.DIR_ENV, raising=False)
    assert credentials.credential_path("5") == credentials.DEFAULT_DIR / "5.toml"
    monkeypatch.delenv(credentials.OLD_DIR_ENV, raising=False)
    monkeypatch.setenv(credentials.OLD_DIR_ENV, str(tmp_path / "old"))
    assert credentials.credential_path("5") == tmp_path / "old" / "5.toml"
    monkeypatch.setenv(credentials.DIR_ENV, str(tmp_path))
    assert credentials.credential_path("5") == tmp_path / "5.toml"  # the new name wins


def test_tls_options_verify_the_server() -> None:
    """rediss:// always verifies the certificate and host name; redis:// refuses TLS files."""
    options = Tls(Path("/ca.pem")).options()
    assert options["ssl_cert_reqs"] == "required"
    assert options["ssl_check_hostname"] is True
    assert options["ssl_ca_certs"] == "/ca.pem"
    with pytest.raises(RedisUnavailableError, match="not a rediss:// URL"):
        connect("redis://127.0.0.1:1/0", tls=Tls(Path("/ca.pem")))
