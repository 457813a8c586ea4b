"""One source per default: a policy's ``[detection]`` and the settings' ``[persistence]`` show
the detector's and the node history's own defaults, and every value their bounds let a file
through is one the detector and the history accept (a file that loads never fails later)."""

from __future__ import annotations

import math
from typing import Any, cast

import annotated_types as at
import pytest
from pydantic import BaseModel, ValidationError

from slurm_plugin.detection.params import DetectionParams
from slurm_plugin.policy.history import HistoryParams
from slurm_plugin.policy.rails import PersistencePolicy
from slurm_plugin.policy.schema import DetectionPolicy


def test_the_two_views_share_their_defaults() -> None:
    assert DetectionPolicy().params() == DetectionParams()
    assert PersistencePolicy().params() == HistoryParams()


def _edges(model: type[BaseModel]) -> list[tuple[str, Any]]:
    """Per numeric field, the outermost values its bounds accept (just inside an open one)."""
    found = []
    for name, info in model.model_fields.items():
        for bound in info.metadata:
            value: Any
            if isinstance(bound, at.Ge):
                value = bound.ge
            elif isinstance(bound, at.Le):
                value = bound.le
            elif isinstance(bound, at.Gt):
                value = math.nextafter(float(cast(Any, bound.gt)), math.inf)
            elif isinstance(bound, at.Lt):
                value = math.nextafter(float(cast(Any, bound.lt)), -math.inf)
            else:
                continue
            found.append((name, int(value) if info.annotation is int else value))
    return found


@pytest.mark.parametrize(
    ("model", "name", "value"),
    [(m, n, v) for m in (DetectionPolicy, PersistencePolicy) for n, v in _edges(m)],
)
def test_every_value_a_file_may_set_is_one_the_core_accepts(
    model: type[DetectionPolicy | PersistencePolicy], name: str, value: Any
) -> None:
    try:
        policy = model(**{name: value})
    except ValidationError:
        return  # refused when read (a rule across fields): it can never fail later
    policy.params()  # raises when the core's own checks are stricter than the file's


def test_bounds_are_checked_at_all() -> None:
    """The edges above are real bounds: one step past them is refused by the file's model."""
    with pytest.raises(ValidationError):
        DetectionPolicy(charts=7)
    with pytest.raises(ValidationError):
        PersistencePolicy(incidents=1)


def test_a_persistence_table_the_history_would_refuse_is_refused_when_read() -> None:
    """distinct_jobs above incidents can never be met: an error naming both, at load time."""
    with pytest.raises(ValidationError, match="incidents"):
        PersistencePolicy(incidents=3, distinct_jobs=5)
    assert PersistencePolicy(incidents=5, distinct_jobs=5).params().incidents == 5
