"""The dev cluster's prolog and epilog: the production ones (`straggler-prolog`,
`straggler-epilog`), unchanged but for their GPUs, which come from the fake NVML spec named by
``$STRAGGLER_DEVCLUSTER_FAKE_NVML`` (`slurm_plugin.probes.fake_nvml`). Production has no way
to reach fakes: this module is development tooling, and the production entry points take no
such setting.

Run as ``python -m slurm_plugin.devcluster.fake_prolog prolog|epilog``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from slurm_plugin.devcluster.settings import FAKE_NVML_ENV
from slurm_plugin.health.entry import run_hook


def fake_nvml(spec: Path) -> Any:
    """A node -> fake NVML source for the checks, from the spec file ``spec``."""

    def for_node(node: str) -> Any:
        from slurm_plugin.probes.fake_nvml import fake_nvml_from_spec  # noqa: PLC0415

        return fake_nvml_from_spec(spec, node)

    return for_node


def write_bin(path: Path, kind: str = "prolog") -> Path:
    """An executable at ``path`` that runs this module's ``kind`` with this Python: what
    ``$STRAGGLER_PROLOG_BIN`` (or ``_EPILOG_BIN``) names for the shipped wrapper."""
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m {__name__} {kind}\n")
    path.chmod(0o755)
    return path


def main(argv: list[str] | None = None) -> None:
    """Run the prolog or the epilog with the fake GPUs; exit with its code."""
    args = sys.argv[1:] if argv is None else argv
    kind = args[0] if args else "prolog"
    spec = os.environ.get(FAKE_NVML_ENV)
    if kind not in {"prolog", "epilog"} or not spec:
        sys.stderr.write(f"usage: ${FAKE_NVML_ENV}=SPEC.json {sys.argv[0]} prolog|epilog\n")
        os._exit(2)
    sys.stdout.flush()
    code = run_hook(kind, fake_nvml(Path(spec)))
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
