"""The per-node sidecar: every interval, sample GPUs (NVML) and CPU signals and publish them.

Without a job id (the root-owned unit, one per node) the latest sample is kept in the node's
hash: the service reads it as hardware evidence for a straggler on that node. With a job id (run
inside a job, as the job's user) the samples go to the job's ``gpu`` stream, which the job could
forge: the service shows them, and they never corroborate (``service/evidence.py``). Redis
trouble is logged and retried at the next tick; the sidecar itself never stops on it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
import structlog

from slurm_plugin.errors import StragglerError
from slurm_plugin.model import keys
from slurm_plugin.probes.cpu import sample_cpu
from slurm_plugin.probes.gpu import NvmlProbe, NvmlUnavailableError
from slurm_plugin.store.nodes import NodeRecord
from slurm_plugin.store.telemetry_store import TelemetryStore

log = structlog.get_logger(__name__)


class Sidecar:
    """Samples one node and publishes to Redis."""

    def __init__(
        self,
        store: TelemetryStore,
        node: str,
        *,
        job_id: str | None = None,
        nvml: Any | None = None,
        proc_root: Path = Path("/"),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.node = keys.check_node(node)
        self.job_id = keys.check_job_id(job_id) if job_id else None
        self.proc_root = proc_root
        self.clock = clock
        self.probe: NvmlProbe | None
        try:
            self.probe = NvmlProbe(nvml)
        except NvmlUnavailableError as exc:
            self.probe = None
            log.warning(
                "sidecar.nvml_unavailable",
                node=node,
                reason=str(exc),
                detail="publishing CPU signals only",
            )

    def sample(self) -> dict[str, Any]:
        """One node sample: every GPU plus the CPU signals. A reading that is not a finite
        number (a driver's NaN) becomes null and is counted in ``unreadable``: one bad value
        never costs the node its whole sample."""
        raw = {
            "gpus": [g.to_dict() for g in self.probe.sample()] if self.probe else [],
            "cpu": sample_cpu(self.proc_root).to_dict(),
        }
        bad: list[int] = [0]
        clean = _finite(raw, bad)
        return {
            "node": self.node,
            "ts": self.clock(),
            **clean,
            "nvml": self.probe is not None,
            **({"unreadable": bad[0]} if bad[0] else {}),
        }

    def publish_once(self) -> dict[str, Any]:
        """Sample and publish; returns the sample. Raises on Redis trouble."""
        sample = self.sample()
        if self.job_id is not None:
            self.store.publish(self.job_id, gpu_samples=[sample])
        else:
            text = json.dumps(sample, separators=(",", ":"), allow_nan=False, default=str)
            NodeRecord(self.store.client, self.node).record_sample(text)
        return sample

    def run(
        self, interval_s: float = 1.0, count: int | None = None, stop: threading.Event | None = None
    ) -> int:
        """Publish every ``interval_s`` until ``stop`` is set or ``count`` samples; returns the
        number published."""
        stop = stop or threading.Event()
        published = 0
        while count is None or published < count:
            started = time.monotonic()
            try:
                self.publish_once()
                published += 1
            except (StragglerError, redis.RedisError) as exc:
                log.warning("sidecar.publish_failed", node=self.node, error=str(exc))
            if stop.wait(max(0.0, interval_s - (time.monotonic() - started))):
                break
        return published

    def close(self) -> None:
        """Release NVML."""
        if self.probe is not None:
            self.probe.close()


def _finite(value: Any, bad: list[int]) -> Any:
    """``value`` with every non-finite float replaced by None (counted in ``bad[0]``)."""
    if isinstance(value, float) and not math.isfinite(value):
        bad[0] += 1
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v, bad) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v, bad) for v in value]
    return value
