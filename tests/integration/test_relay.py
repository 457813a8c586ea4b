"""Node relays: a node's ranks publish over one Redis connection, and nothing is lost or claimed
that the kernel does not vouch for (real redis-server, real Unix sockets, rank processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from slurm_plugin import StepReporter
from slurm_plugin.model import keys
from slurm_plugin.model.records import encode_steps
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry import outlet as outlet_module
from slurm_plugin.telemetry import relay_peers
from slurm_plugin.telemetry.relay import Relay, parse_message
from slurm_plugin.telemetry.relay_client import RelayClient, RelayTurnedAwayError
from tests.integration import relay_harness as harness
from tests.integration.conftest import RedisServer, wait_for
from tests.integration.relay_harness import JOB, REPO

pytestmark = pytest.mark.integration


@pytest.fixture
def relays(private_redis: RedisServer, tmp_path: Path) -> Iterator[list[Relay]]:
    started = []
    for i in range(4):
        relay = Relay(
            TelemetryStore(connect(private_redis.url)), f"node{i}", tmp_path / f"r{i}.sock"
        )
        relay.start()
        started.append(relay)
    yield started
    for relay in started:
        relay.close()


def _clients(control: redis.Redis) -> int:
    """Clients connected to the server, not counting ``control`` itself."""
    return len(control.client_list()) - 1


def test_the_ranks_of_a_node_share_its_relays_one_connection(
    private_redis: RedisServer, relays: list[Relay], tmp_path: Path
) -> None:
    per_node = 64
    procs = [
        harness.ranks(JOB, JOB, i * per_node, per_node, 6.0, relay.socket_path, private_redis.url)
        for i, relay in enumerate(relays)
    ]
    control = redis.Redis.from_url(private_redis.url)
    counts = []
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        counts.append(_clients(control))
        time.sleep(0.25)
    published = sum(harness.published(p) for p in procs)

    ranks = per_node * len(relays)
    assert counts
    assert max(counts) <= len(relays), counts
    records, repeats, malformed = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert (len(records), repeats, malformed) == (published, 0, 0)
    assert len({r.rank for r in records}) == ranks
    # Every record carries its relay's node, never the one the rank claimed.
    assert {(r.rank // per_node, r.node) for r in records} == {
        (i, f"node{i}") for i in range(len(relays))
    }
    # One stream entry per node and tick, not one per rank and flush.
    flushes = sum(relay.flushes for relay in relays)
    entries = int(control.xlen(keys.job_steps(JOB)))
    assert flushes >= ranks * 6
    assert entries == sum(relay.entries for relay in relays) <= flushes / 8
    print(  # noqa: T201 - the figures, with -s
        f"\n{ranks} ranks on {len(relays)} relays: at most {max(counts)} server clients, "
        f"{published} records in {entries} entries ({flushes} rank flushes)"
    )


def test_a_relay_refuses_another_jobs_flush_and_the_rank_publishes_itself(
    private_redis: RedisServer, relays: list[Relay]
) -> None:
    # A process of job 7 claims to publish for job 4242: the relay refuses it; the reporter
    # then publishes to Redis itself (where per-job credentials, when on, stop it).
    proc = harness.ranks("7", JOB, 0, 4, 2.0, relays[0].socket_path, private_redis.url)
    published = harness.published(proc)
    assert relays[0].refused >= 1
    assert relays[0].flushes == 0
    records, _, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert len(records) == published > 0
    assert {r.node for r in records} == {"claimed"}


def test_a_relay_that_stops_loses_nothing(private_redis: RedisServer, relays: list[Relay]) -> None:
    proc = harness.ranks(JOB, JOB, 0, 16, 5.0, relays[0].socket_path, private_redis.url)
    wait_for(lambda: relays[0].entries >= 2, 30, "the relay to store the ranks' flushes")
    relays[0].close()  # the reporters go on to Redis themselves
    published = harness.published(proc)
    records, _, malformed = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert (len(records), malformed) == (published, 0)
    assert {r.node for r in records} == {"node0", "claimed"}
    steps = {(r.rank, r.step) for r in records}
    assert len(steps) == len(records)  # each step once


def test_straggler_relay_serves_until_sigterm(private_redis: RedisServer, tmp_path: Path) -> None:
    sock = tmp_path / "run" / "relay.sock"
    env = {**os.environ, "STRAGGLER_REDIS_URL": private_redis.url, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "slurm_plugin.cli.main", "relay", "--node", "nodeZ"]
    relay = subprocess.Popen(
        [*argv, "--socket", str(sock), "--tick", "0.5", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sock.exists(), "the relay did not listen"
        assert oct(sock.stat().st_mode & 0o777) == oct(0o666)
        published = harness.published(harness.ranks(JOB, JOB, 0, 4, 2.0, sock, private_redis.url))
    finally:
        relay.terminate()
        out, err = relay.communicate(timeout=30)
    assert relay.returncode == 0, err
    assert not sock.exists()
    counts = json.loads(out)
    assert counts["node"] == "nodeZ"
    assert counts["refused"] == 0
    assert 0 < counts["entries"] < counts["flushes"]
    records, _, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert len(records) == published > 0
    assert {r.node for r in records} == {"nodeZ"}


def test_a_flush_sent_again_after_a_missed_answer_is_stored_once(
    private_redis: RedisServer, relays: list[Relay]
) -> None:
    relay = relays[0]
    steps = [(7, 1.0, 1.0, 0.5, None, None)]
    flush = encode_steps(3, "claimed", 0, 0, steps, flush="00000000000000ff.1")
    message = json.dumps({"job_id": JOB, "steps": [flush], "events": []}).encode()
    assert relay.publish([parse_message(message)]) is None
    assert relay.publish([parse_message(message)]) is None  # the reporter did not hear the answer
    records, repeats, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert [(r.rank, r.step, r.node) for r in records] == [(3, 7, "node0")]
    assert (relay.repeats, repeats) == (1, 0)


def _started_relay(server: RedisServer, directory: Path) -> Relay:
    """A started relay on node0 that takes every connecting process for one of JOB's, ticking
    every 0.1 s."""
    relay = Relay(
        TelemetryStore(connect(server.url)),
        "node0",
        directory / "r.sock",
        tick_s=0.1,
        job_of=lambda _pid: JOB,
    )
    relay.start()
    return relay


def test_connections_are_bounded_and_forgotten_when_they_close(
    private_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_peers, "MAX_PER_JOB", 3)
    relay = _started_relay(private_redis, tmp_path)
    steps = [(1, 1.0, 1.0, 0.5, None, None)]

    def publish(client: RelayClient, rank: int) -> None:
        client.publish(JOB, [encode_steps(rank, "x", 0, 0, steps)])

    held: list[RelayClient] = []
    try:
        held = [RelayClient.connect(relay.socket_path) for _ in range(3)]
        for rank, client in enumerate(held):
            publish(client, rank)
        extra = RelayClient.connect(relay.socket_path)  # the kernel accepts; the relay closes
        # Whoever is first (the relay's close, or the client's write after it: EOF, EPIPE or
        # ECONNRESET), a connection closed before any answer reads as turned away.
        with pytest.raises(RelayTurnedAwayError, match="turned the connection away"):
            publish(extra, 3)
        extra.close()
        for client in held:
            client.close()
        wait_for(lambda: relay.connections == 0, 10, "the relay to see its clients go")
        for rank in range(4, 10):  # more reporters than the bound, one after another
            client = RelayClient.connect(relay.socket_path)
            publish(client, rank)
            client.close()
    finally:
        for client in held:
            client.close()
        relay.close()
    records, _, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert sorted(r.rank for r in records) == [0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_a_rank_takes_to_a_relay_started_after_it(
    private_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No relay when the job starts: the rank publishes itself. Once a relay answers (tried
    again every RELAY_RETRY_S) the rank publishes through it and closes its own connection;
    every step is stored once."""
    monkeypatch.setattr(outlet_module, "RELAY_RETRY_S", 0.5)
    sock = tmp_path / "late.sock"
    control = redis.Redis.from_url(private_redis.url)
    reporter = StepReporter(
        JOB,
        5,
        "claimed",
        store_factory=lambda: TelemetryStore(connect(private_redis.url, retries=0)),
        flush_interval_s=0.1,
        relay_socket=sock,
    )
    relay = Relay(
        TelemetryStore(connect(private_redis.url)), "node0", sock, tick_s=0.1, job_of=lambda _: JOB
    )

    def run(steps: range) -> None:
        for step in steps:
            reporter.record(step, 0.1, 0.08, 0.015, 0.005)
            time.sleep(0.02)
        assert reporter.flush(timeout_s=10)

    try:
        run(range(20))
        assert _clients(control) == 1  # the rank's own connection
        relay.start()
        deadline = time.monotonic() + 10
        step = 20
        while relay.flushes == 0 and time.monotonic() < deadline:
            run(range(step, step + 5))
            step += 5
        run(range(step, step + 20))
        step += 20
        assert relay.flushes > 0
        assert _clients(control) == 1  # now the relay's; the rank closed its own
    finally:
        reporter.close()
        relay.close()
    records, repeats, malformed = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert sorted(r.step for r in records) == list(range(step))
    assert (repeats, malformed) == (0, 0)
    direct = {r.step for r in records if r.node == "claimed"}
    relayed = {r.step for r in records if r.node == "node0"}
    assert direct >= set(range(20))
    assert relayed >= set(range(step - 20, step))


def test_a_closed_reporter_holds_no_connection(private_redis: RedisServer) -> None:
    """A reporter publishing to Redis itself closes its connection when it is closed: at 16k
    ranks every one left open counts against the server's maxclients."""
    control = redis.Redis.from_url(private_redis.url)
    reporter = StepReporter(
        JOB, 1, "n1", store_factory=lambda: TelemetryStore(connect(private_redis.url))
    )
    reporter.record(0, 0.1, 0.08, 0.015, 0.005)
    assert reporter.flush(timeout_s=10)
    assert _clients(control) == 1
    reporter.close()
    assert _clients(control) == 0
    control.close()


def _message(job: str, rank: int, step: int, events: list[dict[str, object]]) -> bytes:
    steps = [(step, 1.0, 1.0, 0.5, None, None)]
    flush = encode_steps(rank, "claimed", 0, 0, steps, flush=f"{rank:016x}.{step}")
    return json.dumps({"job_id": job, "steps": [flush], "events": events}).encode()


def test_a_nan_event_is_refused_and_the_relay_publishes_on(
    private_redis: RedisServer, relays: list[Relay]
) -> None:
    """Issue 25: a NaN event through a relay killed its publish thread (every job on the node
    stopped publishing), and a restarted relay died again on the resent event. Now the event
    alone is refused, counted and answered; its steps and every later flush are stored."""
    relay = relays[0]
    poisoned = _message(JOB, 1, 0, [{"name": "eval", "loss": float("nan")}, {"name": "ok"}])
    assert b"NaN" in poisoned  # what a client's json.dumps writes by default
    assert relay._handle(poisoned, JOB, 0) == {"ok": True, "invalid_events": 1}
    assert relay._handle(_message("4243", 2, 1, []), "4243", 0) == {"ok": True, "invalid_events": 0}
    assert all(thread.is_alive() for thread in relay._threads)
    assert relay.invalid_events == 1
    store = TelemetryStore(connect(private_redis.url))
    assert [e["name"] for e in store.read_json(keys.job_events(JOB))] == ["ok"]
    records, _, malformed = harness.read_all(store)
    assert ([(r.rank, r.step) for r in records], malformed) == ([(1, 0)], 0)
    assert [r.step for r in store.iter_steps("4243")] == [1]


def test_a_relay_that_cannot_publish_a_job_refuses_it_and_serves_the_others(
    private_redis: RedisServer, relays: list[Relay], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A surprise in publishing one job's flushes (not Redis being away) is answered as a
    refusal, so that job's ranks publish to Redis themselves; the other jobs go on."""
    relay = relays[0]
    real = relay.store.publish

    def publish(job_id: str, *args: object, **kwargs: object) -> int:
        if job_id == "666":
            raise RuntimeError("a bug in packing this job")
        return real(job_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(relay.store, "publish", publish)
    answer = relay._handle(_message("666", 0, 0, []), "666", 0)
    assert answer["refused"] is True, answer
    assert "a bug in packing" in answer["error"], answer
    assert relay._handle(_message(JOB, 1, 5, []), JOB, 0)["ok"] is True
    assert all(thread.is_alive() for thread in relay._threads)
    records, _, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert [(r.rank, r.step) for r in records] == [(1, 5)]


def test_ranks_over_the_bound_publish_to_redis_themselves_and_lose_nothing(
    private_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38, item 4: a relay at its bound for the job turns the next ranks' connections
    away; those ranks publish to Redis themselves at once (they are not refused again and
    again, losing their records at the job's end)."""
    monkeypatch.setattr(relay_peers, "MAX_PER_JOB", 4)
    relay = Relay(TelemetryStore(connect(private_redis.url)), "node0", tmp_path / "r.sock")
    relay.start()
    try:
        proc = harness.ranks(JOB, JOB, 0, 8, 3.0, relay.socket_path, private_redis.url)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    finally:
        relay.close()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dropped"] == 0
    records, repeats, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert (len(records), repeats) == (result["published"], 0)
    by_node: dict[str, set[int]] = {}
    for record in records:
        by_node.setdefault(record.node, set()).add(record.rank)
    # Four ranks through the relay (its node), four to Redis themselves (the node they claim),
    # and every step of every rank stored.
    assert sorted(len(ranks) for ranks in by_node.values()) == [4, 4]
    assert set(by_node) == {"node0", "claimed"}
    assert result["published"] == 8 * result["steps"]
    assert relay.admission.turned_away["job"] >= 4


def test_a_line_nested_too_deep_is_refused_and_the_connection_serves_on(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    """Issue 38, item 9: a 100,000-deep JSON line raised RecursionError in the relay's
    connection thread (a traceback, the connection gone, nothing counted). It is refused and
    counted like any bad message, and the next flush on the same connection is stored."""
    relay = _started_relay(private_redis, tmp_path)
    conn = socket.socket(socket.AF_UNIX)
    try:
        conn.connect(str(relay.socket_path))
        reader = conn.makefile("rb")
        conn.sendall(b"[" * 100_000 + b"]" * 100_000 + b"\n")
        refused = json.loads(reader.readline())
        assert refused == {"ok": False, "refused": True, "error": refused["error"]}
        assert "nested too deep" in refused["error"]
        conn.sendall(_message(JOB, 1, 5, []) + b"\n")
        assert json.loads(reader.readline()) == {"ok": True, "invalid_events": 0}
    finally:
        conn.close()
        relay.close()
    assert relay.refused == 1
    records, _, _ = harness.read_all(TelemetryStore(connect(private_redis.url)))
    assert [(r.rank, r.step) for r in records] == [(1, 5)]
