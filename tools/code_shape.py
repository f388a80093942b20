"""The shape of the dstrain package, measured from its source: what issue 15 asked to watch.

    .venv/bin/python tools/code_shape.py                        # -> results/bench/code_shape.json
    .venv/bin/python tools/code_shape.py --package /old/dstrain --out /tmp/old.json

Per package: files and lines, the longest functions (lines, decorators and docstring included), the
widest signatures (parameters, ``self``/``cls`` not counted), import cycles (top-level and lazy
imports: import_graph, find_cycle, which tests/test_layers.py checks dstrain with), how many
modules each module imports, lines past 100 columns,
and the floor plan (floor 0 imports nothing of the package; each module sits one floor above the
highest module it imports).
"""

from __future__ import annotations

import argparse
import ast
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PACKAGE = REPO / "dstrain"


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
    """Module -> the package's modules it imports (tests/test_layers.py checks dstrain's with it;
    measure() any package's)."""
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


def functions(path: Path):
    """(qualified name, lines, parameters) for every function and method in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    child.qualname = f"{node.name}.{child.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs] + [
                p for p in (a.vararg, a.kwarg) if p
            ]
            params = [p for p in params if p.arg not in ("self", "cls")]
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield getattr(node, "qualname", node.name), node.end_lineno - start + 1, len(params)


def measure(package: Path) -> dict:
    paths = sorted(package.rglob("*.py"))
    rel = {p: str(p.relative_to(package.parent)) for p in paths}
    funcs = [(f"{rel[p]}:{name}", n, k) for p in paths for name, n, k in functions(p)]
    graph = import_graph(package)
    cycles, remaining = [], {k: set(v) for k, v in graph.items()}
    while cycle := find_cycle(
        remaining
    ):  # every distinct cycle: drop one edge of each and look again
        cycles.append(" -> ".join(cycle))
        remaining[cycle[0]].discard(cycle[1])
    floor = floors(remaining)
    lines = {rel[p]: len(p.read_text().splitlines()) for p in paths}
    over = {rel[p]: sum(len(line) > 100 for line in p.read_text().splitlines()) for p in paths}
    by_length = sorted(funcs, key=lambda t: -t[1])[:5]
    by_width = sorted(funcs, key=lambda t: -t[2])[:5]
    return {
        "package": str(package),
        "files": len(paths),
        "lines": sum(lines.values()),
        "lines_per_file": dict(sorted(lines.items(), key=lambda kv: -kv[1])),
        "longest_functions": [{"function": f, "lines": n} for f, n, _ in by_length],
        "widest_signatures": [{"function": f, "parameters": k} for f, _, k in by_width],
        "import_cycles": cycles,
        "most_imports": {
            m: len(v) for m, v in sorted(graph.items(), key=lambda kv: -len(kv[1]))[:5]
        },
        "lines_over_100_columns": {f: n for f, n in over.items() if n},
        # the floor plan: a module's floor is 0 when it imports nothing of the package, else one
        # above the highest module it imports (cycles were dropped above)
        "floors": 1 + max(floor.values(), default=-1),
        "floor_of": dict(sorted(floor.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor in an acyclic import graph."""
    out: dict[str, int] = {}

    def floor(m: str) -> int:
        if m not in out:
            out[m] = 0  # a cycle left in the graph ends here instead of recursing forever
            out[m] = 1 + max((floor(d) for d in graph.get(m, ()) if d in graph), default=-1)
        return out[m]

    for m in graph:
        floor(m)
    return out


def headline(result: dict) -> str:
    widest = result["widest_signatures"][0]["parameters"] if result["widest_signatures"] else 0
    return (
        f"{result['files']} files, {result['lines']:,} lines, "
        f"{len(result['import_cycles'])} import cycles, widest signature {widest} parameters, "
        f"{result['floors']} floors"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package", default=str(REPO / "dstrain"), help="a dstrain package folder")
    p.add_argument("--out", default=str(REPO / "results/bench/code_shape.json"))
    args = p.parse_args()
    from bench.common import write_result
    from dstrain.core.provenance import record as provenance_record

    result = {
        **provenance_record(f"python tools/code_shape.py {shlex.join(sys.argv[1:])}"),
        **measure(Path(args.package)),
    }
    package = Path(args.package).resolve()
    what = "the package" if package == PACKAGE.resolve() else str(package)
    title = f"Code shape of {what} (files, lines, cycles, signatures)"
    write_result(Path(args.out), result, title=title, headline=headline(result))
    longest, widest = result["longest_functions"][0], result["widest_signatures"][0]
    print(
        f"{result['files']} files, {result['lines']} lines; longest function {longest['function']} "
        f"({longest['lines']} lines); widest signature {widest['function']} ({widest['parameters']} parameters); "
        f"{len(result['import_cycles'])} import cycles; {result['floors']} floors -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
