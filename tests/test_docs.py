"""The docs' references can fail too: every test they cite exists, every local file they link exists."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

DOCS = sorted(
    [REPO / "README.md", REPO / "ds_configs" / "README.md", *(REPO / "docs").rglob("*.md")]
)
CITED_TEST = re.compile(r"(?:tests/)?(test_\w+)\.py::(test_\w+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_cited_test_exists(doc):
    text = doc.read_text()
    missing = []
    for module, name in CITED_TEST.findall(text):
        source = REPO / "tests" / f"{module}.py"
        if not source.is_file() or not re.search(rf"def {name}\b", source.read_text()):
            missing.append(f"{module}.py::{name}")
    assert not missing, f"{doc.relative_to(REPO)} cites tests that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_local_link_resolves(doc):
    broken = [
        target
        for target in LINK.findall(doc.read_text())
        if "://" not in target
        and not target.startswith("mailto:")
        and not (doc.parent / target).exists()
    ]
    assert not broken, f"{doc.relative_to(REPO)} links to missing files: {broken}"
