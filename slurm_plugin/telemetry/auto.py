"""The code-free mode: every PyTorch process of a job reports, with no change to its code.

The SPANK option ``--straggler-telemetry=auto`` (or the site's default) puts
``slurm_plugin/telemetry/autoload`` first on the ranks' ``PYTHONPATH``; the
``sitecustomize`` there calls :func:`enable` at interpreter start-up. That costs nothing
until the job imports torch: an import hook waits for ``torch`` and only then instruments
the process (:func:`slurm_plugin.telemetry.instrument.instrument`, which reports once
``torch.distributed`` is initialised, each rank labelled by the coordinates of the device
mesh the job builds, if any) and report its checkpoints (a ``torch.save`` of a
training state; ``dcp.save`` and safetensors' saves once those are imported:
:mod:`slurm_plugin.telemetry.checkpoints`). A process that never imports torch is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: ``STRAGGLER_AUTO`` values that turn the mode off in a process.
OFF = frozenset({"", "0", "off", "false", "no"})

_enabled = False
_said: set[str] = set()


def say_once(key: str, message: str) -> None:
    """One line in the job's log (stderr), once per process."""
    if key not in _said:
        _said.add(key)
        print(f"straggler: {message}", file=sys.stderr, flush=True)  # noqa: T201


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a module has been imported (executed), whoever imports it."""

    def __init__(self, callbacks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.callbacks = callbacks
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        callback = self.callbacks.get(fullname)
        if callback is None or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.name = None
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            del self.callbacks[fullname]
            _guarded(fullname, callback, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _guarded(name: str, callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001 - the job must run on, uninstrumented
        say_once("failed", f"code-free telemetry is off in this process ({name}: {exc!r})")


def _torch_loaded(torch: ModuleType) -> None:
    from slurm_plugin.telemetry.checkpoints import report_torch_saves  # noqa: PLC0415
    from slurm_plugin.telemetry.instrument import (  # noqa: PLC0415 - needs torch
        instrument,
        label_from_meshes,
    )

    instrument(distributed_only=True)
    report_torch_saves(torch)
    try:
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed import device_mesh  # noqa: PLC0415
    except ImportError:  # a torch without device meshes: nothing to label from
        return
    label_from_meshes(device_mesh, dist)


def _checkpoint_loaded(module: ModuleType) -> None:
    from slurm_plugin.telemetry.checkpoints import report_dcp_saves  # noqa: PLC0415

    report_dcp_saves(module)


def _safetensors_loaded(module: ModuleType) -> None:
    from slurm_plugin.telemetry.checkpoints import report_safetensors_saves  # noqa: PLC0415

    report_safetensors_saves(module)


def enable(env: Any = None) -> bool:
    """Instrument this process when it imports torch (once); False when the mode is off."""
    global _enabled  # noqa: PLW0603 - once per process
    env = os.environ if env is None else env
    if _enabled or env.get("STRAGGLER_AUTO", "").strip().lower() in OFF:
        return False
    _enabled = True
    callbacks: dict[str, Callable[[ModuleType], None]] = {
        "torch": _torch_loaded,
        "torch.distributed.checkpoint": _checkpoint_loaded,
        "safetensors.torch": _safetensors_loaded,
    }
    for name, callback in list(callbacks.items()):
        module = sys.modules.get(name)
        if module is not None:  # imported before us (a sitecustomize earlier on the path)
            del callbacks[name]
            _guarded(name, callback, module)
    sys.meta_path.insert(0, _AfterImport(callbacks))
    return True
