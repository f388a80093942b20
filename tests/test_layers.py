"""The package's shape: imports run one way (no cycles, lazy imports included) and the ground floor imports
nothing of the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dstrain"
GROUND_FLOOR = {
    "dstrain.errors",
    "dstrain.files",
    "dstrain.provenance",
    "dstrain.dist",
    "dstrain.losses",
    "dstrain.multitensor",
}
ENTRY_POINTS = {"dstrain.main", "dstrain.__main__", "dstrain.launch", "dstrain.data.check"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module of ``modules`` that ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (tools/code_shape.py measures any package with it)."""
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in paths}
    graph = {}
    for path in paths:
        name = module_name(path, package)
        graph[name] = imports_of(path, modules) - {name, package.name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path [a, b, ..., a], or []."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in colour and (cycle := visit(nxt)):
                return cycle
        colour[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in colour and (cycle := visit(node)):
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_lazy_imports_included():
    graph = import_graph()
    assert len(graph) > 25 and "dstrain.trainer" in graph["dstrain.train"]
    assert find_cycle(graph) == []


@pytest.mark.parametrize("module", sorted(GROUND_FLOOR))
def test_ground_floor_imports_nothing_of_the_trainer(module):
    assert import_graph()[module] == set()


def test_nothing_imports_an_entry_point_but_the_package_runner():
    graph = import_graph()
    for module, imported in graph.items():
        allowed = {"dstrain.main"} if module == "dstrain.__main__" else {"dstrain.launch"}
        assert not (imported & ENTRY_POINTS) - allowed, module
