"""Prolog/epilog checks with the shipped fake NVML and sysfs builder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.devcluster.fake_prolog import fake_nvml, write_bin
from slurm_plugin.devcluster.settings import FAKE_NVML_ENV
from slurm_plugin.health.checks import GpuThresholds, check_fabric, check_gpus, verdict
from slurm_plugin.health.fabric import count_hcas, read_ports
from slurm_plugin.health.hook import probe_gpus, run_epilog, run_prolog
from slurm_plugin.health.kmsg import new_xids, parse_records, pci_key
from slurm_plugin.probes.fake_nvml import FakeGpu, FakeNvml
from slurm_plugin.probes.gpu import NvmlProbe
from slurm_plugin.testing import build_ib_tree

REPO = Path(__file__).resolve().parents[2]


def _checks(**fields: object) -> list[str]:
    gpu = FakeGpu()
    for name, value in fields.items():
        setattr(gpu, name, value)
    samples = NvmlProbe(FakeNvml([gpu])).sample()
    return [f"{f.check}:{f.severity}" for f in check_gpus(samples, GpuThresholds())]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, []),
        ({"ecc_uncorrected_volatile": 2}, ["ecc:drain"]),
        ({"retired_pages_pending": True}, ["retired_pages:drain"]),
        ({"remap_pending": True}, ["row_remap:drain"]),
        ({"remap_failed": True}, ["row_remap:drain"]),
        ({"throttle_mask": 0x8}, ["throttle:drain"]),
        ({"throttle_mask": 0x1 | 0x4}, []),  # idle and power cap are normal at idle
        ({"sm_clock_max_mhz": 1500}, ["sm_clock:drain"]),
        ({"pcie_gen": 3}, ["pcie:drain"]),
        ({"pcie_width": 8}, ["pcie:drain"]),
        ({"nvlinks": [True] * 17 + [False]}, ["nvlink:drain"]),
        ({"temperature_c": 95}, ["temperature:drain"]),
        ({"recovery_action": 4}, ["recovery_action:drain"]),
    ],
)
def test_each_gpu_finding_has_its_verdict(fields: dict[str, object], expected: list[str]) -> None:
    """Every GPU fault maps to its finding; a healthy GPU to none."""
    assert _checks(**fields) == expected


def test_xids_count_and_critical() -> None:
    """Critical XIDs drain, others warn; a missing GPU drains."""
    nvml = FakeNvml([FakeGpu(), FakeGpu()])
    nvml.inject_xid(0, 48)  # before the probe registered: real NVML never shows it
    probe = NvmlProbe(nvml)
    nvml.inject_xid(0, 79)
    nvml.inject_xid(1, 13)
    findings = check_gpus(probe.sample(), GpuThresholds(expected_count=3))
    assert [(f.check, f.severity, f.device) for f in findings] == [
        ("gpu_count", "drain", ""),
        ("xid", "drain", "gpu0"),
        ("xid", "warn", "gpu1"),
    ]
    assert verdict(findings) == 1
    assert verdict([f for f in findings if f.severity == "warn"]) == 0


def test_hung_nvml_is_abandoned_within_the_budget() -> None:
    """A GPU whose NVML never answers is reported after the timeout, not waited for: the
    probe comes back while the GPU still hangs (its thread abandoned, still stuck)."""
    gpu = FakeGpu(hang=True)
    samples, error = probe_gpus(lambda: FakeNvml([gpu]), 0.3)
    assert (samples, error) == (None, "timeout")
    stuck = [t for t in threading.enumerate() if t.name == "nvml-probe" and t.is_alive()]
    assert stuck, "the probe's thread was waited for"
    gpu.hang = False  # let the abandoned thread end
    for thread in stuck:
        thread.join(10)


def test_fabric_ports_rates_counters_and_garbage(tmp_path: Path) -> None:
    """Down ports, slow rates, growing error counters and unreadable files are findings."""
    ports = build_ib_tree(tmp_path, 4)
    (ports[0] / "state").write_text("1: DOWN\n")
    (ports[1] / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (ports[2] / "counters" / "symbol_error").write_text("12\n")
    (ports[3] / "phys_state").write_text("")
    (ports[3] / "counters" / "link_downed").write_text("garbage\n")
    samples = read_ports(tmp_path)
    previous = {p.name: {"symbol_error": 2} for p in samples}
    findings = check_fabric(
        samples, previous, expected_hcas=8, hcas=count_hcas(tmp_path), expected_rate_gbps=400
    )
    got = {(f.check, f.device) for f in findings}
    assert ("hca_count", "") in got
    assert ("port_state", "mlx5_0/1") in got
    assert ("port_rate", "mlx5_1/1") in got
    assert ("port_errors", "mlx5_2/1") in got
    assert ("sysfs", "mlx5_3/1") in got
    messages = " ".join(f.message for f in findings)
    assert "symbol_error +10" in messages
    assert "phys_state: empty" in messages
    assert "link_downed: not a number" in messages


def _gpus(tmp_path: Path) -> Any:
    """The fake GPUs of ``_settings``' spec, as the dev cluster's prolog passes them."""
    return fake_nvml(tmp_path / "gpus.json")


def _settings(tmp_path: Path, spec: dict[str, object]) -> Settings:
    (tmp_path / "gpus.json").write_text(json.dumps(spec))
    build_ib_tree(tmp_path / "root", 8)
    settings = Settings(
        health={
            "sysfs_root": tmp_path / "root",
            "state_dir": tmp_path / "state",
            "expected_gpus": 8,
            "expected_hcas": 8,
            "expected_ib_rate_gbps": 400,
            "kmsg_path": tmp_path / "kmsg",
        },
        redis={"url": "redis://127.0.0.1:1/0"},
    )
    if not (tmp_path / "kmsg").exists():
        (tmp_path / "kmsg").write_text("")
    return settings


def test_prolog_exit_codes_and_fail_open(tmp_path: Path) -> None:
    """A faulty GPU fails the prolog; Redis away is our problem and passes."""
    settings = _settings(
        tmp_path,
        {"default": {"gpus": 8}, "nodes": {"node3": {"faults": {"5": {"remap_failed": True}}}}},
    )
    healthy = run_prolog(
        {"SLURMD_NODENAME": "node1", "SLURM_JOB_ID": "9"}, settings, _gpus(tmp_path)
    )
    assert healthy.exit_code == 0
    assert any("Redis unavailable" in p for p in healthy.problems)
    faulty = run_prolog(
        {"SLURMD_NODENAME": "node3", "SLURM_JOB_ID": "9"}, settings, _gpus(tmp_path)
    )
    assert faulty.exit_code == 1
    assert faulty.summary() == "row_remap: gpu5: row remapping failed"
    assert (tmp_path / "state" / "fabric.json").exists()


def test_missing_pynvml_passes_and_broken_driver_drains(tmp_path: Path) -> None:
    """NVML init failing with GPUs expected drains; without expected GPUs it only warns."""
    settings = _settings(tmp_path, {"default": {"fail_init": True}})
    assert run_prolog({"SLURMD_NODENAME": "node1"}, settings, _gpus(tmp_path)).exit_code == 1
    relaxed = settings.model_copy(
        update={"health": settings.health.model_copy(update={"expected_gpus": None})}
    )
    result = run_prolog({"SLURMD_NODENAME": "node1"}, relaxed, _gpus(tmp_path))
    assert result.exit_code == 0
    assert any("NVML unavailable" in p for p in result.problems)


def test_epilog_drains_on_new_ecc_errors_only(tmp_path: Path) -> None:
    """The epilog compares ECC counts with the prolog's; clock findings are not its business."""
    spec: dict[str, object] = {"default": {"gpus": 8, "faults": {"1": {"sm_clock_max_mhz": 1}}}}
    settings = _settings(tmp_path, spec)
    run_prolog({"SLURMD_NODENAME": "node1"}, settings, _gpus(tmp_path))
    assert run_epilog({"SLURMD_NODENAME": "node1"}, settings, _gpus(tmp_path)).exit_code == 0
    spec["default"] = {"gpus": 8, "faults": {"1": {"ecc_uncorrected_volatile": 4}}}
    settings = _settings(tmp_path, spec)
    result = run_epilog(
        {"SLURMD_NODENAME": "node1", "SLURM_JOB_ID": "3"}, settings, _gpus(tmp_path)
    )
    assert result.exit_code == 1
    assert result.summary() == "ecc: gpu1: +4 uncorrectable ECC errors during the job"


KMSG = [
    "6,100,1000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
    "4,101,2000,-;NVRM: Xid (PCI:0000:19:00): 79, pid=4242, GPU has fallen off the bus.",
    "4,102,3000,-;NVRM: Xid (PCI:0000:7f:00): 13, pid=1, Graphics Exception",
]


def test_kernel_log_xids_are_seen_once_and_mapped_by_pci(tmp_path: Path) -> None:
    """Issue 13 item 9: an XID of the previous job is in the kernel log, not in NVML's events
    for a new process: the prolog reads it there, maps it to gpu1 by PCI address (critical:
    drain), reports one on a PCI address NVML does not list, and the next check does not see
    them again."""
    settings = _settings(tmp_path, {"default": {"gpus": 8}})
    (tmp_path / "kmsg").write_text("\n".join(KMSG) + "\n")
    first = run_prolog({"SLURMD_NODENAME": "node1", "SLURM_JOB_ID": "9"}, settings, _gpus(tmp_path))
    assert first.exit_code == 1
    assert [(f.check, f.severity, f.device, f.message) for f in first.findings] == [
        ("xid", "warn", "", "XID 13 on PCI 0000:7f:00"),
        ("xid", "drain", "gpu1", "critical XID [79]"),
    ]
    again = run_prolog(
        {"SLURMD_NODENAME": "node1", "SLURM_JOB_ID": "10"}, settings, _gpus(tmp_path)
    )
    assert again.exit_code == 0
    with (tmp_path / "kmsg").open("a") as log:
        log.write("4,103,4000,-;NVRM: Xid (PCI:0000:1a:00): 48, pid=7, DBE\n")
    after = run_epilog(
        {"SLURMD_NODENAME": "node1", "SLURM_JOB_ID": "10"}, settings, _gpus(tmp_path)
    )
    assert after.summary() == "xid: gpu2: critical XID [48]"


def test_kernel_log_parsing() -> None:
    """Records with and without the /dev/kmsg header; NVML and kernel PCI forms agree; a log
    that restarted (reboot) counts again from its start."""
    xids = parse_records([*KMSG, "NVRM: Xid (PCI:3b:00): 94, pid=1, Contained ECC error"])
    assert [(x.seq, x.pci, x.xid) for x in xids] == [
        (101, (0, 0x19, 0), 79),
        (102, (0, 0x7F, 0), 13),
        (3, (0, 0x3B, 0), 94),
    ]
    assert pci_key("00000000:19:00.0") == pci_key("0000:19:00") == (0, 0x19, 0)
    assert pci_key("garbage") is None


def test_new_xids_since_a_sequence_number(tmp_path: Path) -> None:
    """Only records after the last one seen; a lower newest sequence means a reboot."""
    log = tmp_path / "kmsg"
    log.write_text("\n".join(KMSG) + "\n")
    assert [x.xid for x in new_xids(log, -1)[0]] == [79, 13]
    assert new_xids(log, 101) == ([new_xids(log, -1)[0][1]], 102)
    assert [x.xid for x in new_xids(log, 5000)[0]] == [79, 13]  # the log restarted


@pytest.fixture
def syslog_socket() -> Iterator[tuple[Path, socket.socket]]:
    """A datagram socket standing in for /dev/log (short path: AF_UNIX allows 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="stg-log-"))
    path = directory / "log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield path, sock
    shutil.rmtree(directory)


def _received(sock: socket.socket) -> list[str]:
    lines = []
    with contextlib.suppress(TimeoutError):
        while True:
            lines.append(sock.recv(65536).decode())
            sock.settimeout(0.5)
    return lines


def test_a_passing_prologs_warnings_reach_syslog(
    tmp_path: Path, syslog_socket: tuple[Path, socket.socket]
) -> None:
    """Issue 18 item 9: slurmd discards a passing prolog's output, so the shipped wrapper's
    warnings (a non-critical XID) and our own problems (Redis away) go to syslog, as do the
    wrapper's own messages (its timeout)."""
    path, sock = syslog_socket
    _settings(tmp_path, {"default": {"gpus": 8}})
    (tmp_path / "kmsg").write_text(KMSG[-1] + "\n")
    (tmp_path / "config.toml").write_text(
        '[redis]\nurl = "redis://127.0.0.1:1/0"\n[health]\n'
        f'sysfs_root = "{tmp_path / "root"}"\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        f'kmsg_path = "{tmp_path / "kmsg"}"\n'
        f'syslog_socket = "{path}"\n'
        "expected_gpus = 8\nexpected_hcas = 8\nexpected_ib_rate_gbps = 400\n"
    )
    env = {
        "PATH": os.environ["PATH"],
        "STRAGGLER_CONFIG": str(tmp_path / "config.toml"),
        "STRAGGLER_PROLOG_BIN": str(write_bin(tmp_path / "prolog-bin")),
        FAKE_NVML_ENV: str(tmp_path / "gpus.json"),
        "STRAGGLER_HEALTH_SYSLOG_SOCKET": str(path),
        "SLURMD_NODENAME": "node1",
        "SLURM_JOB_ID": "77",
    }
    wrapper = str(REPO / "prolog" / "straggler-prolog.sh")
    done = subprocess.run([wrapper], env=env, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = _received(sock)
    assert any(
        line.startswith("<27>straggler-prolog[")
        and "job 77: our problem, passing: Redis unavailable" in line
        for line in lines
    ), lines
    assert any(
        line.startswith("<28>") and "job 77: warning: xid: XID 13 on PCI 0000:7f:00" in line
        for line in lines
    ), lines
    hung = tmp_path / "hung-prolog"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    slow = {**env, "STRAGGLER_PROLOG_BIN": str(hung), "STRAGGLER_PROLOG_TIMEOUT": "1"}
    timed_out = subprocess.run([wrapper], env=slow, capture_output=True, timeout=60, check=False)
    assert timed_out.returncode == 0
    sock.settimeout(5)
    (line,) = _received(sock)
    assert "straggler-prolog: timed out after 1s, passing" in line, line


def test_the_prologs_problem_line_says_whether_redis_was_the_trouble(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redis that cannot be reached (or a URL that names none) reads "Redis unavailable";
    a fault of ours is named as what it is, never blamed on Redis."""
    from slurm_plugin.health.hook import HookResult, _redis_prolog  # noqa: PLC0415
    from slurm_plugin.store.nodes import NodeRecord  # noqa: PLC0415

    away = HookResult(node="node1", job_id="")
    _redis_prolog(Settings(redis={"url": "http://not-redis"}), {}, away)
    assert away.problems[0].startswith("Redis unavailable, ")

    def broken(_record: NodeRecord) -> None:
        raise KeyError("reason")

    monkeypatch.setattr(NodeRecord, "refusal", broken)
    ours = HookResult(node="node1", job_id="")
    _redis_prolog(Settings(redis={"url": "redis://127.0.0.1:1/0"}), {}, ours)
    assert ours.problems[0].startswith("KeyError (not Redis), ")
