"""Console scripts ``straggler-prolog`` and ``straggler-epilog``: fast start, exit code = verdict.

They import neither click nor redis nor pynvml at start-up, and leave with ``os._exit`` so a
hung NVML thread cannot keep the process alive past its verdict.
"""

from __future__ import annotations

import os
import sys


def _run(kind: str) -> int:
    try:
        from slurm_plugin.config import load_settings  # noqa: PLC0415
        from slurm_plugin.logging import configure_logging  # noqa: PLC0415

        configure_logging("info", json=True)
        settings = load_settings()
    except Exception as exc:  # noqa: BLE001 - a broken config is our problem: fail open
        sys.stderr.write(f"straggler-{kind}: configuration problem, passing: {exc}\n")
        return 0
    import structlog  # noqa: PLC0415

    from slurm_plugin.health.hook import run_epilog, run_prolog  # noqa: PLC0415

    log = structlog.get_logger(f"straggler.{kind}")
    try:
        result = (run_prolog if kind == "prolog" else run_epilog)(os.environ, settings)
    except Exception:
        log.exception(f"{kind}.crashed")
        return 0
    for problem in result.problems:
        log.error(f"{kind}.own_problem", problem=problem, node=result.node)
    event = f"{kind}.{'fail' if result.exit_code else 'pass'}"
    log.info(
        event,
        node=result.node,
        job_id=result.job_id,
        exit_code=result.exit_code,
        elapsed_s=round(result.elapsed_s, 3),
        summary=result.summary(),
        findings=[str(f) for f in result.findings],
    )
    return result.exit_code


def prolog_main() -> None:
    """Entry point of ``straggler-prolog``."""
    sys.stdout.flush()
    code = _run("prolog")
    sys.stderr.flush()
    os._exit(code)


def epilog_main() -> None:
    """Entry point of ``straggler-epilog``."""
    code = _run("epilog")
    sys.stderr.flush()
    os._exit(code)
