"""Prolog wall time with the fake NVML (8 GPUs) and 8 IB ports, Python start-up included,
and the import time of the entry point. ``python -m benchmarks.bench_prolog`` (dev cluster up
for Redis; without it the prolog passes and logs that Redis is away)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import machine, redis_url, table
from slurm_plugin.devcluster.fake_prolog import write_bin
from slurm_plugin.devcluster.settings import FAKE_NVML_ENV
from slurm_plugin.testing import build_ib_tree


def _time_prolog(env: dict[str, str], runs: int) -> tuple[list[float], set[int]]:
    """Wall times and exit codes of ``runs`` prolog runs: the production prolog with fake
    GPUs, as the dev cluster runs it (``devcluster.fake_prolog``)."""
    prolog = str(write_bin(Path(env["STRAGGLER_CONFIG"]).parent / "prolog-bin"))
    walls, codes = [], set()
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run([prolog], env=env, capture_output=True, check=False)
        walls.append(time.perf_counter() - started)
        codes.add(proc.returncode)
    return walls, codes


def main() -> None:
    runs = 20
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "gpus.json").write_text(json.dumps({"default": {"gpus": 8}}))
        build_ib_tree(base / "root", 8)
        (base / "config.toml").write_text(
            f'[redis]\nurl = "{redis_url()}"\n[health]\nsysfs_root = "{base / "root"}"\n'
            f'state_dir = "{base / "state"}"\nexpected_gpus = 8\nexpected_hcas = 8\n'
        )
        env = {
            **os.environ,
            "STRAGGLER_CONFIG": str(base / "config.toml"),
            FAKE_NVML_ENV: str(base / "gpus.json"),
            "SLURMD_NODENAME": "node1",
            "SLURM_JOB_ID": "1",
        }
        walls, codes = _time_prolog(env, runs)
        # The same with a per-job Redis credential issued (ACL user + 0600 file).
        (base / "creds.toml").write_text(
            (base / "config.toml").read_text()
            + f'[telemetry]\njob_credentials = true\njob_credentials_dir = "{base / "jobs"}"\n'
        )
        cred_env = {
            **env,
            "STRAGGLER_CONFIG": str(base / "creds.toml"),
            "SLURM_JOB_UID": str(os.getuid()),
            "SLURM_JOB_GID": str(os.getgid()),
        }
        cred_walls, cred_codes = _time_prolog(cred_env, runs)
        issued = (base / "jobs" / "1.toml").exists()
        epilog = str(Path(sys.executable).parent / "straggler-epilog")
        subprocess.run([epilog], env=cred_env, capture_output=True, check=False)
        revoked = not (base / "jobs" / "1.toml").exists()
        imports = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                "-c",
                "import slurm_plugin.health.entry, slurm_plugin.config, slurm_plugin.health.hook",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    total_us = sum(int(m.group(1)) for m in re.finditer(r"\|\s+(\d+)\s+\|\s{1}\S", imports))
    heavy = [line for line in imports.splitlines() if re.search(r"\b(click|redis|pynvml)\b", line)]
    print(f"machine: {machine()}")
    print(
        table(
            ["measurement", "figure"],
            [
                [
                    "prolog wall time, 8 fake GPUs + 8 IB ports (median / max of 20)",
                    f"{statistics.median(walls) * 1000:.0f} ms / {max(walls) * 1000:.0f} ms",
                ],
                [
                    "the same, issuing the job's Redis credential (median / max of 20)",
                    (
                        f"{statistics.median(cred_walls) * 1000:.0f} ms / "
                        f"{max(cred_walls) * 1000:.0f} ms "
                        f"(file written: {issued}, removed by the epilog: {revoked})"
                    ),
                ],
                ["exit codes", ", ".join(str(c) for c in sorted(codes | cred_codes))],
                [
                    "import time of entry point + settings + hook (top-level total)",
                    f"{total_us / 1000:.0f} ms",
                ],
                ["click / redis / pynvml imported at start-up", "yes" if heavy else "no"],
            ],
        )
    )


if __name__ == "__main__":
    main()
