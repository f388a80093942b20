"""Every result README and the docs quote: its command, its file, its numbers and whether it is current.

    python tools/evidence.py index            # write the tables (docs/results/README.md, README.md's
    ./run.sh results --index                  #   results, and every doc table under an evidence
                                              #   directive) from the result files
    python tools/evidence.py check            # exit 1 when a table or a number the docs quote differs
                                              # from its result file (tests/test_evidence.py runs this)
    python tools/evidence.py stale            # which results the code changed since they ran (exit 0:
    ./run.sh results --stale                  #   a report, not a gate)
    python tools/evidence.py run [KEY ...]    # rerun every CPU result's command (all but the long studies
    ./run.sh results                          #   and the test suite), one after the other, then the index
    ./run.sh results suite_cpu suite_cpu_oldest   # the test suite's outcome (CI's two steps), its own step

A result is *current* when none of the code it measures (``Result.code``) differs between the commit
it ran at and the working tree; otherwise ``stale`` names what changed (``git diff --name-only SHA``,
so a change made and reverted does not count, and uncommitted changes do). A result run on an
uncommitted tree (SHA ``...-dirty``) says so. The index records staleness as of its writing; the check
ignores that column, so a code commit does not fail the tests until the index is rewritten.

Every number with a unit in a doc (README.md and every Markdown page but the reports results
wrote) names where it comes from, and the check recomputes it from there: a link to the result file
whose title is the value's key path (``[1.57x](bench/results/x.json "ratio.lars")``), a table whose
rows are lines of a report or whose columns are key paths (rendered from its file by ``index``: its
numbers are printed, not typed), a generated table, or, for what is not
measured, a stated reason (see "the docs' numbers" below). A number equal by chance to another value
of the file fails, and so does one typed by hand or left behind when its file was regenerated.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: python tools/evidence.py
    sys.path.insert(0, str(REPO_ROOT))

# the command's API, from the rooms of tools/results/ (tests/test_evidence.py reads it here)
from tools.results.numbers import (  # noqa: E402, F401
    check,
    doc_problems,
    docs,
    prints_as,
    registered_file,
    render_doc,
    render_number,
    resolve,
)
from tools.results.registry import INDEX, README, REPO, RESULTS, SUITE  # noqa: E402, F401
from tools.results.staleness import stale_report, staleness  # noqa: E402, F401
from tools.results.tables import (  # noqa: E402, F401
    STALE_AS_OF,
    index_table,
    readme_table,
    render_index,
    render_readme,
)


def run(keys: list[str]) -> None:
    todo = [r for r in RESULTS if (r.key in keys if keys else r.rerun)]
    unknown = set(keys) - {r.key for r in RESULTS}
    if unknown:
        raise SystemExit(f"unknown result(s) {sorted(unknown)}; known: {[r.key for r in RESULTS]}")
    venv_bin = Path(sys.executable).parent
    for n, r in enumerate(todo, 1):
        cmd = re.sub(r"(^|\s)python(?=\s)", rf"\1{sys.executable}", r.command)
        cmd = re.sub(r"(^|\s)deepspeed(?=\s)", rf"\1{venv_bin / 'deepspeed'}", cmd)
        print(f"[evidence {n}/{len(todo)}] {r.key}: {r.command}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, shell=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{r.key} failed ({proc.returncode}): {shlex.quote(r.command)}")
        print(f"[evidence] {r.key}: {time.perf_counter() - t0:.0f} s -> {r.file}", flush=True)
    write_tables()


def figures() -> list[Path]:
    """The result figures the docs show (docs/ and bench/results/)."""
    return sorted([*(REPO / "docs").rglob("*.png"), *(REPO / "bench" / "results").rglob("*.png")])


def figure_problems() -> list[str]:
    """A figure that is not a palette PNG (bench/common.save_png): the tree travels to the GPU node
    whole, and an RGBA figure is three times the bytes (a report copied from an older checkout)."""
    from PIL import Image

    out = []
    for path in figures():
        with Image.open(path) as image:
            if image.mode != "P":
                out.append(
                    f"{path.relative_to(REPO)}: a {image.mode} figure, not a palette PNG "
                    "(run python tools/evidence.py index: it re-encodes it)"
                )
    return out


def write_tables() -> None:
    from bench.common import palette_png

    for path in figures():
        if palette_png(path):
            print(f"re-encoded {path.relative_to(REPO)} as a palette PNG")
    INDEX.write_text(render_index(INDEX.read_text()))
    README.write_text(render_readme(README.read_text()))
    print(f"wrote {INDEX.relative_to(REPO)} and the results table of {README.relative_to(REPO)}")
    for page in docs(RESULTS):  # every directive's table, from its file
        text = page.read_text()
        rendered = render_doc(str(page.relative_to(REPO)), text)
        if rendered != text:
            page.write_text(rendered)
            print(f"rendered the tables of {page.relative_to(REPO)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("index", help="write docs/results/README.md's table and README's results table")
    sub.add_parser(
        "check", help="exit 1 when the tables or the docs' numbers differ from the files"
    )
    sub.add_parser("stale", help="which results the code changed since they ran (exit 0)")
    r = sub.add_parser("run", help="rerun the CPU results (all but the studies), then index")
    r.add_argument("keys", nargs="*", help=f"only these: {', '.join(x.key for x in RESULTS)}")
    args = p.parse_args()
    if args.what == "index":
        write_tables()
    elif args.what == "stale":
        print(stale_report(RESULTS))
    elif args.what == "run":
        run(args.keys)
    else:
        problems = check() + figure_problems()
        print("\n".join(problems) or "evidence: every quoted number matches its result file")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
