"""Prolog and epilog orchestration: probes -> checks -> exit code, within a time budget.

Our exit code is a drain decision. Hardware faults fail closed (exit 1: Slurm drains the node
and requeues the job); our own problems (missing pynvml, Redis away, a state file we cannot
write) fail open (exit 0) and are logged loudly. Redis, pynvml and the fake NVML are imported
only when used, to keep start-up fast.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import structlog

from slurm_plugin.config import Settings
from slurm_plugin.errors import RedisUnavailableError, StragglerError
from slurm_plugin.health.checks import (
    Finding,
    GpuThresholds,
    check_fabric,
    check_gpus,
    verdict,
)
from slurm_plugin.health.fabric import count_hcas, read_ports
from slurm_plugin.health.kmsg import new_xids, pci_key
from slurm_plugin.model.cluster import valid_sluid
from slurm_plugin.probes.gpu import GpuSample, NvmlProbe, NvmlUnavailableError

log = structlog.get_logger(__name__)
NvmlFactory = Callable[[], Any]
#: What gives the checks their NVML for a node: pynvml itself unless one is passed in (the dev
#: cluster's prolog passes fake GPUs, ``slurm_plugin.devcluster.fake_prolog``).
NvmlSource = Callable[[str], Any]


@dataclass
class HookResult:
    """What a prolog or epilog found and decided."""

    node: str
    job_id: str
    exit_code: int = 0
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    gpus: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        """One line for Slurm's logs and the drain explanation."""
        drains = [str(f) for f in self.findings if f.severity == "drain"]
        return "; ".join(drains) if drains else "ok"


def _nvml_factory(settings: Settings, node: str, nvml: NvmlSource | None) -> NvmlFactory | None:
    if settings.health.gpu == "off":
        return None
    if nvml is not None:
        return lambda: nvml(node)

    def make_real() -> Any:
        import importlib  # noqa: PLC0415

        return importlib.import_module("pynvml")

    return make_real


def probe_gpus(factory: NvmlFactory, timeout_s: float) -> tuple[list[GpuSample] | None, str]:
    """Sample every GPU in a thread that is abandoned after ``timeout_s``.

    Returns (samples, "") on success, (None, "timeout") when NVML hung, (None, "missing: ...")
    when pynvml is not installed, (None, "init: ...") when the driver does not answer.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            try:
                module = factory()
            except ImportError as exc:
                box["error"] = f"missing: {exc}"
                return
            probe = NvmlProbe(module)
            box["samples"] = probe.sample()
            probe.close()
        except NvmlUnavailableError as exc:
            box["error"] = f"init: {exc}"
        except Exception as exc:  # noqa: BLE001 - any NVML failure is reported, not raised
            box["error"] = f"init: {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=work, name="nvml-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, "timeout"
    return box.get("samples"), box.get("error", "")


def _load_state(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_state(path: Path, data: dict[str, Any], problems: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:
        problems.append(f"cannot write {path}: {exc.strerror or exc}")


def _gpu_findings(
    settings: Settings, node: str, budget_left: float, result: HookResult, nvml: NvmlSource | None
) -> list[GpuSample]:
    factory = _nvml_factory(settings, node, nvml)
    if factory is None:
        return []
    samples, error = probe_gpus(factory, min(settings.health.nvml_timeout_s, budget_left))
    expected = settings.health.expected_gpus
    if error == "timeout":
        result.findings.append(
            Finding(
                "nvml",
                "drain",
                "NVML did not answer within "
                f"{min(settings.health.nvml_timeout_s, budget_left):g} s",
            )
        )
    elif error.startswith("missing"):
        result.problems.append(f"pynvml not installed: GPU checks skipped ({error})")
    elif error:
        if expected:
            result.findings.append(
                Finding("nvml", "drain", f"NVML unavailable with {expected} GPUs expected: {error}")
            )
        else:
            result.problems.append(f"NVML unavailable: {error}")
    if samples is None:
        return []
    thresholds = GpuThresholds(
        expected_count=expected,
        max_temp_c=settings.health.max_temp_c,
        min_sm_clock_max_mhz=settings.health.min_sm_clock_max_mhz,
        critical_xids=frozenset(settings.health.critical_xids),
    )
    samples = _with_kernel_xids(settings, samples, thresholds, result)
    result.findings += check_gpus(samples, thresholds)
    result.gpus = [g.to_dict() for g in samples]
    return samples


def _with_kernel_xids(
    settings: Settings, samples: list[GpuSample], thresholds: GpuThresholds, result: HookResult
) -> list[GpuSample]:
    """Add the XIDs the driver logged since the last check (prolog or epilog) to the GPUs they
    name by PCI address; one on a GPU NVML does not list is a finding of its own."""
    if settings.health.kmsg_path is None:
        return samples
    state_path = settings.health.state_dir / "kmsg.json"
    after = _load_state(state_path).get("seq", -1)
    try:
        xids, newest = new_xids(settings.health.kmsg_path, after if isinstance(after, int) else -1)
    except OSError as exc:
        result.problems.append(f"kernel log unreadable, its XIDs skipped: {exc.strerror or exc}")
        return samples
    _save_state(state_path, {"seq": newest}, result.problems)
    by_pci = {pci_key(g.pci_bus_id): g.index for g in samples if g.pci_bus_id}
    extra: dict[int, list[int]] = {}
    for x in xids:
        index = by_pci.get(x.pci)
        if index is not None:
            extra.setdefault(index, []).append(x.xid)
            continue
        severity: Literal["drain", "warn"] = (
            "drain" if x.xid in thresholds.critical_xids else "warn"
        )
        where = "{:04x}:{:02x}:{:02x}".format(*x.pci)
        result.findings.append(Finding("xid", severity, f"XID {x.xid} on PCI {where}"))
    return [replace(g, xids=[*g.xids, *extra[g.index]]) if g.index in extra else g for g in samples]


def _fabric_findings(settings: Settings, result: HookResult) -> None:
    root = settings.health.sysfs_root
    state_path = settings.health.state_dir / "fabric.json"
    ports = read_ports(root)
    previous = _load_state(state_path)
    result.findings += check_fabric(
        ports,
        previous,
        expected_hcas=settings.health.expected_hcas,
        hcas=count_hcas(root),
        expected_rate_gbps=settings.health.expected_ib_rate_gbps,
    )
    if ports:
        _save_state(state_path, {p.name: p.counters for p in ports}, result.problems)


def _redis(settings: Settings) -> Any:
    from slurm_plugin.store.telemetry_store import connect_from  # noqa: PLC0415 - only when needed

    return connect_from(
        settings, timeout_s=min(settings.redis.timeout_s, 2.0), retries=0, decode=True
    )


def _trouble(exc: Exception) -> str:
    """What went wrong, as a problem line starts: Redis away, or a fault of ours (a bug, a
    credential file we could not write) that must not be reported as Redis being away."""
    from redis.exceptions import RedisError  # noqa: PLC0415 - only when something failed

    if isinstance(exc, RedisError | RedisUnavailableError):  # redis-py's, or ours around it
        return "Redis unavailable"
    return f"{type(exc).__name__} (not Redis)"


def _redis_prolog(settings: Settings, env: Mapping[str, str], result: HookResult) -> None:
    """Persistent-straggler refusal, job registration, and the check result per node."""
    from slurm_plugin.store import registration  # noqa: PLC0415
    from slurm_plugin.store.nodes import NodeRecord  # noqa: PLC0415

    try:
        client = _redis(settings)
        record = NodeRecord(client, result.node)
        # Only an explicit refusal (the service after its rails, or an admin) keeps a node
        # out; node history alone never does.
        why = record.refusal()
        if why is not None:
            text = f"{why.get('reason') or 'refused'} [{why.get('decision_id') or ''}]"
            result.findings.append(Finding("persistent", "drain", text[:200]))
        if result.job_id:
            registration.register(client, result.job_id, _registration(env))
        if result.job_id and settings.telemetry.job_credentials:
            _issue_credential(client, settings, env, result)
        check = {
            "ts": time.time(),
            "job_id": result.job_id,
            "exit_code": verdict(result.findings),
            "findings": [f.to_dict() for f in result.findings],
        }
        record.record_check(
            check, result.summary() if verdict(result.findings) else None, time.time()
        )
    except Exception as exc:  # noqa: BLE001 - our trouble, never the job's: fail open, loudly
        result.problems.append(f"{_trouble(exc)}, persistent check skipped: {exc}")


def _registration(env: Mapping[str, str]) -> Any:
    """The job's registration from slurmd's environment. Only an explicit policy choice is
    registered: without one, the job's --comment and then the cluster default apply (resolved
    by the service)."""
    from slurm_plugin.store.registration import OPTIONS, Registration  # noqa: PLC0415

    return Registration(
        policy=env.get("SPANK_STRAGGLER_POLICY") or env.get("STRAGGLER_POLICY") or "",
        nodes=env.get("SLURM_NODELIST", ""),
        user=env.get("SLURM_JOB_USER", ""),
        attempt=env.get("SLURM_RESTART_COUNT", "0"),
        run=valid_sluid(env.get("SLURM_JOB_SLUID")) or "",
        registered_at=f"{time.time():.3f}",
        options={
            key: env[f"SPANK_STRAGGLER_{key.upper()}"]
            for key in OPTIONS
            if env.get(f"SPANK_STRAGGLER_{key.upper()}")
        },
    )


def _issue_credential(
    client: Any, settings: Settings, env: Mapping[str, str], result: HookResult
) -> None:
    """The job's ACL user and its credential file (a problem, never a drain, when it fails:
    the job then runs without telemetry)."""
    from slurm_plugin.store import credentials  # noqa: PLC0415

    try:
        uid, gid = int(env["SLURM_JOB_UID"]), int(env["SLURM_JOB_GID"])
    except (KeyError, ValueError):
        result.problems.append("SLURM_JOB_UID/GID missing: no job credential issued")
        return
    try:
        # Bound to the job's user and, where Slurm names it (25.11 on), to this run: a later
        # job given the same id, of the same user too, never gets this password.
        run = valid_sluid(env.get("SLURM_JOB_SLUID"))
        owner = f"{uid}/{run}" if run else str(uid)
        password = credentials.issue(client, result.job_id, owner=owner)
    except Exception as exc:  # noqa: BLE001 - e.g. the admin user lacks +acl: the job runs
        result.problems.append(f"cannot issue the job's Redis credential: {exc}")
        return
    redis: dict[str, str | bool | float] = {
        "url": credentials.job_url(settings.redis.url, result.job_id, password),
        "cluster": settings.redis.cluster,
        "timeout_s": settings.redis.timeout_s,
    }
    if settings.redis.tls_ca_file is not None:
        redis["tls_ca_file"] = str(settings.redis.tls_ca_file)
    telemetry: dict[str, str | bool | float] = {
        "enabled": settings.telemetry.enabled,
        "flush_interval_s": settings.telemetry.flush_interval_s,
    }
    values = {"redis": redis, "telemetry": telemetry}
    path = credentials.credential_path(result.job_id, settings.telemetry.job_credentials_dir)
    try:
        credentials.write_file(path, credentials.render(result.job_id, values), uid, gid)
    except (OSError, StragglerError) as exc:
        result.problems.append(f"cannot write the job credential {path}: {exc}")


def _remove_credential_file(settings: Settings, result: HookResult) -> None:
    from slurm_plugin.store import credentials  # noqa: PLC0415

    path = credentials.credential_path(result.job_id, settings.telemetry.job_credentials_dir)
    try:
        credentials.remove_file(path)
    except OSError as exc:
        result.problems.append(f"cannot remove the job credential {path}: {exc}")


def run_prolog(
    env: Mapping[str, str], settings: Settings, nvml: NvmlSource | None = None
) -> HookResult:
    """All prolog checks within ``health.budget_s``; the exit code is in the result."""
    started = time.monotonic()
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    result = HookResult(node=node, job_id=env.get("SLURM_JOB_ID", ""))
    budget = settings.health.budget_s
    samples = _gpu_findings(settings, node, budget, result, nvml)
    if samples:
        ecc = {str(g.index): {"ecc": g.ecc_uncorrected_volatile} for g in samples}
        _save_state(settings.health.state_dir / "gpu.json", ecc, result.problems)
    if time.monotonic() - started < budget:
        _fabric_findings(settings, result)
    else:
        result.problems.append("time budget spent: fabric checks skipped")
    if time.monotonic() - started < budget:
        _redis_prolog(settings, env, result)
    result.exit_code = verdict(result.findings)
    result.elapsed_s = time.monotonic() - started
    return result


def run_epilog(
    env: Mapping[str, str], settings: Settings, nvml: NvmlSource | None = None
) -> HookResult:
    """Post-job checks (new critical XIDs, ECC errors since the prolog), job key expiry."""
    started = time.monotonic()
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    result = HookResult(node=node, job_id=env.get("SLURM_JOB_ID", ""))
    before = _load_state(settings.health.state_dir / "gpu.json")
    samples = _gpu_findings(settings, node, settings.health.budget_s, result, nvml)
    # Right after a job only what the job may have broken counts: XIDs, page retirement, row
    # remapping, a hung NVML, and ECC errors that appeared since the prolog.
    result.findings = [
        f for f in result.findings if f.check in {"xid", "retired_pages", "row_remap", "nvml"}
    ]
    for g in samples:
        then = (before.get(str(g.index)) or {}).get("ecc")
        if g.ecc_uncorrected_volatile and then is not None and g.ecc_uncorrected_volatile > then:
            result.findings.append(
                Finding(
                    "ecc",
                    "drain",
                    f"+{g.ecc_uncorrected_volatile - then} uncorrectable ECC errors during the job",
                    f"gpu{g.index}",
                )
            )
    try:
        from slurm_plugin.store import credentials  # noqa: PLC0415
        from slurm_plugin.store.nodes import NodeRecord  # noqa: PLC0415
        from slurm_plugin.store.telemetry_store import TelemetryStore  # noqa: PLC0415

        if result.job_id and settings.telemetry.job_credentials:
            # The file goes first: Redis being away must not leave a credential behind.
            _remove_credential_file(settings, result)
        client = _redis(settings)
        if result.job_id and settings.telemetry.job_credentials:
            credentials.revoke(client, result.job_id)
        if result.job_id:
            TelemetryStore(client).expire_job(result.job_id)
        NodeRecord(client, node).record_epilog(
            {
                "ts": time.time(),
                "job_id": result.job_id,
                "findings": [f.to_dict() for f in result.findings],
            }
        )
    except Exception as exc:  # noqa: BLE001 - the epilog never fails on telemetry
        result.problems.append(f"{_trouble(exc)} in epilog: {exc}")
    result.exit_code = verdict(result.findings)
    result.elapsed_s = time.monotonic() - started
    return result
