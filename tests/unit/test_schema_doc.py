"""docs/redis-schema.md names every key the code builds and every field of the records one
module owns: a key or field added without its line there fails here."""

from __future__ import annotations

import re
from pathlib import Path

from slurm_plugin.model import keys
from slurm_plugin.store import decision, job_state, nodes, registration

JOB = "4242"
DOC = (Path(__file__).resolve().parents[2] / "docs" / "redis-schema.md").read_text()


def test_every_key_is_documented() -> None:
    documented = set(re.findall(r"`(stg:[^`]+)`", DOC))
    per_job = [keys.job_meta, keys.job_steps, keys.job_gpu, keys.job_events]
    per_job += [keys.job_credential, keys.job_service, keys.job_decisions]
    built = {f(JOB).replace(f"{{{JOB}}}", "{J}") for f in per_job}
    built |= {
        keys.node("n1").replace("n1", "{N}"),
        keys.policy("p1").replace("p1", "{name}"),
        keys.decision("d1").replace("d1", "{id}"),
    }
    built |= {
        value
        for name, value in vars(keys).items()
        if name.isupper()
        and isinstance(value, str)
        and value.startswith(keys.PREFIX)
        and value != keys.PREFIX
    }
    assert sorted(built - documented) == [], "keys missing from docs/redis-schema.md"


def test_every_owned_field_is_documented() -> None:
    rows = {line.split("|")[1].strip(): line for line in DOC.splitlines() if line.startswith("|")}
    node_row = rows["`stg:node:{N}`"]
    meta_row = rows["`stg:job:{J}:meta`"]
    assert [f for f in nodes.FIELDS if f"`{f}`" not in node_row] == []
    assert [f for f in registration.FIELDS if f"`{f}`" not in meta_row] == []


def test_every_decision_and_job_state_field_is_documented() -> None:
    rows = {line.split("|")[1].strip(): line for line in DOC.splitlines() if line.startswith("|")}
    decision_row = rows["`stg:decision:{id}`"]
    job_row = rows["`stg:job:{J}:service`"]
    assert [f for f in decision.FIELDS if f"`{f}`" not in decision_row] == []
    assert [f for f in job_state.FIELDS if f"`{f}`" not in job_row] == []
    assert f"`{job_state.IGNORED_PREFIX}<reason>`" in job_row
