"""The package's shape: imports run one way (no cycles, lazy imports included), down the rooms the
folders show (core < settings < techniques and data < loop < run < the entry points), and the ground
floor imports nothing of the trainer."""

from __future__ import annotations

import pytest

from tools.code_shape import PACKAGE, find_cycle, import_graph

GROUND_FLOOR = {
    "dstrain.core.errors",
    "dstrain.core.files",
    "dstrain.core.provenance",
    "dstrain.core.dist",
    "dstrain.techniques.losses",
    "dstrain.techniques.multitensor",
}
ENTRY_POINTS = {"dstrain.main", "dstrain.__main__", "dstrain.launch", "dstrain.data.check"}
# the folders of dstrain/, bottom to top (issue 53): a module imports its own room's modules and
# those of rooms below it; techniques and data stand side by side and import neither the other
ROOMS = {"core": 0, "settings": 1, "techniques": 2, "data": 2, "loop": 3, "run": 4}
ENTRY = {
    "dstrain",
    "dstrain.main",
    "dstrain.__main__",
    "dstrain.launch",
    "dstrain.polish",
    "dstrain.export",
    "dstrain.evaluate",
}


def room(module: str) -> str:
    return "entry" if module in ENTRY else module.split(".")[1]


def test_every_import_goes_down_the_rooms():
    """Each module of dstrain/ lives in a room (a folder) or is an entry point at the top, and
    every import stays in its room or goes down: the architecture is what ``ls dstrain`` shows."""
    graph = import_graph()
    level = {**ROOMS, "entry": len(ROOMS)}
    homeless = sorted(m for m in graph if room(m) not in level)
    assert homeless == [], f"modules outside the rooms {sorted(ROOMS)}: {homeless}"
    up = [
        f"{module} -> {other}"
        for module, imported in sorted(graph.items())
        for other in sorted(imported)
        if room(other) != room(module) and level[room(other)] >= level[room(module)]
    ]
    assert up == []
    assert {p.name for p in PACKAGE.glob("*.py")} == {
        f"{m.split('.')[-1] if m != 'dstrain' else '__init__'}.py" for m in ENTRY
    }  # the top of dstrain/ holds the entry points only


def test_the_room_rule_catches_an_import_up():
    graph = {"dstrain.core.a": {"dstrain.loop.b"}, "dstrain.loop.b": set()}
    level = {**ROOMS, "entry": len(ROOMS)}
    up = [
        (m, o)
        for m, i in graph.items()
        for o in i
        if room(o) != room(m) and level[room(o)] >= level[room(m)]
    ]
    assert up == [("dstrain.core.a", "dstrain.loop.b")]
    assert room("dstrain.data.check") == "data" and room("dstrain.polish") == "entry"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_lazy_imports_included():
    graph = import_graph()
    assert len(graph) > 25 and "dstrain.loop.trainer" in graph["dstrain.run.train"]
    assert find_cycle(graph) == []


@pytest.mark.parametrize("module", sorted(GROUND_FLOOR))
def test_ground_floor_imports_nothing_of_the_trainer(module):
    assert import_graph()[module] == set()


def test_nothing_imports_an_entry_point_but_the_package_runner():
    graph = import_graph()
    for module, imported in graph.items():
        allowed = {"dstrain.main"} if module == "dstrain.__main__" else {"dstrain.launch"}
        assert not (imported & ENTRY_POINTS) - allowed, module
