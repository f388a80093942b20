"""The results index, README's results table and the docs' numbers against the result files
(tools/evidence.py).

The first test is the check itself on this tree; the others show it can fail: a quoted number
edited, a number typed with no file behind it, a number with a unit changed in a passage that cites
a file, an unregistered result file, a result file that changed under its table rows; that the
staleness column is reported and not checked; and staleness itself on a throwaway git history.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest

from tools import evidence

needs_git = pytest.mark.skipif(
    shutil.which("git") is None
    or subprocess.run(
        ["git", "-C", str(evidence.REPO), "rev-parse"], capture_output=True
    ).returncode,
    reason="the staleness column needs the repository's git history",
)


@needs_git
def test_index_and_readme_numbers_match_the_result_files():
    problems = evidence.check()
    assert not problems, (
        "\n".join(problems) + "\n(python tools/evidence.py index rewrites the table)"
    )


def _texts():
    pages = [evidence.README, evidence.INDEX, *sorted((evidence.REPO / "docs").glob("*.md"))]
    return {str(p.relative_to(evidence.REPO)): p.read_text() for p in pages}


@needs_git
def test_an_edited_quote_fails_naming_the_result():
    d = evidence.RESULTS[0].load()  # the default recipe: docs/usage.md's recipes table quotes it
    quoted = f"{100 * d['final_top1']:.1f}%"
    texts = _texts()
    assert quoted in texts["docs/usage.md"]
    texts["docs/usage.md"] = texts["docs/usage.md"].replace(
        quoted, f"{100 * d['final_top1'] + 1:.1f}%"
    )
    problems = evidence.check(texts)
    assert any("default_recipe" in p and "not found" in p for p in problems), problems


@needs_git
def test_a_typed_number_with_no_file_behind_it_fails():
    texts = _texts()
    texts["README.md"] += "\nThe recipe also reaches 93.75% with a trick, 1.40x faster.\n"
    problems = evidence.check(texts)
    assert sum("quoted from no result file" in p for p in problems) == 2, problems
    assert any("93.75%" in p for p in problems) and any("1.40x" in p for p in problems)


@needs_git
def test_a_number_with_a_unit_in_a_citing_passage_must_be_in_the_cited_file():
    """The issue's example: `166 img/s` (a bare loop in a throughput file) typed as 966 in a doc."""
    texts = _texts()
    doc = "docs/results/README.md"
    assert "166 img/s" in texts[doc]
    assert evidence.check(texts) == []
    texts[doc] = texts[doc].replace("166 img/s", "966 img/s")
    problems = evidence.check(texts)
    assert len(problems) == 1 and "966 img/s is in none of the files" in problems[0], problems
    # in any docs/ page, with any unit: a passage linking a file cites it
    texts = _texts()
    texts["docs/gpu.md"] += (
        "\nA rerun ([result](../bench/results/optimizer_step_cpu_layouts.json)) took 146 ms, "
        "then 151 ms, 3.2 s in all.\n"
    )
    problems = evidence.check(texts)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "151 ms is in none of the files this passage links "
        "(bench/results/optimizer_step_cpu_layouts.json)",
        "3.2 s is in none of the files this passage links "
        "(bench/results/optimizer_step_cpu_layouts.json)",
    ], problems


@needs_git
def test_every_result_file_is_registered_and_every_linked_one_too():
    texts = _texts()
    texts["docs/data.md"] += "\nSee [old](../bench/results/not_a_result.json): 2.5x.\n"
    problems = evidence.check(texts, results=evidence.RESULTS[1:])
    assert "bench/results/default_recipe.json: a result file no Result" in "\n".join(problems)
    assert any("links bench/results/not_a_result.json, which no Result" in p for p in problems), (
        problems
    )


@needs_git
def test_staleness_is_reported_not_checked():
    """A code commit changes the current? column; the check ignores it, `stale` reports it."""
    texts = _texts()
    doc = "docs/results/README.md"
    assert evidence.STALE_AS_OF in texts[doc]
    rows = [line for line in texts[doc].splitlines() if line.startswith("| ") and "`" in line]
    texts[doc] = texts[doc].replace(rows[0], rows[0][: rows[0].rindex("| ")] + "| stale: x.py |")
    assert evidence.check(texts) == []
    report = evidence.stale_report(evidence.RESULTS)
    assert report.splitlines()[0].startswith(evidence.RESULTS[0].key)
    assert report.endswith(f"of {len(evidence.RESULTS)} results stale for this tree")
    # the README's generated table is compared exactly (it holds no staleness)
    texts = _texts()
    texts["README.md"] = texts["README.md"].replace("| 91.2% top-1", "| 91.3% top-1", 1)
    assert any("README.md: the results table differs" in p for p in evidence.check(texts))


@needs_git
def test_a_changed_result_file_makes_the_index_differ():
    first = evidence.RESULTS[0]
    d = first.load()
    d["final_top1"] -= 0.05  # the file as if the recipe had been rerun and lost 5 points
    changed = dataclasses.replace(first)
    object.__setattr__(changed, "load", lambda: d)  # this row reads the changed file
    table = evidence.index_table([changed])
    assert f"{100 * d['final_top1']:.1f}% top-1" in table
    problems = evidence.check(results=[changed, *evidence.RESULTS[1:]])
    assert any("table differs" in p for p in problems), problems
    assert any("README.md: the results table differs" in p for p in problems), problems
    assert any("default_recipe" in p and "not found" in p for p in problems), problems


@needs_git
def test_a_result_never_run_is_listed_as_such_and_its_number_is_unchecked(tmp_path):
    first = evidence.RESULTS[0]
    missing = dataclasses.replace(first, file=str(tmp_path / "never_written.json"))
    table = evidence.index_table([missing])
    assert "no result file yet | not run |" in table and "top-1" not in table
    assert "| not run yet |" in evidence.readme_table([missing])
    results = [missing, *evidence.RESULTS[1:]]
    texts = _texts()
    texts["docs/results/README.md"] = evidence.render_index(
        texts["docs/results/README.md"], results
    )
    texts["README.md"] = evidence.render_readme(texts["README.md"], results)
    problems = evidence.check(texts, results=results)
    # the docs still link default_recipe.json: with nothing registered for it, that is flagged
    assert any("links bench/results/default_recipe.json, which no Result" in p for p in problems)


def _git(repo, *args):
    out = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_staleness_names_what_changed_since_the_result(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for k, v in {"user.name": "t", "user.email": "t@t"}.items():
        _git(repo, "config", k, v)
    (repo / "code.py").write_text("a = 1\n")
    (repo / "other.py").write_text("b = 1\n")
    (repo / "notes.md").write_text("x\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    sha = _git(repo, "rev-parse", "HEAD")

    def stale(shas, code=("code.py", "notes.md")):
        return evidence.staleness(shas, code, repo=repo)

    assert stale([sha]) == "current"
    (repo / "other.py").write_text("b = 2\n")  # not measured
    (repo / "notes.md").write_text("y\n")  # docs measure nothing
    _git(repo, "commit", "-qam", "two")
    assert stale([sha]) == "current"
    (repo / "code.py").write_text("a = 2\n")  # uncommitted edits count
    assert stale([sha]) == "stale: code.py changed since"
    _git(repo, "commit", "-qam", "three")
    assert stale([sha]) == "stale: code.py changed since"
    (repo / "code.py").write_text("a = 1\n")  # a change made and reverted does not
    _git(repo, "commit", "-qam", "four")
    assert stale([sha]) == "current"
    assert stale([sha + "-dirty"]) == f"ran on an uncommitted tree at {sha[:7]}"
    # a glob names scripts, not the result files beside them (evidence.SUITE: "bench/*.py")
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "results" / "r.json").write_text("{}\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "five")
    assert stale([sha], code=("bench/*.py",)) == "current"
    (repo / "bench" / "suite.py").write_text("c = 1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "six")
    assert stale([sha], code=("bench/*.py",)) == "stale: bench/suite.py changed since"
    assert stale(["0" * 40]) == "commit 0000000 not in this history"
    assert stale([]) == "no commit recorded"


@needs_git
def test_a_table_cites_what_the_paragraph_introducing_it_links():
    """docs/large-batch.md's optimizer table: its rows link nothing; the paragraph above it does."""
    texts = _texts()
    doc = "docs/large-batch.md"
    row = "| **dstrain LARS** | 49.3 ms | 1.57x |"
    assert row in texts[doc]
    texts[doc] = texts[doc].replace(row, "| **dstrain LARS** | 39.3 ms | 1.47x |")
    problems = evidence.check(texts)
    assert [p.split(": ", 1)[1].split(" is ")[0] for p in problems] == ["39.3 ms", "1.47x"], (
        problems
    )
