"""The house (DESIGN.md, "The house"): rooms import only from rooms below them, no module
imports itself back through others (function-level imports included), the package's top holds
few modules, and no source file outgrows one job.

The import graph is read from the sources (ast), not by importing them, so a lazy import inside
a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tpu_inductor": "tpu_inductor", "lowering": "tpu_inductor.lowering"}
PACKAGES["passes"] = "tpu_inductor.passes"

# Rooms by layer, bottom first: a module imports from its own room and from lower layers only.
# (sharding.mesh is the bottom of the sharding room: Mesh and specs, which passes and ops read.)
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "exc version files progress",
        "config sharding.mesh",
        "ops",
        "lowering passes",
        "debug sharding",
        "runtime",
        "cache state",
        "partition decompositions",
        "compile_fx",
        "tune",
        "aot backend bench cli __init__",
    )
)
# Rooms that must not import some lower rooms all the same: lowering and passes meet only in
# node.meta, the graph and tpu_inductor/ops; debug watches from the side.
FORBIDDEN = {
    "lowering": {"passes"},
    "passes": {"lowering"},
    "debug": {"ops", "lowering", "passes", "sharding", "sharding.mesh"},
}
MAX_TOP_MODULES = 12
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts]
            found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""
    package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join([*kept, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if parts[1] == "sharding" and parts[2:3] == ["mesh"]:
        return "sharding.mesh"
    return parts[1]


def _layer(room: str) -> int:
    for number, layer in enumerate(LAYERS):
        if room in layer:
            return number
    raise AssertionError(f"room {room!r} is in no layer of tests/test_house.py: place it")


def test_every_import_runs_down_the_layers(graph):
    wrong = []
    for module, imported in sorted(graph.items()):
        room = _room(module)
        for target in sorted(imported):
            other = _room(target)
            if other == room:
                continue
            if _layer(other) >= _layer(room) or other in FORBIDDEN.get(room, ()):
                wrong.append(f"{module} imports {target} ({room} -> {other})")
    assert not wrong, "imports against DESIGN.md's direction:\n" + "\n".join(wrong)


def test_the_import_graph_has_no_cycles(graph):
    """Tarjan's strongly connected components: any with two or more modules is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_package_top_holds_few_modules():
    top = sorted(p.name for p in (ROOT / "tpu_inductor").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules in tpu_inductor/: {top}"


def test_no_source_file_outgrows_one_job():
    folders = ("tpu_inductor", "lowering", "passes", "tests", "tools", "examples")
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files over {MAX_LINES} lines (split them by job):\n" + "\n".join(long)


def test_the_house_test_sees_violations():
    """The checks above are live: a lowering rule importing the runtime, and a cycle, are
    found."""
    fake = {
        "tpu_inductor.lowering.ops.x": {"tpu_inductor.runtime.devices"},
        "tpu_inductor.runtime.devices": set(),
    }
    with pytest.raises(AssertionError, match="lowering -> runtime"):
        test_every_import_runs_down_the_layers(fake)
    with pytest.raises(AssertionError, match="import cycles"):
        test_the_import_graph_has_no_cycles(
            {"tpu_inductor.a": {"tpu_inductor.b"}, "tpu_inductor.b": {"tpu_inductor.a"}}
        )
