"""What the relay tests share: the job's ranks as processes publishing through a node's
relay (tests/integration/_relay_ranks.py), and the job's records read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from slurm_plugin.model.records import StepRecord
from slurm_plugin.store.telemetry_store import Seen, TelemetryStore

REPO = Path(__file__).resolve().parents[2]
JOB = "4242"


def ranks(
    job_in_env: str, job: str, first: int, count: int, seconds: float, sock: Path, url: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "SLURM_JOB_ID": job_in_env, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "tests.integration._relay_ranks", job, str(first), str(count)]
    return subprocess.Popen(
        [*argv, str(seconds), str(sock), url],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def published(proc: subprocess.Popen[str]) -> int:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return int(json.loads(out.strip().splitlines()[-1])["published"])


def read_all(store: TelemetryStore) -> tuple[list[StepRecord], int, int]:
    records, seen, after, repeats, malformed = [], Seen(), "0-0", 0, 0
    while True:
        page = store.read_steps(JOB, after=after, count=5000, seen=seen)
        records.extend(page.records)
        repeats += page.repeats
        malformed += page.malformed
        if page.last_id == after:
            return records, repeats, malformed
        after = page.last_id
