"""The package's layers run one way, and the service, the prolog and the in-job reporter never
reach the development tooling.

Every import counts, including those inside functions: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_plugin"

# Lowest first. A module may import its own unit and any unit of a lower layer; two units of
# one layer never import each other (the Slurm adapter and the Redis adapter are peers).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version"),
    ("logging", "tomlfile"),
    ("model", "probes"),  # shared value types and key schema; hardware probes
    ("detection",),  # the pure core ...
    ("policy",),  # ... and what it decides with
    ("config",),
    ("slurm", "store", "trace", "trace_meta"),  # adapters: Slurm, Redis, trace files
    ("telemetry", "health", "replay", "whatif"),  # in-job side; prolog/epilog; backtest
    ("service", "backtest"),
    ("testing", "devcluster"),
    ("demo",),
    ("cli",),
    ("",),  # the package itself: the lazy public API (StepReporter)
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

# What runs in production: the service (through the CLI), the prolog/epilog, the reporter and
# the node sidecar.
PRODUCTION = (
    "slurm_plugin.service.loop",
    "slurm_plugin.health.entry",
    "slurm_plugin.telemetry.reporter",
    "slurm_plugin.telemetry.sidecar",
    "slurm_plugin.telemetry.torch",
    "slurm_plugin.telemetry.instrument",
    "slurm_plugin.telemetry.auto",
    "slurm_plugin.telemetry.fsdp",
    "slurm_plugin.telemetry.lightning",
    "slurm_plugin.telemetry.hf",
    "slurm_plugin.telemetry.autoload.sitecustomize",
)
DEV_ONLY = ("slurm_plugin.testing", "slurm_plugin.devcluster", "slurm_plugin.demo")


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (every import statement, at any depth)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        name = _module_name(path, package)
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                found = [module] + [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                continue
            targets.update(t for t in found if t.split(".")[0] == "slurm_plugin")
        graph[name] = targets
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def wrong_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer or sideways between two units of one layer."""
    wrong = []
    for source, targets in graph.items():
        # ``from a.b import c`` names both a.b and a.b.c: report the module, not its package.
        modules = targets & graph.keys()  # not the names imported from a module
        named = {t for t in modules if not any(o.startswith(f"{t}.") for o in modules)}
        for target in sorted(named):
            src, dst = _unit(source), _unit(target)
            if src == dst:
                continue
            if src not in RANK or dst not in RANK:
                wrong.append(f"{source} -> {target} (unit not in LAYERS)")
            elif RANK[dst] >= RANK[src]:
                wrong.append(f"{source} -> {target}")
    return wrong


def _arrows(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``module -> modules it imports`` (``from a.b import c`` names a.b and a.b.c: only the
    module, not the names imported from it)."""
    out = {}
    for source, targets in graph.items():
        modules = targets & graph.keys()
        out[source] = {t for t in modules if not any(o.startswith(f"{t}.") for o in modules)}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a circle, also inside
    one package and also under ``TYPE_CHECKING`` (Tarjan's strongly connected components)."""
    arrows = _arrows(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(arrows.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == module:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for module in sorted(arrows):
        if module not in index:
            visit(module)
    return sorted(found)


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in graph:
            continue
        seen.add(module)
        # Importing a.b.c runs a/__init__ and a/b/__init__ as well.
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo.extend([*graph[module], *parents])
    return seen


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in import_graph()}
    assert units - set(RANK) == set()


def test_imports_run_down_the_layers() -> None:
    assert wrong_arrows(import_graph()) == []


def test_no_import_circles_anywhere() -> None:
    """Two modules that import each other (the service's loop and its resume did) are one
    module split at no seam; inside one package as much as between two."""
    assert circles(import_graph()) == []


def test_the_checker_sees_a_circle_inside_a_package(tmp_path: Path) -> None:
    package = tmp_path / "slurm_plugin"
    (package / "service").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "service" / "__init__.py").write_text("")
    (package / "service" / "loop.py").write_text("from slurm_plugin.service.resume import r\n")
    (package / "service" / "resume.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from slurm_plugin.service.loop import Service\n"
    )
    (package / "service" / "alone.py").write_text("from slurm_plugin.service import loop\n")
    assert circles(import_graph(package)) == [
        ["slurm_plugin.service.loop", "slurm_plugin.service.resume"]
    ]


@pytest.mark.parametrize("entry", PRODUCTION)
def test_production_never_reaches_dev_tooling(entry: str) -> None:
    graph = import_graph()
    assert entry in graph
    reached = reach(graph, entry)
    assert sorted(m for m in reached if m.startswith(DEV_ONLY)) == []


def test_the_cli_loads_no_dev_tooling_until_a_dev_command_runs() -> None:
    code = (
        "import sys, slurm_plugin.cli.main\n"
        f"print(sorted(m for m in sys.modules if m.startswith({DEV_ONLY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_checker_sees_a_wrong_arrow(tmp_path: Path) -> None:
    package = tmp_path / "slurm_plugin"
    for unit in ("detection", "store", "health"):
        (package / unit).mkdir(parents=True)
        (package / unit / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "detection" / "job.py").write_text(
        "from slurm_plugin.store import telemetry_store\n"
    )
    (package / "store" / "telemetry_store.py").write_text(
        "def f():\n    from ..health import hook\n"
    )
    (package / "health" / "hook.py").write_text("from slurm_plugin.store import telemetry_store\n")
    wrong = wrong_arrows(import_graph(package))
    assert wrong == [
        "slurm_plugin.detection.job -> slurm_plugin.store.telemetry_store",
        "slurm_plugin.store.telemetry_store -> slurm_plugin.health.hook",
    ]
