"""The prolog's GPU checks on real GPUs through NVML, timed (marker gpu; skipped without one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.health.hook import run_prolog
from slurm_plugin.probes.gpu import NvmlProbe, NvmlUnavailableError

pytestmark = pytest.mark.gpu


def test_the_prolog_checks_every_real_gpu_within_its_budget(tmp_path: Path) -> None:
    pytest.importorskip("pynvml", reason="install the nvml extra")
    try:
        NvmlProbe().close()
    except NvmlUnavailableError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    settings = Settings(
        redis={"url": "redis://127.0.0.1:1/0"},
        health={"state_dir": tmp_path / "state", "sysfs_root": tmp_path / "no-sysfs"},
    )
    result = run_prolog({"SLURMD_NODENAME": "gpu-check", "SLURM_JOB_ID": "1"}, settings)
    print(  # noqa: T201
        f"FIGURES prolog: {len(result.gpus)} GPUs in {result.elapsed_s:.2f} s, "
        f"findings {[str(f) for f in result.findings]}"
    )
    assert result.gpus
    assert result.elapsed_s < settings.health.budget_s
