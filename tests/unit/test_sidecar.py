"""The node sidecar and its probes, against the shipped fake NVML and a built /proc tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from slurm_plugin.probes.cpu import sample_cpu
from slurm_plugin.probes.fake_nvml import FakeGpu, FakeNvml
from slurm_plugin.probes.gpu import NvmlProbe, NvmlUnavailableError, decode_throttle_reasons
from slurm_plugin.store.telemetry_store import TelemetryStore, connect
from slurm_plugin.telemetry.sidecar import Sidecar


def _store() -> TelemetryStore:
    return TelemetryStore(connect("redis://127.0.0.1:1/0", retries=0))  # never contacted here


def test_throttle_reason_names() -> None:
    """Reason bits decode to names; unknown bits are kept, not lost."""
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x8 | 0x40) == ["hw_slowdown", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0x80 | 0x10000) == ["hw_power_brake_slowdown", "bit_0x10000"]


def test_sidecar_sample_decodes_throttling_and_xids(tmp_path: Path) -> None:
    """Throttle reasons and XID events of the (fake) NVML appear, decoded, in the sample."""
    nvml = FakeNvml(
        [
            FakeGpu(uuid="GPU-a"),
            FakeGpu(uuid="GPU-b", sm_clock_mhz=1410, throttle_mask=0x8 | 0x20, power_mw=650_500),
        ]
    )
    car = Sidecar(
        _store(), "node3", job_id="55", nvml=nvml, proc_root=tmp_path, clock=lambda: 1700000000.0
    )
    nvml.inject_xid(1, 79)  # after the sidecar registered for events, as with real NVML
    nvml.inject_xid(1, 48)
    sample = car.sample()
    assert sample["node"] == "node3"
    assert sample["ts"] == 1700000000.0
    assert sample["nvml"] is True
    healthy, slow = sample["gpus"]
    assert healthy["throttle_reasons"] == []
    assert healthy["xids"] == []
    assert slow["uuid"] == "GPU-b"
    assert slow["sm_clock_mhz"] == 1410
    assert slow["sm_clock_max_mhz"] == 1980
    assert slow["throttle_reasons"] == ["hw_slowdown", "sw_thermal_slowdown"]
    assert slow["xids"] == [79, 48]
    assert slow["power_w"] == pytest.approx(650.5)
    assert car.sample()["gpus"][1]["xids"] == []  # each event is reported once
    car.close()
    assert not nvml.initialised


def test_unsupported_fields_are_none() -> None:
    """A GPU that does not support a query reports None for it, not an error."""
    nvml = FakeNvml([FakeGpu(unsupported={"power", "ecc", "throttle"})])
    (sample,) = NvmlProbe(nvml).sample()
    assert sample.power_w is None
    assert sample.ecc_uncorrected_volatile is None
    assert sample.throttle_reasons == []
    assert sample.sm_clock_mhz == 1980


def test_without_nvml_the_sidecar_runs_cpu_signals_only(tmp_path: Path) -> None:
    """When NVML cannot start the sidecar says so and still samples the CPU."""
    with capture_logs() as logs:
        car = Sidecar(_store(), "node1", nvml=FakeNvml(fail_init=True), proc_root=tmp_path)
    assert car.probe is None
    assert car.sample()["gpus"] == []
    assert logs[0]["event"] == "sidecar.nvml_unavailable"
    with pytest.raises(NvmlUnavailableError, match="Driver Not Loaded"):
        NvmlProbe(FakeNvml(fail_init=True))


def test_cpu_pressure_and_cgroup_throttling(tmp_path: Path) -> None:
    """PSI and cgroup v2 cpu.stat are parsed; v1 throttled_time is converted to microseconds."""
    (tmp_path / "proc/pressure").mkdir(parents=True)
    (tmp_path / "proc/pressure/cpu").write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=987654\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.stat").write_text(
        "usage_usec 100\nnr_periods 50\nnr_throttled 7\nthrottled_usec 4200\n"
    )
    sample = sample_cpu(tmp_path)
    assert (sample.pressure_some_avg10, sample.pressure_some_total_us) == (12.5, 987654)
    assert (sample.cgroup_nr_throttled, sample.cgroup_throttled_us) == (7, 4200)

    v1 = tmp_path / "v1"
    (v1 / "sys/fs/cgroup/cpu").mkdir(parents=True)
    (v1 / "sys/fs/cgroup/cpu/cpu.stat").write_text(
        "nr_periods 9\nnr_throttled 3\nthrottled_time 5000000\n"
    )
    assert sample_cpu(v1).cgroup_throttled_us == 5000
    assert sample_cpu(tmp_path / "empty").pressure_some_avg10 is None


def test_a_nan_reading_becomes_null_and_the_sample_is_kept(tmp_path: Path) -> None:
    """Issue 25: one GPU reading that is not a finite number (a driver's NaN) made the whole
    sample unpublishable. Now that value is null, counted in ``unreadable``, and the sample
    (the other GPU's throttling included) is strict JSON."""
    import json  # noqa: PLC0415

    nvml = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", throttle_mask=0x8)])
    car = Sidecar(_store(), "node3", nvml=nvml, proc_root=tmp_path, clock=lambda: 1.0)
    nvml.gpus[0].temperature_c = float("nan")  # type: ignore[assignment]
    sample = car.sample()
    assert sample["unreadable"] == 1
    first, second = sample["gpus"]
    assert first["temperature_c"] is None
    assert second["throttle_reasons"] == ["hw_slowdown"]
    json.dumps(sample, allow_nan=False)  # raises on a NaN left anywhere
    assert "unreadable" not in Sidecar(_store(), "node4", nvml=FakeNvml([FakeGpu()])).sample()
