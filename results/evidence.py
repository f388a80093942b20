"""The evidence behind the docs: every result file describes itself, the tables are rendered from them.

    python results/evidence.py index          # results/README.md's index and README.md's results
                                              #   table, rendered from the result files
    python results/evidence.py check          # exit 1 when a result file lacks its description, a
                                              #   table differs from the files, or a number that links
                                              #   a result file is not in it (tests/test_evidence.py)
    python results/evidence.py stale          # which results the code they measure changed since
    python results/evidence.py run FILE ...   # run the command these result files record, again

A result file is a JSON file under results/bench/ or results/studies/ (a study's .md report, .csv
and figures sit beside its JSON under the same name). It starts with what describes it: a ``title``,
a one-line ``headline`` of what it measured, the ``command`` that wrote it (from the repository
root), the ``git_sha`` it ran at (``-dirty``: uncommitted code), the ``date`` and the ``machine``.
The script that measures writes all six (``bench.common.write_result``); nothing restates them.

A result is *current* when none of the code it measures differs between its commit and the working
tree: the trainer (dstrain/, ds_configs/) and every script its command names (``git diff --name-only
SHA``, so uncommitted edits count and a change made and reverted does not).

A number in prose that links a result file (``[0.994x](../results/bench/throughput_h100.json)``) must
be found in that file: printed in its report or headline, or one of its values at the precision shown
(a share as a percentage, a sign dropped where the prose says "behind" or "short"); an interval
("-0.53 to +0.23") must be printed in the report as one, or mirrored (what a change earns is the
report's changed - base negated), each bound alone being no proof. A number that links nothing is
prose; the tables are rendered, never typed: a doc's table under ``<!-- rows of REPORT -->`` is the
report's rows, each found by its first cell.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: bench.common (the palette PNG) is the repository's
    sys.path.insert(0, str(REPO))
RESULTS = REPO / "results"
INDEX = RESULTS / "README.md"
README = REPO / "README.md"
FIELDS = ("title", "headline", "command", "git_sha", "date", "machine")
TRAINER = ("dstrain", "ds_configs")  # what every training run measures
INDEX_BEGIN, INDEX_END = "<!-- evidence:index begin -->", "<!-- evidence:index end -->"
# README's table: the begin marker names the result files it shows, by path under results/
README_BLOCK = re.compile(
    r"<!-- evidence:readme ([^>]*?) -->\n(.*?)<!-- evidence:readme end -->", re.S
)
STALE_AS_OF = "_current? as of commit "
DOCS = ("README.md", "docs/*.md", "ds_configs/README.md", "results/**/README.md")
_VALUE = r"([-+]?\d[\d,]*(?:\.\d+)?)"
_UNITS = r"%|pt\b|x\b|img/s|s\b|ms\b|epochs?\b|MiB|GB"
# a number with its unit, as prose prints one: 93.20%, 0.57 pt, 3.75x, 5,565 img/s, 45.0 epochs
NUMBER = re.compile(rf"(?<![\w.]){_VALUE}\s?({_UNITS})?")
LINK = re.compile(r"\[([^\]]*\d[^\]]*)\]\(([^)\s]+\.(?:json|md))\)")
# an interval as prose prints one: "-0.77 to -0.04", "+0.29 points to +1.00 points", "655 to 792 s"
_BOUND = rf"{_VALUE}\s?({_UNITS}|points\b)?"
INTERVAL = re.compile(rf"(?<![\w.]){_BOUND}\s+to\s+{_BOUND}")


def result_files() -> list[Path]:
    return sorted([*RESULTS.glob("bench/*.json"), *RESULTS.glob("studies/**/*.json")])


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def rel(path: Path) -> str:
    return str(path.resolve().relative_to(REPO))


# ------------------------------------------------------------------- staleness


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def measured_code(command: str) -> list[str]:
    """The trainer and every script of ours the command names."""
    scripts = re.findall(r"(?:bench|tools|results/harness)/[\w/]+\.py|launch\.sh", command)
    return [*TRAINER, *dict.fromkeys(scripts)]


def staleness(sha: str | None, command: str) -> str:
    """'current', or what changed in the measured code since the result's commit."""
    if not sha or sha == "unknown":
        return "no commit recorded"
    base = sha.removesuffix("-dirty")
    if _git("cat-file", "-e", f"{base}^{{commit}}").returncode != 0:
        return f"commit {base[:7]} not in this history"
    diff = _git("diff", "--name-only", base, "--", *measured_code(command), ":(exclude)*.md")
    names = sorted(set(diff.stdout.split()))
    dirty = f"ran on an uncommitted tree at {base[:7]}" if sha.endswith("-dirty") else ""
    if not names:
        return dirty or "current"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    changed = "stale: " + ", ".join(names[:3]) + more + " changed since"
    return "; ".join(x for x in (dirty, changed) if x)


# ------------------------------------------------------------------- the tables


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def index_table(stale: bool = True) -> str:
    """Every result file, a row each; ``stale=False`` blanks the current? column (the check's view)."""
    head = _git("rev-parse", "--short=7", "HEAD").stdout.strip() or "?"
    lines = [
        f"{STALE_AS_OF}{head} (when this table was written); `./run.sh results --stale` tells it "
        "for the tree you have._",
        "",
        "| result | headline | file | command | commit | date | machine | current? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in result_files():
        d = load(path)
        sha = str(d.get("git_sha") or "-")
        now = staleness(d.get("git_sha"), d.get("command", "")) if stale else "-"
        lines.append(
            "| "
            + " | ".join(
                [
                    _cell(d.get("title", "?")),
                    _cell(d.get("headline", "?")),
                    f"[{path.name}]({path.relative_to(RESULTS)})",
                    f"`{_cell(d.get('command', '?'))}`",
                    sha.removesuffix("-dirty")[:7],
                    _cell(str(d.get("date", "-"))[:10]),
                    _cell(d.get("machine", "-")),
                    now,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def readme_table(names: list[str]) -> str:
    lines = ["| result | measured | file |", "|---|---|---|"]
    for name in names:
        path = RESULTS / name
        if not path.is_file():
            raise SystemExit(f"README.md's results table names {name}: no such file under results/")
        d = load(path)
        lines.append(
            f"| {_cell(d['title'])} | {_cell(d['headline'])} | [{path.name}]({rel(path)}) |"
        )
    return "\n".join(lines)


def render_index(text: str, stale: bool = True) -> str:
    if INDEX_BEGIN not in text or INDEX_END not in text:
        raise SystemExit(f"{rel(INDEX)}: markers {INDEX_BEGIN!r} ... {INDEX_END!r} not found")
    head, rest = text.split(INDEX_BEGIN, 1)
    return f"{head}{INDEX_BEGIN}\n{index_table(stale)}\n{INDEX_END}{rest.split(INDEX_END, 1)[1]}"


def render_readme(text: str) -> str:
    def table(m: re.Match) -> str:
        names = m[1].split()
        return (
            f"<!-- evidence:readme {m[1]} -->\n{readme_table(names)}\n<!-- evidence:readme end -->"
        )

    if not README_BLOCK.search(text):
        raise SystemExit(f"{rel(README)}: no <!-- evidence:readme FILES --> block")
    return README_BLOCK.sub(table, text)


def without_staleness(text: str) -> str:
    """The index with its as-of line and current? cells blanked: what a code commit changes."""
    out = []
    for line in text.splitlines():
        if line.startswith(STALE_AS_OF):
            continue
        if line.startswith("| ") and line.endswith(" |"):
            line = line[: line.rstrip(" |").rindex("|")] + "| - |"
        out.append(line)
    return "\n".join(out)


# ------------------------------------------------------------------- the check


def description_problems(path: Path) -> list[str]:
    try:
        d = load(path)
    except json.JSONDecodeError as e:
        return [f"{rel(path)}: not JSON ({e})"]
    missing = [f for f in FIELDS if not isinstance(d, dict) or not d.get(f)]
    if missing:
        return [f"{rel(path)}: no {', '.join(missing)} (write it with bench.common.write_result)"]
    return []


def _values(d) -> list[float]:
    if isinstance(d, bool):
        return []
    if isinstance(d, (int, float)):
        return [float(d)]
    if isinstance(d, dict):
        d = list(d.values())
    return [v for x in d for v in _values(x)] if isinstance(d, list) else []


def _printed(number: str) -> tuple[float, int]:
    digits = number.lstrip("+-").replace(",", "")
    return float(digits), len(digits.split(".")[1]) if "." in digits else 0


def number_in(number: str, unit: str | None, path: Path) -> bool:
    """Whether ``number`` (as printed, with its unit) is in the result file ``path``."""
    if path.suffix == ".json":
        d = load(path)
        text, values = str(d.get("headline", "")), _values(d)
    else:
        text, values = path.read_text(), []
    value, places = _printed(number)
    shown = {m[1].lstrip("+-").replace(",", "") for m in NUMBER.finditer(text)}
    if f"{value:.{places}f}" in shown:
        return True
    scales = (100.0, 1.0, 0.01) if unit in ("%", "pt") else (1.0,)  # a share, points, hundredths
    return any(round(abs(v) * s, places) == value for v in values for s in scales)


def _signed(number: str) -> str:
    """A bound as printed, for comparing two intervals: commas and a leading "+" dropped."""
    return number.replace(",", "").removeprefix("+")


def interval_in(low: str, high: str, unit: str | None, path: Path) -> bool:
    """Whether the interval ``low`` to ``high`` is in the result file ``path``: in a report, printed
    as an interval with the same bounds (each bound alone could stand in any other row), or as its
    mirror (what a change earns is the interval of base - changed, the report's changed - base,
    negated); in a JSON file, both bounds among its values."""
    if path.suffix == ".json":
        return all(number_in(b, unit, path) for b in (low, high))
    want = (_signed(low), _signed(high))
    mirror = tuple(b[1:] if b.startswith("-") else "-" + b for b in reversed(want))
    printed = {(_signed(m[1]), _signed(m[3])) for m in INTERVAL.finditer(path.read_text())}
    return want in printed or mirror in printed


def doc_problems(doc: Path) -> list[str]:
    """Each number that links a result file and is not in it; a table that is not its report's rows."""
    text = doc.read_text()
    problems = (
        []
        if render_rows(doc, text) == text
        else [f"{rel(doc)}: a table differs from its report; run python results/evidence.py index"]
    )
    for m in LINK.finditer(text):
        target = (doc.parent / m[2]).resolve()
        if RESULTS not in target.parents or not target.is_file():
            continue
        bounds = set()
        for i in INTERVAL.finditer(m[1]):
            unit = "pt" if "points" in (i[2], i[4]) else i[2] or i[4]
            bounds.update(range(*i.span()))
            if not interval_in(i[1], i[3], unit, target):
                problems.append(
                    f"{rel(doc)}: {i[0].strip()} links {rel(target)}, which does not hold that interval"
                )
        for n in NUMBER.finditer(m[1]):
            if n[2] is None or n.start() in bounds:
                continue  # a count, a setting or a name in the link's text (batch 4,096, LR 0.8)
            if not number_in(n[1], n[2], target):
                problems.append(
                    f"{rel(doc)}: {n[0].strip()} links {rel(target)}, which does not hold it"
                )
    return problems


ROWS = re.compile(r"<!-- rows of (\S+) -->\n((?:\|.*\n?)+)")


def render_rows(doc: Path, text: str) -> str:
    """A doc's table under ``<!-- rows of REPORT -->``: each row (the header too) is the report's
    line that starts with the same first cell, so the table shows what the report says, rendered."""

    def table(m: re.Match) -> str:
        report = (doc.parent / m[1]).resolve()
        if not report.is_file():
            raise SystemExit(f"{rel(doc)}: <!-- rows of {m[1]} -->: no such report")
        lines = report.read_text().splitlines()
        out = []
        for row in m[2].rstrip("\n").split("\n"):
            if re.fullmatch(r"\|[-:| ]+\|", row):
                out.append(row)  # the header's rule
                continue
            first = row.split("|")[1] if row.count("|") > 1 else row
            same = [x for x in lines if x.startswith("|") and x.split("|")[1] == first]
            out.append(same[0] if same else row + "  <!-- not in the report -->")
        return f"<!-- rows of {m[1]} -->\n" + "\n".join(out) + "\n"

    return ROWS.sub(table, text)


def docs() -> list[Path]:
    return sorted({p for pattern in DOCS for p in REPO.glob(pattern)})


def figures() -> list[Path]:
    return sorted(RESULTS.rglob("*.png"))


def figure_problems() -> list[str]:
    """A figure that is not a palette PNG (bench/common.save_png): the tree travels to a GPU node
    whole, and an RGBA figure is three times the bytes (a report from an older checkout)."""
    from PIL import Image

    out = []
    for path in figures():
        with Image.open(path) as image:
            if image.mode != "P":
                out.append(
                    f"{rel(path)}: a {image.mode} figure, not a palette PNG "
                    "(run python results/evidence.py index: it re-encodes it)"
                )
    return out


def check() -> list[str]:
    problems = [p for path in result_files() for p in description_problems(path)]
    problems += figure_problems()
    if problems:
        return problems  # the tables cannot be rendered from files that do not describe themselves
    if without_staleness(INDEX.read_text()) != without_staleness(render_index(INDEX.read_text())):
        problems.append(
            f"{rel(INDEX)}: the index differs from the result files; run python results/evidence.py index"
        )
    if README.read_text() != render_readme(README.read_text()):
        problems.append(
            f"{rel(README)}: the results table differs from its files; run python results/evidence.py index"
        )
    return problems + [p for doc in docs() for p in doc_problems(doc)]


# ------------------------------------------------------------------- the command


def write_tables() -> None:
    from bench.common import palette_png

    for path in figures():
        if palette_png(path):
            print(f"re-encoded {rel(path)} as a palette PNG")
    INDEX.write_text(render_index(INDEX.read_text()))
    README.write_text(render_readme(README.read_text()))
    print(f"wrote {rel(INDEX)}'s index and {rel(README)}'s results table")
    for doc in docs():
        text = doc.read_text()
        rendered = render_rows(doc, text)
        if rendered != text:
            doc.write_text(rendered)
            print(f"rendered the tables of {rel(doc)} from their reports")


def rerun(paths: list[str]) -> None:
    """Run the commands the named result files record, one after the other, then the tables."""
    for n, name in enumerate(paths, 1):
        command = load(Path(name))["command"]
        command = re.sub(r"(^|\s)python(?=\s)", rf"\1{sys.executable}", command)
        print(f"[evidence {n}/{len(paths)}] {name}: {command}", flush=True)
        if subprocess.run(command, shell=True, cwd=REPO).returncode != 0:
            raise SystemExit(f"{name}: its command failed: {command}")
    write_tables()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("index", help="render results/README.md's index and README.md's results table")
    sub.add_parser("check", help="exit 1 when a file, a table or a linked number disagrees")
    sub.add_parser("stale", help="which results the code changed since they ran (exit 0)")
    r = sub.add_parser("run", help="run the commands these result files record, then index")
    r.add_argument("files", nargs="+", help="result files (e.g. results/bench/polish.json)")
    args = p.parse_args(argv)
    if args.what == "index":
        write_tables()
    elif args.what == "stale":
        for path in result_files():
            d = load(path)
            print(f"{rel(path):70s} {staleness(d.get('git_sha'), d.get('command', ''))}")
    elif args.what == "run":
        rerun(args.files)
    else:
        problems = check()
        print(
            "\n".join(problems)
            or "evidence: every result describes itself and every table and number matches"
        )
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
