"""Marks every test by its tier (the folder it lives in)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

_TIERS = {"unit": pytest.mark.unit, "integration": pytest.mark.integration, "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).parent.name
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Each test starts with structlog's defaults (tests that configure logging undo it)."""
    yield
    structlog.reset_defaults()
