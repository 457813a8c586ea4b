"""``make test-gpu``: every check that needs a GPU, one summary table at the end.

Without a GPU it says so in one line and exits 0. Each check is a pytest run of ``tests/gpu``
(the same tests ``make test`` skips without a GPU); the table has its result, its time and
the figures it printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKS = (
    ("real NVML probe", ["tests/gpu/test_nvml_real.py"]),
    ("prolog GPU checks, timed", ["tests/gpu/test_prolog_gpu.py"]),
    (
        "DDP, CUDA events: slow rank found",
        ["tests/gpu/test_cuda_timing.py", "-k", "ddp and not code_free"],
    ),
    (
        "FSDP2, CUDA events: slow rank found",
        ["tests/gpu/test_cuda_timing.py", "-k", "fsdp2 and not code_free"],
    ),
    ("code-free mode on CUDA", ["tests/gpu/test_cuda_timing.py", "-k", "code_free"]),
)


def _gpu() -> str | None:
    """Why there is no usable GPU, or None when there is one."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (set GPU_TORCH_SPEC to a CUDA one)"
    if not torch.cuda.is_available():
        return "CUDA finds no GPU"
    return None


def main() -> int:
    why = _gpu()
    if why is not None:
        print(f"test-gpu: no GPU to check here ({why}); nothing to do")  # noqa: T201
        return 0
    rows = []
    for name, args in CHECKS:
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        out = run.stdout + run.stderr
        figures = [x.split(" ", 1)[1] for x in out.splitlines() if x.startswith("FIGURES ")]
        result = "pass" if run.returncode == 0 else "FAIL"
        if run.returncode == 0 and " skipped" in out and " passed" not in out:
            result = "skipped"
            figures = [x for x in out.splitlines() if x.startswith("SKIPPED")][:1]
        if run.returncode != 0:
            figures = [x for x in out.splitlines() if x.startswith(("E ", "FAILED"))][:3]
        rows.append((name, result, f"{time.monotonic() - started:.1f}", "; ".join(figures)))
    import torch  # noqa: PLC0415

    print(f"\n# make test-gpu: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}")  # noqa: T201
    print("| check | result | s | figures |\n|---|---|---|---|")  # noqa: T201
    for row in rows:
        print("| " + " | ".join(row) + " |")  # noqa: T201
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
