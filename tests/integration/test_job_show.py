"""`straggler job show` on a job id Slurm gave twice (real redis-server, the CLI)."""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner

from slurm_plugin.cli.main import cli
from slurm_plugin.model.records import encode_steps
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from tests.integration.conftest import RedisServer

pytestmark = pytest.mark.integration

JOB = "77"
OLD, NEW = 1_000_000.0, 2_000_000.0  # the two jobs' first submit times


def _decision(state: ServiceState, decision_id: str, user: str, first: float) -> None:
    state.save_decision(
        decision_id,
        {
            "job_id": JOB,
            "node": "node3",
            "action": "none",
            "state": "decided",
            "detected_ts": first + 100,
            "job_user": user,
            "job_first_submit_ts": first,
        },
    )


def test_job_show_keeps_to_the_job_that_holds_the_id_now(private_redis: RedisServer) -> None:
    """Issue 38, item 9: `job show` mixed two jobs of one id (the decisions of last month's
    job 77 beside today's, and its ranks' timings). It shows the job the service knows under
    the id now and counts the earlier job's decisions apart."""
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    state = ServiceState(client)
    _decision(state, "d-old", "bob", OLD)
    _decision(state, "d-new", "alice", NEW)
    state.update_job(JOB, identity_user="alice", identity_first_submit_ts=f"{NEW:.0f}")
    store = TelemetryStore(connect(private_redis.url))
    store.publish(
        JOB,
        [
            encode_steps(0, "node9", 0, 0, [(5, OLD + 50, 1.0, 0.9, 0.1, None)]),
            encode_steps(1, "node3", 0, 0, [(5, NEW + 50, 1.0, 0.9, 0.1, None)]),
        ],
    )
    env = {"STRAGGLER_REDIS_URL": private_redis.url}
    shown = CliRunner().invoke(cli, ["job", "show", JOB, "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    answer = json.loads(shown.stdout)
    assert [d["id"] for d in answer["decisions"]] == ["d-new"]
    assert [(r["rank"], r["node"]) for r in answer["ranks"]] == [(1, "node3")]
    assert answer["earlier_jobs"] == [{"user": "bob", "first_submit_ts": OLD, "decisions": 1}]
    table = CliRunner().invoke(cli, ["job", "show", JOB], env=env)
    assert table.exit_code == 0, table.output
    assert "d-old" not in table.output
    assert "an earlier job with this id (user bob" in table.output
