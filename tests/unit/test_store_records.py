"""The decision record and the job's service state, each through its one owner: a write of a
field the owner does not name is refused, a read is typed, and records of the previous
release (or damaged ones) still read, their bad values as missing."""

from __future__ import annotations

import json

import pytest

from slurm_plugin.store import decision, job_state
from slurm_plugin.store.decision import DecisionRecord, RecordFieldError
from slurm_plugin.store.job_state import JobFieldError, JobState


def test_a_decision_field_the_record_does_not_name_is_refused() -> None:
    with pytest.raises(RecordFieldError, match="not a decision record field: nodez"):
        decision.encode({"state": "planned", "nodez": ["node3"]})
    with pytest.raises(RecordFieldError, match="'reasons': str given"):
        decision.encode({"reasons": "too slow"})
    with pytest.raises(RecordFieldError, match="'node': list given"):
        decision.encode({"node": ["node3"]})


def test_a_decision_reads_back_typed() -> None:
    written = {
        "job_id": "42",
        "nodes": ("node3", "node4"),
        "ranks": [4, 5],
        "step": 1200,
        "slowdown_pct": 38.5,
        "event": {"node": "node3", "step": 1200},
        "reasons": ["saves 900 s, costs 300 s"],
        "restarts_before": 1,
        "note": None,
    }
    flat = decision.encode(written)
    assert "note" not in flat
    assert flat["nodes"] == '["node3", "node4"]'
    back = decision.read(flat, "d1")
    assert back.id == "d1"
    assert back.nodes == ["node3", "node4"]
    assert (back.ranks, back.step, back.slowdown_pct) == ([4, 5], 1200, 38.5)
    assert back.event == {"node": "node3", "step": 1200}
    assert (back.restarts_before, back.reasons) == (1, ["saves 900 s, costs 300 s"])


def test_every_decision_field_round_trips() -> None:
    """Each field written with a value of its kind reads back as that value."""
    samples: dict[str, object] = {}
    for name in decision.FIELDS:
        annotation = str(DecisionRecord.model_fields[name].annotation)
        if "list[int]" in annotation:
            samples[name] = [1, 2]
        elif "list[str]" in annotation:
            samples[name] = ["a"]
        elif "list" in annotation:
            samples[name] = [{"node": "n1"}]
        elif "dict" in annotation:
            samples[name] = {"k": 1}
        elif "float" in annotation:
            samples[name] = 2.5
        elif "int" in annotation:
            samples[name] = 3
        else:
            samples[name] = "text"
    back = decision.read(decision.encode(samples))
    assert {name: getattr(back, name) for name in decision.FIELDS} == samples


def test_an_old_or_damaged_decision_still_reads() -> None:
    """Fields of another release are left out; unreadable JSON, a NaN, ``None`` written as
    text and a list with items of the wrong kind read as missing (or as the good items)."""
    back = decision.read(
        {
            "state": "waiting",
            "node": "node3",
            "retired_field": "x",
            "ranks": '[1, "x", null, true, 7]',
            "candidates": "{",
            "slowdown_pct": "nan",
            "cost_s": "None",
            "step": "not a number",
            "event": "[1, 2]",
            "detected_ts": "1700000000.5",
        }
    )
    assert (back.state, back.node, back.ranks) == ("waiting", "node3", [1, 7])
    assert back.candidates is None
    assert back.event is None
    assert (back.slowdown_pct, back.cost_s, back.step) == (None, None, None)
    assert back.detected_ts == 1700000000.5
    assert decision.read({}) == DecisionRecord()


def test_a_job_state_field_it_does_not_name_is_refused() -> None:
    with pytest.raises(JobFieldError, match="not a job service state field: evicitons"):
        job_state.encode({"evicitons": 1})
    assert job_state.encode({"ignored_wrong_node": 3, "waiting": None}) == {
        "ignored_wrong_node": "3",
        "waiting": "",
    }


def test_a_job_state_reads_back_typed() -> None:
    structure = [{"ranks": [0, 1], "factor": 1.3}]
    flat = job_state.encode(
        {
            "evictions": 2,
            "structure": structure,
            "reports_checkpoints": "1",
            "last_checkpoint_ts": "100.000",
            "waiting": "",
            "ignored_future_ts": 4,
        }
    )
    assert json.loads(flat["structure"]) == structure
    back = job_state.read({**flat, "steps_read": "x", "checkpoint_period_s": "inf", "old": "1"})
    assert (back.evictions, back.structure, back.reports_checkpoints) == (2, structure, True)
    assert (back.last_checkpoint_ts, back.waiting, back.steps_read) == (100.0, None, None)
    assert back.checkpoint_period_s is None
    assert back.ignored == {"future_ts": 4}
    assert job_state.read({}) == JobState()


def test_a_missed_checkpoint_makes_the_job_one_that_reports_none_until_its_next() -> None:
    reporting = {"reports_checkpoints": "1", "last_checkpoint_ts": "100", "wait_expired_ts": "50"}
    assert job_state.read(reporting).context().reports_checkpoints
    missed = {**reporting, "wait_expired_ts": "150"}
    assert not job_state.read(missed).context().reports_checkpoints
    assert job_state.read({**missed, "last_checkpoint_ts": "160"}).context().reports_checkpoints
