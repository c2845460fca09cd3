"""The package's imports flow one way, and no module imports itself through others.

Every ``import`` of an ``epdserve`` module counts, wherever it stands (module level, inside a
function, under ``TYPE_CHECKING``): a function-local import is still a dependency. Layers, top
to bottom (a module may import its own layer's modules and any layer below; the bottom
modules may import each other; nothing imports upward)::

    cli -> planner -> sim -> bench | router -> cluster -> engine -> models -> base

``bench`` and ``router`` share a layer but do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "epdserve"
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("planner",),
    ("sim",),
    ("bench", "router"),
    ("cluster",),
    ("engine",),
    ("models",),
    # The base: descriptors, options and plain data every floor uses.
    ("transfer", "auth", "config", "cli_args", "sampling", "validate", "structured", "roles", "request", "errors",
     "envs", "faults", "gc_heap", "service", ""),
]
BASE = len(LAYERS) - 1


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The epdserve modules ``name`` imports (anywhere in its body)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name and target.startswith("epdserve"):
                found.add(target)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = module_names(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def unit_of(module: str) -> str:
    """The top-level unit of ``epdserve.X.Y``: ``X`` ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int:
    unit = unit_of(module)
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{module} is in no layer: add its unit {unit!r} to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = layer_of(module), layer_of(target)
            if there < here:
                bad.append(f"{module} -> {target} (up from {LAYERS[here]} to {LAYERS[there]})")
            elif there == here != BASE and unit_of(module) != unit_of(target):
                bad.append(f"{module} -> {target} (sideways within {LAYERS[here]})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("source, expected", [
    ("from epdserve.router.core import Router\n", "up from"),  # the engine floor reaching up
    ("def f():\n    from epdserve.cli import main\n", "up from"),  # hidden in a function: still counts
])
def test_the_check_catches_an_upward_import(tmp_path, source, expected):
    copy = tmp_path / "epdserve"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    with open(copy / "engine" / "scheduler.py", "a", encoding="utf-8") as f:
        f.write(source)
    problems = upward_imports(import_graph(copy))
    assert any(p.startswith("epdserve.engine.scheduler -> ") and expected in p for p in problems), problems


def test_the_check_catches_a_cycle(tmp_path):
    copy = tmp_path / "epdserve"
    (copy / "engine").mkdir(parents=True)
    (copy / "__init__.py").write_text("")
    (copy / "engine" / "__init__.py").write_text("")
    (copy / "engine" / "a.py").write_text("from epdserve.engine import b\n")
    (copy / "engine" / "b.py").write_text("def f():\n    from epdserve.engine.a import x\n")
    assert cycles(import_graph(copy)) == [["epdserve.engine.a", "epdserve.engine.b"]]
