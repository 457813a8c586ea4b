"""The real NVML probe on a real GPU (marker gpu; skipped where no GPU or pynvml exists)."""

from __future__ import annotations

import pytest

from slurm_plugin.health.checks import GpuThresholds, check_gpus
from slurm_plugin.probes.gpu import NvmlProbe, NvmlUnavailableError


def test_real_probe_reads_every_gpu() -> None:
    """NVML answers for every GPU with plausible clocks and temperature."""
    pytest.importorskip("pynvml", reason="install the nvml extra")
    try:
        probe = NvmlProbe()
    except NvmlUnavailableError as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    samples = probe.sample()
    probe.close()
    assert samples, "NVML initialised but reports no GPU"
    for g in samples:
        assert g.uuid.startswith("GPU-")
        assert g.sm_clock_max_mhz is not None
        assert g.sm_clock_max_mhz > 0
        assert g.temperature_c is not None
        assert 0 < g.temperature_c < 120
    print([g.to_dict() for g in samples], check_gpus(samples, GpuThresholds()))  # noqa: T201
