"""The relay's admission: who it serves, and the bounds per job and per user that keep any
one local user from taking every connection of the node (issue 38, item 4)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from slurm_plugin.telemetry import relay_peers
from slurm_plugin.telemetry.relay_peers import Admission

#: The (pid, uid) and job the fake kernel tells of each connection, by connection.
_WHO: dict[int, tuple[int, int, str | None]] = {}


@pytest.fixture(autouse=True)
def _fake_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(relay_peers, "MAX_PER_JOB", 3)
    monkeypatch.setattr(relay_peers, "MAX_PER_USER", 5)
    monkeypatch.setattr(relay_peers, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(relay_peers, "peer_credentials", lambda conn: _WHO[id(conn)][:2])
    yield
    _WHO.clear()


class _Conns:
    def __init__(self) -> None:
        self.open: list[socket.socket] = []

    def new(self, pid: int, uid: int, job: str | None) -> socket.socket:
        conn, other = socket.socketpair()
        self.open += [conn, other]
        _WHO[id(conn)] = (pid, uid, job)
        return conn

    def close(self) -> None:
        for conn in self.open:
            conn.close()


@pytest.fixture
def conns() -> Iterator[_Conns]:
    made = _Conns()
    yield made
    made.close()


def _job_of(pid: int) -> str | None:
    return next(job for p, _uid, job in _WHO.values() if p == pid)


def test_a_process_in_no_job_is_turned_away(conns: _Conns) -> None:
    admission = Admission("node1")
    assert admission.admit(conns.new(10, 1000, None), _job_of) is None
    assert admission.served == 0
    assert dict(admission.turned_away) == {"no job": 1}


def test_one_job_and_one_user_hold_a_bounded_share(conns: _Conns) -> None:
    admission = Admission("node1")
    admitted = [admission.admit(conns.new(100 + i, 1000, "7"), _job_of) for i in range(4)]
    assert [peer is not None for peer in admitted] == [True, True, True, False]
    # The same user's second job: up to the user's bound, then no more.
    second = [admission.admit(conns.new(200 + i, 1000, "8"), _job_of) for i in range(3)]
    assert [peer is not None for peer in second] == [True, True, False]
    assert dict(admission.turned_away) == {"job": 1, "user": 1}
    # Another user's job still gets in, and root's jobs are bounded per job only.
    assert admission.admit(conns.new(300, 1001, "9"), _job_of) is not None
    assert admission.admit(conns.new(400, 0, "10"), _job_of) is not None
    assert admission.served == 7
    assert admission.admit(conns.new(401, 0, "11"), _job_of) is not None
    assert admission.admit(conns.new(402, 0, "12"), _job_of) is None  # 8 in all
    assert admission.turned_away["relay"] == 1


def test_a_closed_connection_frees_its_place(conns: _Conns) -> None:
    admission = Admission("node1")
    held = [conns.new(100 + i, 1000, "7") for i in range(3)]
    for conn in held:
        assert admission.admit(conn, _job_of) is not None
    extra = conns.new(110, 1000, "7")
    assert admission.admit(extra, _job_of) is None
    admission.release(held[0])
    admission.release(extra)  # never admitted: nothing to free
    assert admission.served == 2
    assert admission.admit(conns.new(111, 1000, "7"), _job_of) is not None
    assert admission.peer(held[1]) == relay_peers.Peer(101, 1000, "7")
