"""Redis URLs: the plain form redis-py knows, and the Sentinel form it does not.

``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]`` names a set of
Sentinels (port 26379 by default) and the master they watch; ``rediss+sentinel://`` speaks TLS
to the Sentinels and to the master. The userinfo is the master's (a job's credentials go
there, as in a plain URL); the Sentinels' own, when they require one, go in the query:
``?sentinel_username=U&sentinel_password=P``. This is the form other Redis tools use (Celery,
Kombu, Sidekiq-style ``redis+sentinel``), so a site writes its URL once for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

SENTINEL_SCHEMES = frozenset({"redis+sentinel", "rediss+sentinel"})
SENTINEL_PORT = 26379
#: The most Sentinels a URL may name: clients ask them one after another, each up to the
#: Redis timeout, so thousands of unreachable ones held `status` for minutes (a site runs
#: three or five).
MAX_SENTINELS = 16
#: Query parameters of a Sentinel URL (anything else is refused: a typo must not go unheard).
SENTINEL_PARAMS = frozenset({"sentinel_username", "sentinel_password"})


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def is_sentinel(url: str) -> bool:
    """True for a ``redis+sentinel://`` or ``rediss+sentinel://`` URL."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def parse_sentinel(url: str) -> SentinelUrl:
    """``url`` parsed; :class:`ValueError` naming what is wrong (never echoing a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError("a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    items = [item for item in hosts.split(",") if item]
    if len(items) > MAX_SENTINELS:
        raise ValueError(
            f"a Sentinel URL names at most {MAX_SENTINELS} Sentinels, not {len(items)} "
            "(clients try them one after another)"
        )
    sentinels = tuple(_host_port(item) for item in items)
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one Sentinel: HOST[:PORT][,HOST[:PORT]]")
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError("a Sentinel URL's path is /SERVICE or /SERVICE/DB (the master's name)")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"database must be a number, not {parts[1]!r}")
        db = int(parts[1])
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(params) - SENTINEL_PARAMS)
    if unknown:
        raise ValueError(
            f"unknown Sentinel URL parameter(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(SENTINEL_PARAMS))})"
        )
    return SentinelUrl(
        sentinels=sentinels,
        service=parts[0],
        db=db,
        username=username,
        password=password,
        tls=scheme.lower() == "rediss+sentinel",
        sentinel_username=params.get("sentinel_username") or None,
        sentinel_password=params.get("sentinel_password") or None,
    )


def _host_port(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, tail = item[1:].partition("]")
        port_text = tail.removeprefix(":")
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError(f"Sentinel address {item!r} has no host")
    if port_text and not port_text.isdigit():
        raise ValueError(f"Sentinel address {item!r} has a port that is not a number")
    port = int(port_text) if port_text else SENTINEL_PORT
    if not 0 < port < 65536:
        raise ValueError(f"Sentinel address {item!r} has a port out of range")
    return host, port


def database(url: str) -> int | None:
    """The database ``url`` selects (plain: path ``/N`` or ``?db=N``; Sentinel: ``/SERVICE/N``;
    0 when it names none), or None when it is not a number or the URL does not parse."""
    if is_sentinel(url):
        try:
            return parse_sentinel(url).db
        except ValueError:
            return None
    try:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
    except ValueError:
        return None
    text = query.get("db") or parts.path.strip("/") or "0"
    return int(text) if text.isdigit() else None


def endpoint(url: str) -> str:
    """What names the data behind ``url``, never its password: ``host:port/db``; for Sentinel
    ``sentinel:SERVICE/db`` (the master moves between servers, the data it serves does not)."""
    if is_sentinel(url):
        parsed = parse_sentinel(url)
        return f"sentinel:{parsed.service}/{parsed.db}"
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}/{database(url)}"


def raw_userinfo_password(url: str) -> bool:
    """True when the text between ``://`` and the URL's last ``@`` holds a ``:`` (a
    password), whatever a parser makes of a raw ``?``, ``#`` or ``/`` inside it."""
    rest = url.partition("://")[2]
    userinfo, at, _ = rest.rpartition("@")
    return bool(at) and ":" in userinfo


def unencoded_userinfo(url: str) -> bool:
    """True when the userinfo holds a raw ``?``, ``#`` or ``/``: parsers (redis-py's too) end
    the host part there, so the password is cut and the rest taken for the host."""
    rest = url.partition("://")[2]
    userinfo, at, _ = rest.rpartition("@")
    if not at or "=" in userinfo:  # an "@" in a query value (?password=a@b) is not one
        return False
    return ":" in userinfo and any(c in userinfo for c in "?#/")


def password_of(url: str) -> str | None:
    """The password in ``url``'s userinfo (the master's, for a Sentinel URL)."""
    if is_sentinel(url):
        return parse_sentinel(url).password
    return urlsplit(url).password


def with_user(url: str, username: str, password: str) -> str:
    """``url`` with ``username:password`` in place of its userinfo (plain or Sentinel form)."""
    scheme, _, rest = url.partition("://")
    userinfo = f"{quote(username, safe='')}:{quote(password, safe='')}@"
    if is_sentinel(url):
        rest, mark, query = rest.partition("?")
        netloc, slash, path = rest.partition("/")
        hosts = netloc.rpartition("@")[2]
        return f"{scheme}://{userinfo}{hosts}{slash}{path}{mark}{query}"
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{userinfo}{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
