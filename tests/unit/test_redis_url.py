"""Redis URLs: the Sentinel form parsed, refused when wrong, and every URL helper agreeing on it;
flushes missing from a stream counted."""

from __future__ import annotations

import time

import pytest

from slurm_plugin.config import Settings, holds_secret, redact_url, redis_database
from slurm_plugin.errors import RedisUnavailableError
from slurm_plugin.model.redis_url import (
    SENTINEL_PORT,
    endpoint,
    is_sentinel,
    parse_sentinel,
    password_of,
    with_user,
)
from slurm_plugin.store import credentials
from slurm_plugin.store.telemetry_store import connect, entries_page

pytestmark = pytest.mark.unit

URL = "redis+sentinel://admin:s%40cret@10.0.0.1:26380,10.0.0.2,[fd00::3]:26381/stg/0"


def test_sentinel_url_is_parsed() -> None:
    parsed = parse_sentinel(URL + "?sentinel_password=sp")
    assert parsed.sentinels == (
        ("10.0.0.1", 26380),
        ("10.0.0.2", SENTINEL_PORT),
        ("fd00::3", 26381),
    )
    assert (parsed.service, parsed.db, parsed.tls) == ("stg", 0, False)
    assert (parsed.username, parsed.password) == ("admin", "s@cret")
    assert parsed.sentinel_password == "sp"  # noqa: S105 - a test URL
    assert parsed.sentinel_username is None
    assert "sp" not in repr(parsed)
    assert parse_sentinel("rediss+sentinel://h/stg/3").tls
    assert parse_sentinel("redis+sentinel://h/stg").db == 0
    assert is_sentinel("REDIS+SENTINEL://h/stg")
    assert not is_sentinel("redis://h:6379/0")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel:///stg", "at least one Sentinel"),
        ("redis+sentinel://h:26379", "/SERVICE"),
        ("redis+sentinel://h/stg/0/extra", "/SERVICE"),
        ("redis+sentinel://h/stg/x", "database must be a number"),
        ("redis+sentinel://h:port/stg", "not a number"),
        ("redis+sentinel://h:70000/stg", "out of range"),
        ("redis+sentinel://h/stg?sentinel_pasword=x", "unknown Sentinel URL parameter"),
        ("redis://h/0", r"starts with redis\+sentinel"),
    ],
)
def test_bad_sentinel_urls_are_refused_with_the_reason(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel(url)


def test_url_helpers_agree_on_the_sentinel_form() -> None:
    assert redis_database(URL) == 0
    assert redis_database("redis+sentinel://h/stg/5") == 5
    assert redis_database("redis+sentinel://h/stg/x") is None
    assert password_of(URL) == "s@cret"
    assert holds_secret({"redis_url": URL})
    assert holds_secret({"redis_url": "redis+sentinel://h/stg?sentinel_password=p"})
    assert not holds_secret({"redis_url": "redis+sentinel://h1,h2/stg/0"})
    assert "s%40cret" not in redact_url(URL)
    assert "sp" not in redact_url("redis+sentinel://h/stg?sentinel_password=sp")
    # The deployment is the master's name and database, not where the master is right now.
    assert endpoint(URL) == "sentinel:stg/0"
    moved = Settings(redis={"url": "redis+sentinel://10.9.9.9:1,10.9.9.8:2/stg/0"})
    assert Settings(redis={"url": URL}).deployment == moved.deployment
    assert Settings(redis={"url": "redis+sentinel://h/other/0"}).deployment != moved.deployment


def test_a_jobs_credentials_go_in_the_masters_userinfo() -> None:
    url = credentials.job_url(URL + "?sentinel_password=sp", "42", "p/w")
    parsed = parse_sentinel(url)
    assert (parsed.username, parsed.password) == (credentials.username("42"), "p/w")
    assert parsed.sentinels == parse_sentinel(URL).sentinels
    assert parsed.sentinel_password == "sp"  # noqa: S105 - kept: the Sentinels. login
    assert with_user("redis://10.0.0.1:6379/0", "u", "p") == "redis://u:p@10.0.0.1:6379/0"
    assert with_user("redis://[::1]:6379/0", "u", "p") == "redis://u:p@[::1]:6379/0"


def test_job_credentials_need_database_zero_behind_sentinel_too() -> None:
    with pytest.raises(ValueError, match="database 0"):
        Settings(redis={"url": "redis+sentinel://h/stg/2"}, telemetry={"job_credentials": True})
    assert Settings(
        redis={"url": "redis+sentinel://h/stg/0"}, telemetry={"job_credentials": True}
    ).telemetry.job_credentials


def test_connect_refuses_what_cannot_work() -> None:
    with pytest.raises(RedisUnavailableError, match="exclude each other"):
        connect("redis+sentinel://h/stg/0", cluster=True)
    with pytest.raises(RedisUnavailableError, match="bad Redis URL"):
        connect("redis+sentinel://h:x/stg")
    client = connect("redis+sentinel://127.0.0.1:1/stg/0")  # nothing sent until a command
    client.close()


def _entry(seq: int, session: str = "a" * 16, rank: str = "0") -> tuple[bytes, dict[bytes, bytes]]:
    fields = {b"rank": rank.encode(), b"flush": f"{session}.{seq}".encode()}
    return f"{seq}-0".encode(), fields


def test_flushes_missing_between_two_read_are_counted() -> None:
    seen: dict[tuple[str, str], int] = {}
    first = entries_page([_entry(3), _entry(4), _entry(7)], "0-0", seen=seen)
    # A session first read at 3 starts there (earlier ones were trimmed or read by another
    # service); 5 and 6 never reached the stream.
    assert (first.read, first.repeats, first.missing) == (3, 0, 2)
    second = entries_page(
        [_entry(7), _entry(8), _entry(10), _entry(2, "b" * 16, "1")], "7-0", seen=seen
    )
    assert (second.repeats, second.missing) == (1, 1)
    assert len(second.entries) == 3


def test_a_url_naming_thousands_of_sentinels_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 38, item 9: `status` with thousands of unreachable Sentinels ran past two
    minutes (clients ask them one by one); more than MAX_SENTINELS is a one-line error."""
    from click.testing import CliRunner  # noqa: PLC0415

    from slurm_plugin.cli.main import cli  # noqa: PLC0415

    hosts = ",".join(f"10.255.{i // 250}.{i % 250 + 1}:26379" for i in range(5000))
    url = f"redis+sentinel://{hosts}/mymaster/0"
    with pytest.raises(ValueError, match="at most 16 Sentinels, not 5000"):
        parse_sentinel(url)
    assert len(parse_sentinel(url.replace(hosts, ",".join(hosts.split(",")[:16]))).sentinels) == 16
    monkeypatch.setenv("STRAGGLER_REDIS_URL", url)
    started = time.monotonic()
    result = CliRunner().invoke(cli, ["status"])
    assert time.monotonic() - started < 10
    assert result.exit_code != 0
    assert "at most 16 Sentinels" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
