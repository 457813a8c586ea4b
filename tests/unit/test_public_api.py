"""The public API: every name a public module exports exists, and the package ships py.typed."""

from __future__ import annotations

import importlib
from importlib import resources

import pytest

pytestmark = pytest.mark.unit

# The modules a job or a site imports (README: "Your stack", the deploy guide, the tests).
PUBLIC = (
    "slurm_plugin",
    "slurm_plugin.config",
    "slurm_plugin.errors",
    "slurm_plugin.testing",
    "slurm_plugin.telemetry.reporter",
    "slurm_plugin.telemetry.instrument",
    "slurm_plugin.telemetry.checkpoints",
    "slurm_plugin.telemetry.torch",
    "slurm_plugin.telemetry.fsdp",
    "slurm_plugin.telemetry.lightning",
    "slurm_plugin.telemetry.hf",
)


@pytest.mark.parametrize("name", PUBLIC)
def test_public_module_exports_only_names_it_has(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert exported, f"{name}.__all__ is empty"
    assert len(set(exported)) == len(exported)
    missing = [item for item in exported if getattr(module, item, None) is None]
    assert missing == [], f"{name}.__all__ names what it lacks: {missing}"


def test_package_ships_type_information() -> None:
    assert resources.files("slurm_plugin").joinpath("py.typed").is_file()
