"""StepReporter without Redis: disabled reporters, bad input, fork safety, and its flush,
retry and bounds against ``slurm_plugin.testing.FakeStore``."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from structlog.testing import capture_logs

from slurm_plugin import StepReporter
from slurm_plugin.errors import RedisUnavailableError
from slurm_plugin.model.columns import decode_entries
from slurm_plugin.store.telemetry_store import TelemetryStore
from slurm_plugin.telemetry import reporter as reporter_module
from slurm_plugin.telemetry.job_env import rank_env
from slurm_plugin.testing import FakeStore


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reporter_module, "_disabled_logged", False)
    for name in list(os.environ):
        if name.startswith(("STRAGGLER_", "SLURM")):
            monkeypatch.delenv(name)


def _unreachable() -> TelemetryStore:
    raise RedisUnavailableError("no server in unit tests")


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({}, "not inside a Slurm job"),
        ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "two"}, "SLURM_PROCID='two' is not an integer"),
        ({"SLURM_JOB_ID": "5", "SLURM_LOCALID": "-1"}, "SLURM_LOCALID=-1 is negative"),
        ({"SLURM_JOB_ID": "5;FLUSHALL"}, "invalid job id"),
        ({"SLURM_JOB_ID": "5", "SLURMD_NODENAME": "bad node"}, "invalid node name"),
        ({"SLURM_JOB_ID": "5", "STRAGGLER_REDIS_URL": "http://x"}, "bad Redis URL"),
        ({"SLURM_JOB_ID": "5", "STRAGGLER_TELEMETRY_ENABLED": "false"}, "[telemetry] enabled"),
        ({"SLURM_JOB_ID": "5", "STRAGGLER_REDIS_TIMEOUT_S": "-3"}, "redis.timeout_s"),
    ],
)
def test_bad_environment_gives_a_silent_reporter_and_one_log_line(
    env: dict[str, str], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """from_env never raises: it returns a no-op reporter and logs why, once."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with capture_logs() as logs:
        rep = StepReporter.from_env()
        rep.record(0, float("nan"))
        rep.event("checkpoint_end")
        with rep.step(), rep.phase("compute"):
            pass
        rep.close()
        StepReporter.from_env()  # a second one does not log again
    assert not rep.enabled
    disabled = [entry for entry in logs if entry["event"] == "telemetry.disabled"]
    assert len(disabled) == 1
    assert reason in disabled[0]["reason"]


def test_valid_environment_enables_the_reporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's variables become the reporter's identity."""
    for key, value in {
        "SLURM_JOB_ID": "91",
        "SLURM_PROCID": "7",
        "SLURM_LOCALID": "3",
        "SLURMD_NODENAME": "gpu-a17",
        "SLURM_RESTART_COUNT": "2",
        "STRAGGLER_REDIS_URL": "redis://127.0.0.1:1/0",
    }.items():
        monkeypatch.setenv(key, value)
    rep = StepReporter.from_env()
    try:
        assert (rep.enabled, rep.job_id, rep.rank, rep.gpu, rep.node, rep.attempt) == (
            True,
            "91",
            7,
            3,
            "gpu-a17",
            2,
        )
    finally:
        rep.close(timeout_s=1)


def test_workers_of_srun_torchrun_keep_their_own_ranks() -> None:
    """Issue 38, item 7: under `srun torchrun` the four workers of a node inherit their srun
    task's SLURM_PROCID=1 and SLURM_LOCALID=0; read first, they reported as one rank on GPU
    0 (every step twice). torchrun's workers (TORCHELASTIC_RUN_ID) are told apart by torch's
    RANK, LOCAL_RANK and WORLD_SIZE; a plain srun task keeps Slurm's (a stale RANK in its
    environment changes nothing)."""
    task = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}
    workers = [
        rank_env(
            {
                **task,
                "TORCHELASTIC_RUN_ID": "777",
                "RANK": str(4 + w),
                "LOCAL_RANK": str(w),
                "WORLD_SIZE": "8",
            }
        )
        for w in range(4)
    ]
    assert [(e.rank, e.gpu, e.world) for e in workers] == [(4 + w, w, 8) for w in range(4)]
    plain = rank_env({**task, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert (plain.rank, plain.gpu, plain.world) == (1, 0, 2)
    # torchrun outside Slurm: torch's variables alone.
    alone = rank_env({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "3"})
    assert (alone.rank, alone.gpu) == (3, 3)


def test_unknown_phase_is_a_programming_error() -> None:
    """A typo in a phase name fails at once, in the caller's code (not in the hot path)."""
    rep = StepReporter("1", 0, "n1", store_factory=_unreachable)
    try:
        with pytest.raises(ValueError, match="unknown phase 'compte'"):
            rep.phase("compte")
    finally:
        rep.close(timeout_s=1)


def test_buffer_is_bounded_and_drops_are_counted() -> None:
    """With Redis away the buffer keeps the newest records only and counts the rest."""
    rep = StepReporter(
        "1", 0, "n1", store_factory=_unreachable, buffer_records=100, flush_interval_s=60
    )
    try:
        for step in range(250):
            rep.record(step, 0.1)
        assert rep.dropped == 150
        assert not rep.flush(timeout_s=0.3)
    finally:
        rep.close(timeout_s=1)


def _child(rep: StepReporter, queue: multiprocessing.Queue[tuple[bool, bool, int]]) -> None:
    rep.record(1, 0.1)
    queue.put((rep.enabled, rep._thread is None, len(rep._buf)))


def test_forked_child_gets_an_inert_reporter() -> None:
    """A forked dataloader worker neither shares the buffer nor thinks it has a flusher."""
    rep = StepReporter("1", 0, "n1", store_factory=_unreachable, flush_interval_s=60)
    try:
        rep.record(0, 0.1)
        ctx = multiprocessing.get_context("fork")
        queue: multiprocessing.Queue[tuple[bool, bool, int]] = ctx.Queue()
        proc = ctx.Process(target=_child, args=(rep, queue))
        proc.start()
        result = queue.get(timeout=10)
        proc.join(10)
        assert result == (False, True, 0)
        assert rep.enabled
        assert len(rep._buf) == 1
    finally:
        rep.close(timeout_s=1)


@pytest.mark.parametrize(("label", "expected"), [("stage3", "stage3"), ("a b;c", "")])
def test_the_peer_group_comes_from_straggler_group(
    label: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STRAGGLER_GROUP labels the rank's records; a malformed label is dropped with a warning
    and the rank still publishes (without a group)."""
    for key, value in {
        "SLURM_JOB_ID": "91",
        "STRAGGLER_REDIS_URL": "redis://127.0.0.1:1/0",
        "STRAGGLER_GROUP": label,
    }.items():
        monkeypatch.setenv(key, value)
    with capture_logs() as logs:
        rep = StepReporter.from_env()
    try:
        assert rep.enabled
        assert rep.group == expected
        warned = [e for e in logs if e["event"] == "telemetry.group_ignored"]
        assert bool(warned) == (expected == "")
    finally:
        rep.close(timeout_s=0.1)


def test_a_device_mesh_gives_its_non_data_parallel_coordinates() -> None:
    """``group_from_mesh``: pipeline and tensor coordinates label the group; the data-parallel
    dimension does not; a pure data-parallel mesh gives no group."""
    pytest.importorskip("torch")
    from slurm_plugin.telemetry.torch import group_from_mesh  # noqa: PLC0415

    class Mesh:
        def __init__(self, names: tuple[str, ...], coords: list[int]) -> None:
            self.mesh_dim_names = names
            self._coords = coords

        def get_coordinate(self) -> list[int]:
            return self._coords

    assert group_from_mesh(Mesh(("dp", "pp", "tp"), [5, 2, 0])) == "pp=2.tp=0"
    assert group_from_mesh(Mesh(("dp",), [5])) == ""
    assert group_from_mesh(Mesh(("replicate", "shard"), [1, 3]), ("replicate", "shard")) == ""
    # FSDP2's HSDP mesh and torchtitan's names are data parallel by default.
    assert group_from_mesh(Mesh(("replicate", "shard"), [1, 3])) == ""
    assert group_from_mesh(Mesh(("dp_replicate", "dp_shard", "tp"), [0, 1, 3])) == "tp=3"


def _reporter(store: FakeStore, **kwargs: object) -> StepReporter:
    """A reporter on ``store`` that flushes only when asked and retries at once."""
    options: dict[str, object] = {"flush_interval_s": 3600, "backoff_s": (0.001, 0.001)}
    options.update(kwargs)
    return StepReporter("7", 3, "node1", 1, store_factory=lambda: store, **options)  # type: ignore[arg-type]


def _flushed(store: FakeStore, steps: int) -> StepReporter:
    """A reporter on ``store`` that recorded ``steps`` steps, flushed them all and closed."""
    rep = _reporter(store)
    try:
        for step in range(steps):
            rep.record(step, 0.1)
        assert rep.flush(timeout_s=10)
    finally:
        rep.close()
    return rep


def test_a_flush_reaches_the_store_as_the_service_reads_it() -> None:
    """Steps recorded before a flush are stored once, in the entry format the service
    decodes: every value as recorded, the rank's identity, one flush id per entry."""
    store = FakeStore()
    rep = _reporter(store)
    try:
        for step in range(25):
            rep.record(step, 0.5, compute_s=0.25 + step / 1000, comm_s=0.2, data_s=None)
        assert rep.flush(timeout_s=10)
    finally:
        rep.close()
    decoded = decode_entries(store.steps)
    assert decoded.malformed == 0
    batch = decoded.batch
    assert batch.step.tolist() == list(range(25))
    assert set(batch.rank.tolist()) == {3}
    assert set(batch.gpu.tolist()) == {1}
    assert batch.compute_s.tolist() == pytest.approx([0.25 + s / 1000 for s in range(25)])
    assert rep.published == 25
    assert len({e["flush"] for e in store.steps}) == len(store.steps)
    assert store.connection.closed  # close() let go of Redis


def test_a_flush_redis_refused_is_sent_again_whole() -> None:
    """Redis away for two publishes: the flush is kept, sent again as it was (same flush id),
    and stored once; nothing is counted as dropped."""
    store = FakeStore()
    store.fail_next = 2
    rep = _flushed(store, 10)
    assert store.calls == 3
    assert len(store.steps) == 1
    assert decode_entries(store.steps).batch.step.tolist() == list(range(10))
    assert (rep.published, rep.dropped) == (10, 0)


def test_a_flush_stored_without_an_answer_comes_again_under_the_same_id() -> None:
    """Redis stored the flush but the answer was lost: the retry carries the same flush id
    and steps, which is what lets the service read it once."""
    store = FakeStore()
    store.lose_answer = 1
    rep = _flushed(store, 5)
    first, again = store.steps
    assert first == again
    assert rep.published == 5


def test_while_redis_is_away_the_newest_records_are_kept_and_the_loss_is_reported() -> None:
    """buffer_records bounds what waits for Redis, counting the oldest as dropped; when Redis
    answers again the kept records are stored and a telemetry_dropped event says how many
    were lost."""
    store = FakeStore()
    store.fail_next = 1_000_000
    rep = _reporter(store, buffer_records=100)
    try:
        for step in range(250):
            rep.record(step, 0.1)
        assert not rep.flush(timeout_s=0.2)  # Redis away: nothing stored
        assert rep.dropped == 150
        store.fail_next = 0
        assert rep.flush(timeout_s=10)
    finally:
        rep.close()
    assert decode_entries(store.steps).batch.step.tolist() == list(range(150, 250))
    (dropped,) = [e for e in store.events if e["name"] == "telemetry_dropped"]
    assert dropped["dropped"] == 150
    assert rep.published == 100


def test_an_event_redis_would_refuse_never_holds_back_the_steps() -> None:
    """A NaN in an event is refused alone (counted); the steps beside it are stored."""
    store = FakeStore()
    rep = _reporter(store)
    try:
        rep.record(1, 0.1)
        rep.event("checkpoint_end", loss=float("nan"))
        rep.event("checkpoint_end", step=1)
        assert rep.flush(timeout_s=10)
    finally:
        rep.close()
    assert [e["name"] for e in store.events] == ["checkpoint_end"]
    assert rep.invalid_events == 1
    assert decode_entries(store.steps).batch.step.tolist() == [1]


def test_what_the_last_flush_could_not_publish_is_counted_as_dropped() -> None:
    """Issue 38, item 4: a job that ends while neither the relay nor Redis takes its flushes
    loses them; the reporter counts them in ``dropped`` and says so, never ``dropped 0``."""
    store = FakeStore()
    store.fail_next = 1_000_000
    rep = _reporter(store)
    for step in range(40):
        rep.record(step, 0.1)
    with capture_logs() as logs:
        rep.close(timeout_s=10)
    assert (rep.published, rep.dropped) == (0, 40)
    (lost,) = [e for e in logs if e["event"] == "telemetry.lost_at_close"]
    assert lost["lost"] == 40
