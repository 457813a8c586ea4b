"""Marks every test by its tier (the folder it lives in)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

_TIERS = {"unit": pytest.mark.unit, "integration": pytest.mark.integration, "gpu": pytest.mark.gpu}


def pytest_report_header() -> str:
    """Which Slurm the integration tests run on (make test-releases runs three)."""
    from slurm_plugin.devcluster import DevCluster  # noqa: PLC0415 - only for the header
    from slurm_plugin.errors import StragglerError  # noqa: PLC0415

    try:
        return f"slurm: {DevCluster(Path('/nonexistent')).release()}"
    except StragglerError as exc:
        return f"slurm: unknown ({exc})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The folder's marker; and beyond the unit tier, ``cluster`` for a test that needs the dev
    cluster (the ``cluster`` fixture, directly or through another), ``redis`` for one that
    needs no Slurm (a redis-server of its own at most): contrib/test/tiers runs them apart.
    ``alone`` (timings asserted, run with nothing beside them) is the cluster tier's alone: the
    Redis tier runs beside the others."""
    for item in items:
        tier = Path(str(item.path)).parent.name
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])
        if tier != "unit":
            needs_cluster = "cluster" in getattr(item, "fixturenames", ())
            item.add_marker(pytest.mark.cluster if needs_cluster else pytest.mark.redis)
            if item.get_closest_marker("alone") and not needs_cluster:
                raise pytest.UsageError(f"{item.nodeid}: marked alone, but not a cluster test")


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Each test starts with structlog's defaults (tests that configure logging undo it)."""
    yield
    structlog.reset_defaults()
