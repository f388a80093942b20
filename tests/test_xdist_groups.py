"""tests/conftest.py's guard on pytest-xdist's groups: a grouped test whose node id lost its group
(pytest 9.2 with pytest-xdist 3.8) fails saying so, where the groups would otherwise be ignored."""

from types import SimpleNamespace

import pytest

from tests import conftest


class Item:
    """What the guard reads of a collected test: its node id, its xdist_group mark, its stash."""

    def __init__(self, nodeid: str, group: str | None):
        self.nodeid, self.stash = nodeid, pytest.Stash()
        self._mark = pytest.mark.xdist_group(group).mark if group else None

    def get_closest_marker(self, name: str):
        return self._mark if name == "xdist_group" else None


def session(loadgroup: bool, *items: Item) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(option=SimpleNamespace(loadgroup=loadgroup)), items=list(items)
    )


def test_a_grouped_test_without_its_group_in_its_node_id_fails_naming_the_cause():
    kept = Item("tests/t.py::test_a@hosts", "hosts")
    lost = Item("tests/t.py::test_b", "hosts")
    plain = Item("tests/t.py::test_c", None)
    conftest.pytest_collection_finish(session(True, kept, lost, plain))
    for item in (kept, plain):
        conftest.pytest_runtest_setup(item)  # runs
    with pytest.raises(pytest.fail.Exception, match="ignored this test's xdist_group mark"):
        conftest.pytest_runtest_setup(lost)


def test_without_loadgroup_no_test_is_failed_for_its_group():
    lost = Item("tests/t.py::test_b", "hosts")  # -n 0, or pytest without xdist
    conftest.pytest_collection_finish(session(False, lost))
    conftest.pytest_runtest_setup(lost)
