"""slurm-straggler's code-free telemetry (put first on a job's PYTHONPATH by the SPANK plugin).

Instruments the process once it imports torch (slurm_plugin.telemetry.auto), then runs the
``sitecustomize`` the job would have run without us, if any. Nothing here may stop the job:
every failure is one line on stderr.
"""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def _start() -> None:
    if os.environ.get("STRAGGLER_AUTO", "").strip().lower() in {"", "0", "off", "false", "no"}:
        return
    try:
        from slurm_plugin.telemetry import auto  # noqa: PLC0415 - may be missing
    except Exception as exc:  # noqa: BLE001 - the job runs on without telemetry
        print(  # noqa: T201
            f"straggler: code-free telemetry is off in this Python ({exc!r}); install "
            "slurm-straggler in the job's environment",
            file=sys.stderr,
        )
        return
    auto.enable()


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path (the job's or the system's), as site would."""
    here = Path(__file__).resolve().parent
    path = [p for p in sys.path if Path(p or os.curdir).resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - site reports a failing sitecustomize the same way
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{exc!r}", file=sys.stderr)  # noqa: T201


_start()
_chain()
