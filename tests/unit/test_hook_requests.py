"""The node hooks' requests and settings (pure), and the example hook in contrib/ run as the
service would run it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from slurm_plugin.config.tables import HookSettings
from slurm_plugin.policy.history import Incident
from slurm_plugin.store import hooks

EXAMPLE = Path(__file__).resolve().parents[2] / "contrib" / "hooks" / "node-hook.py"


def _request() -> hooks.HookRequest:
    incidents = hooks.incidents_of(
        [Incident("10.1", 100.0, 31.25, "compute", "alice", True), Incident("11.1", 200.0)]
    )
    return hooks.HookRequest(
        "persistent",
        "gpu017",
        "d-0123456789ab",
        250.0,
        "service",
        "ok",
        ["2 incidents in 2 jobs within 14 days"],
        incidents,
    )


def test_a_request_reads_back_as_it_was_queued_and_its_payload_is_the_documented_one() -> None:
    request = _request()
    queued = json.dumps(request.__dict__)
    assert hooks.decode(queued) == request
    payload = request.payload("site-a")
    assert payload == {
        "version": 1,
        "event": "persistent",
        "deployment": "site-a",
        "node": "gpu017",
        "decision_id": "d-0123456789ab",
        "ts": 250.0,
        "by": "service",
        "was": "ok",
        "reasons": ["2 incidents in 2 jobs within 14 days"],
        "incidents": [
            {
                "job": "10.1",
                "ts": 100.0,
                "slowdown_pct": 31.2,
                "cause": "compute",
                "corroborated": True,
            },
            {
                "job": "11.1",
                "ts": 200.0,
                "slowdown_pct": 0.0,
                "cause": "compute",
                "corroborated": False,
            },
        ],
    }
    assert hooks.incidents_of([Incident("1", 1.0, math.nan)])[0]["slowdown_pct"] is None


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        "{}",
        '{"kind": "reboot", "node": "n1", "decision_id": "d-1", "ts": 1}',
        '{"kind": "persistent", "node": "n1;rm -rf /", "decision_id": "d-1", "ts": 1}',
        '{"kind": "persistent", "node": "n1", "decision_id": "d-1", "ts": "NaN"}',
        '{"kind": "persistent", "node": "n1", "decision_id": "d-1", "ts": 1, "reasons": 5}',
    ],
)
def test_a_queued_request_that_does_not_read_is_none(text: str) -> None:
    assert hooks.decode(text) is None


def test_a_hook_is_an_absolute_program_and_arguments() -> None:
    assert HookSettings(on_persistent=["/usr/local/bin/report", "--fast"]).timeout_s == 60
    with pytest.raises(ValidationError, match="absolute path"):
        HookSettings(on_persistent=["report-host"])
    with pytest.raises(ValidationError, match="empty"):
        HookSettings(on_forgiven=["/bin/true", ""])
    with pytest.raises(ValidationError):
        HookSettings(timeout_s=0)


def test_the_example_hook_files_one_ticket_per_decision(tmp_path: Path) -> None:
    """contrib/hooks/node-hook.py as the service runs it: the JSON on standard input; a
    second run for the same decision (at least once) files nothing new."""
    payload = json.dumps(_request().payload("site-a"))
    runs = [
        subprocess.run(
            [sys.executable, str(EXAMPLE), str(tmp_path / "spool")],
            input=payload,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0]
    assert runs[0].stdout.strip() == "d-0123456789ab.json: persistent gpu017"
    assert runs[1].stdout.strip() == "d-0123456789ab.json: filed before"
    (ticket,) = (tmp_path / "spool").iterdir()
    filed = json.loads(ticket.read_text())
    assert filed["jobs"] == ["10.1", "11.1"]
    assert filed["worst_slowdown_pct"] == 31.2
