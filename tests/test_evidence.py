"""The result files, the tables rendered from them and the numbers the docs link (results/evidence.py).

The first test is the check on this tree; the others show that it can fail, on a stand-in tree: a
result file that does not describe itself, a table edited or left behind when its file changed, a
linked number its file does not hold; that staleness is reported, not checked; staleness itself on
a throwaway git history; and that `run` runs the command a file records.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from results import evidence

needs_git = pytest.mark.skipif(
    shutil.which("git") is None
    or subprocess.run(
        ["git", "-C", str(evidence.REPO), "rev-parse"], capture_output=True
    ).returncode,
    reason="the staleness column needs the repository's git history",
)


@needs_git
def test_this_tree_passes_the_check():
    problems = evidence.check()
    assert problems == [], (
        "\n".join(problems) + "\n(python results/evidence.py index renders the tables)"
    )


def _result(**over) -> dict:
    return {
        "title": "default recipe",
        "headline": "91.2% top-1, 5 epochs",
        "command": "python bench/default_recipe.py",
        "git_sha": "0" * 40,
        "date": "2026-11-28 10:00:00",
        "machine": "2 CPU cores",
        "final_top1": 0.9116,
        "gap_pt": -57.3,
        **over,
    }


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A stand-in repository: one result file with its report, README and the index, rendered."""
    (tmp_path / "results/bench").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "results/bench/recipe.json").write_text(json.dumps(_result()))
    (tmp_path / "results/bench/recipe.md").write_text(
        "| row | top-1 |\n|---|---|\n| a | 93.20% |\n"
    )
    (tmp_path / "results/README.md").write_text(
        f"# Results\n\n{evidence.INDEX_BEGIN}\n{evidence.INDEX_END}\n"
    )
    (tmp_path / "README.md").write_text(
        "# x\n\n<!-- evidence:readme bench/recipe.json -->\n<!-- evidence:readme end -->\n"
    )
    for name, value in {
        "REPO": tmp_path,
        "RESULTS": tmp_path / "results",
        "INDEX": tmp_path / "results/README.md",
        "README": tmp_path / "README.md",
    }.items():
        monkeypatch.setattr(evidence, name, value)
    evidence.write_tables()
    return tmp_path


def test_the_tables_are_rendered_from_the_files(tree):
    readme = (tree / "README.md").read_text()
    assert (
        "| default recipe | 91.2% top-1, 5 epochs | [recipe.json](results/bench/recipe.json) |"
        in readme
    )
    index = (tree / "results/README.md").read_text()
    assert "| default recipe | 91.2% top-1, 5 epochs | [recipe.json](bench/recipe.json) |" in index
    assert "`python bench/default_recipe.py` | 0000000 | 2026-11-28 | 2 CPU cores |" in index
    assert evidence.check() == []
    # the file changes (rerun), the tables are left behind: both named
    path = tree / "results/bench/recipe.json"
    path.write_text(json.dumps(_result(headline="90.1% top-1, 5 epochs")))
    problems = evidence.check()
    assert any("results/README.md: the index differs" in p for p in problems), problems
    assert any("README.md: the results table differs" in p for p in problems), problems
    evidence.write_tables()
    assert evidence.check() == []
    # a table edited by hand
    (tree / "README.md").write_text(readme.replace("91.2%", "91.3%"))
    assert any("README.md: the results table differs" in p for p in evidence.check())


def test_a_result_file_that_does_not_describe_itself_is_named(tree):
    (tree / "results/bench/old.json").write_text(json.dumps(_result(headline="", machine=None)))
    (problem,) = evidence.check()
    assert (
        problem
        == "results/bench/old.json: no headline, machine (write it with bench.common.write_result)"
    )
    (tree / "results/bench/old.json").write_text("{")
    assert evidence.check()[0].startswith("results/bench/old.json: not JSON")


def test_a_number_that_links_a_file_must_be_in_it(tree):
    doc = tree / "docs/page.md"

    def problems(text: str) -> list[str]:
        doc.write_text(text)
        return evidence.check()

    # printed in its report, one of its values (a share as a percentage), the headline's own
    assert (
        problems("[93.20%](../results/bench/recipe.md) [91.16%](../results/bench/recipe.json)")
        == []
    )
    assert problems("[5 epochs](../results/bench/recipe.json)") == []
    assert problems("[0.57 pt](../results/bench/recipe.json) behind") == []  # the sign dropped
    # a figure typed wrong, or one of another file
    assert problems("[93.21%](../results/bench/recipe.md)") == [
        "docs/page.md: 93.21% links results/bench/recipe.md, which does not hold it"
    ]
    assert problems("[91.17%](../results/bench/recipe.json)")
    assert problems("[0.58 pt](../results/bench/recipe.json)")
    # a setting, a count or a name in a link is no measurement
    assert problems("[batch 4,096 at LR 0.8](../results/bench/recipe.md)") == []
    assert problems("[lr0.8_90ep.json](../results/bench/recipe.json)") == []


def test_an_interval_that_links_a_report_must_be_printed_there_as_one(tree):
    doc = tree / "docs/page.md"
    (tree / "results/bench/gaps.md").write_text(
        "| change | changed - base (pt) | 95% interval |\n|---|---|---|\n"
        "| no smoothing | -0.15 | -0.53 to +0.23 (Welch) |\n"
        "| no tail | -0.23 | -0.86 to +0.41 (Welch) |\n"
    )

    def problems(text: str) -> list[str]:
        doc.write_text(text)
        return evidence.check()

    assert problems("[-0.53 to +0.23](../results/bench/gaps.md)") == []
    assert problems("[-0.53 pt to 0.23 pt](../results/bench/gaps.md)") == []  # units, a "+" dropped
    # what the change earns (base - changed): the same interval, mirrored
    assert problems("earns [-0.23 pt to +0.53 pt](../results/bench/gaps.md)") == []
    # a stale bound, and two bounds each printed in the report but in different rows' intervals
    assert problems("[-0.53 to +0.25](../results/bench/gaps.md)") == [
        "docs/page.md: -0.53 to +0.25 links results/bench/gaps.md, which does not hold that interval"
    ]
    assert problems("[-0.86 to +0.23](../results/bench/gaps.md)")
    # a JSON file holds an interval as its two values
    assert problems("[-57.3 pt to 91.16%](../results/bench/recipe.json)") == []
    assert problems("[-57.3 to +12.0](../results/bench/recipe.json)")


def test_staleness_is_reported_not_checked(tree):
    index = (tree / "results/README.md").read_text()
    row = next(line for line in index.splitlines() if line.startswith("| default recipe"))
    edited = row[: row.rindex("| ", 0, len(row) - 2)] + "| stale: x.py changed since |"
    (tree / "results/README.md").write_text(index.replace(row, edited))
    assert evidence.check() == []


def _git(repo, *args):
    out = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_staleness_names_what_changed_since_the_result(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "dstrain").mkdir(parents=True)
    (repo / "bench").mkdir()
    monkeypatch.setattr(evidence, "REPO", repo)
    _git(repo, "init", "-q")
    for k, v in {"user.name": "t", "user.email": "t@t"}.items():
        _git(repo, "config", k, v)
    (repo / "dstrain/code.py").write_text("a = 1\n")
    (repo / "bench/mine.py").write_text("b = 1\n")
    (repo / "bench/other.py").write_text("c = 1\n")
    (repo / "dstrain/notes.md").write_text("x\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    sha = _git(repo, "rev-parse", "HEAD")
    command = "python bench/mine.py --out x.json"

    assert evidence.staleness(sha, command) == "current"
    (repo / "bench/other.py").write_text("c = 2\n")  # a script the command does not run
    (repo / "dstrain/notes.md").write_text("y\n")  # docs measure nothing
    _git(repo, "commit", "-qam", "two")
    assert evidence.staleness(sha, command) == "current"
    (repo / "bench/mine.py").write_text("b = 2\n")  # uncommitted edits count
    assert evidence.staleness(sha, command) == "stale: bench/mine.py changed since"
    _git(repo, "commit", "-qam", "three")
    (repo / "dstrain/code.py").write_text("a = 2\n")  # the trainer: every result measures it
    assert evidence.staleness(sha, command) == "stale: bench/mine.py, dstrain/code.py changed since"
    (repo / "bench/mine.py").write_text("b = 1\n")  # a change made and reverted does not count
    (repo / "dstrain/code.py").write_text("a = 1\n")
    _git(repo, "commit", "-qam", "four")
    assert evidence.staleness(sha, command) == "current"
    assert evidence.staleness(sha + "-dirty", command) == f"ran on an uncommitted tree at {sha[:7]}"
    assert evidence.staleness("0" * 40, command) == "commit 0000000 not in this history"
    assert evidence.staleness(None, command) == "no commit recorded"


def test_run_runs_the_command_the_file_records(tree):
    marker = tree / "ran.txt"
    command = f"python -c \"open({str(marker)!r}, 'w').write('ran')\""
    (tree / "results/bench/recipe.json").write_text(json.dumps(_result(command=command)))
    evidence.rerun([str(tree / "results/bench/recipe.json")])
    assert marker.read_text() == "ran"
    assert f"`{command}`".replace("|", "\\|") in (tree / "results/README.md").read_text()
    (tree / "results/bench/recipe.json").write_text(json.dumps(_result(command="false")))
    with pytest.raises(SystemExit, match="its command failed"):
        evidence.rerun([str(tree / "results/bench/recipe.json")])


def test_check_names_a_figure_that_is_not_a_palette_png_and_index_re_encodes_it(tree):
    """A report copied from an older checkout writes RGBA figures: the check names each (the tree
    travels to the GPU node whole) and `index` re-encodes it as bench/common.save_png would."""
    from PIL import Image

    Image.new("RGBA", (8, 8), (255, 0, 0, 255)).save(tree / "results/bench/a.png")
    Image.new("RGB", (8, 8)).quantize(256).save(tree / "results/bench/b.png")
    (problem,) = evidence.check()
    assert (
        problem.startswith("results/bench/a.png: a RGBA figure") and "evidence.py index" in problem
    )
    evidence.write_tables()
    assert evidence.check() == []


def test_the_command_line_check_exits_1_on_a_problem(tree):
    (tree / "results/bench/old.json").write_text("{}")
    script = evidence.__file__
    proc = subprocess.run([sys.executable, script, "check"], capture_output=True, text=True)
    assert proc.returncode == 0  # the script checks its own tree, not the stand-in
    assert evidence.main(["check"]) == 1


def test_a_table_of_a_reports_rows_is_rendered_from_the_report(tree):
    """A doc's table under <!-- rows of REPORT --> shows the report's rows: edited, or left behind
    when the report changed, the check names it; `index` renders it again."""
    doc = tree / "docs/page.md"
    table = (
        "<!-- rows of ../results/bench/recipe.md -->\n| row | top-1 |\n|---|---|\n| a | 93.20% |\n"
    )
    doc.write_text(f"# Page\n\n{table}\nAfter.\n")
    assert evidence.check() == []
    doc.write_text(doc.read_text().replace("93.20%", "93.30%"))
    (problem,) = evidence.check()
    assert (
        problem
        == "docs/page.md: a table differs from its report; run python results/evidence.py index"
    )
    evidence.write_tables()
    assert "| a | 93.20% |" in doc.read_text() and evidence.check() == []
    report = tree / "results/bench/recipe.md"
    report.write_text(report.read_text().replace("93.20%", "92.10%"))  # the report rerun
    assert evidence.check() and (evidence.write_tables() or "| a | 92.10% |" in doc.read_text())
