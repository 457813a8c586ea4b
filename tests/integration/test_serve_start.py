"""`straggler serve` refuses to start broken, before it takes the leader lock: a broken
instance never takes the lock from a good one (issue 18 item 3), and a Redis written by
another release of the key layout is never acted on (item 9)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_plugin.model import keys
from slurm_plugin.service.state import ServiceState
from tests.integration.conftest import REPO, wait_for


def _serve(env: dict[str, str], *args: str, **overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurm_plugin.cli.main", "serve", *args],
        env={**env, **overrides},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"STRAGGLER_SERVICE_POLICY_DIR": "/nonexistent/policies"}, "/nonexistent/policies"),
        ({"STRAGGLER_SLURM_BIN_DIR": "/nonexistent/bin"}, "[slurm] bin_dir"),
    ],
    ids=["no-policy-dir", "no-slurm-commands"],
)
def test_a_broken_instance_exits_without_taking_the_lock(
    env: dict[str, str],
    state: ServiceState,
    service: subprocess.Popen[bytes],
    override: dict[str, str],
    says: str,
) -> None:
    """A good instance leads; a second one started with a fatal configuration exits non-zero
    at once with one line, and the good instance keeps the lock and keeps cycling."""
    wait_for(lambda: state.client.get(keys.LEADER) is not None, 30, "the good instance to lead")
    leader = state.client.get(keys.LEADER)
    result = _serve(env, **override)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, lines
    assert len(lines) == 1, lines
    assert says in lines[0], lines
    assert "Traceback" not in result.stderr
    assert state.client.get(keys.LEADER) == leader
    beat = state.last_heartbeat()
    assert beat is not None
    wait_for(lambda: (state.last_heartbeat() or {}).get("ts", 0) > beat["ts"], 30, "another cycle")
    assert service.poll() is None


def test_serve_stamps_an_empty_redis_and_refuses_another_layout(
    env: dict[str, str], state: ServiceState, tmp_path: Path
) -> None:
    """The first `serve` writes the schema version; a Redis that says another version (a newer
    release wrote it, or an old one never migrated) stops `serve` before the lock, and the
    marker is left as found."""
    state.client.delete(keys.SCHEMA, keys.LEADER)
    once = _serve(env, "--once")
    assert once.returncode == 0, once.stderr[-2000:]
    assert state.client.get(keys.SCHEMA) == str(keys.SCHEMA_VERSION)
    state.client.delete(keys.LEADER)
    state.client.set(keys.SCHEMA, keys.SCHEMA_VERSION + 1)
    newer = _serve(env)
    lines = (newer.stdout + newer.stderr).strip().splitlines()
    assert newer.returncode == 2, lines
    assert len(lines) == 1, lines
    assert f"version '{keys.SCHEMA_VERSION + 1}'" in lines[0]
    assert "docs/deploy.md" in lines[0]
    assert state.client.get(keys.LEADER) is None
    assert state.client.get(keys.SCHEMA) == str(keys.SCHEMA_VERSION + 1)
    state.client.set(keys.SCHEMA, keys.SCHEMA_VERSION)
