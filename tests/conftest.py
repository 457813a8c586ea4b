"""Marks every test by its tier (the folder it lives in)."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit": pytest.mark.unit, "integration": pytest.mark.integration, "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).parent.name
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])
