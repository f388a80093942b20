"""The generated tables: docs/results/README.md's index and README.md's results table."""

from __future__ import annotations

from pathlib import Path

from tools.results.registry import (
    BEGIN,
    END,
    INDEX,
    README,
    README_BEGIN,
    README_END,
    RESULTS,
    Result,
)
from tools.results.staleness import _git, staleness

# ------------------------------------------------------------------- the index and the check


STALE_AS_OF = "_current? as of commit "


def _link(r: Result, base: str) -> str:
    """A markdown link to the result's file from a doc in ``base`` ('' = the repository root)."""
    target = Path(r.file).relative_to(base) if base and r.file.startswith(base + "/") else None
    up = "../" * len(Path(base).parts)
    return f"[{Path(r.file).name}]({target or up + r.file})"


def index_table(results: list[Result], stale: bool = True) -> str:
    """The index; ``stale=False`` leaves the current? column out (what the check compares)."""
    head = _git("rev-parse", "--short=7", "HEAD").stdout.strip() or "?"
    lines = [
        f"{STALE_AS_OF}{head} (when this table was written); `./run.sh results --stale` tells "
        "it for the tree you have._",
        "",
        "| what | command | result file | commit | headline | current? |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.exists():  # registered, never run here: said, not hidden
            lines.append(
                f"| {r.what} | `{r.command}` | {r.file} | - | no result file yet | not run |"
            )
            continue
        d = r.load()
        shas = r.shas(d)
        sha_text = ", ".join(sorted({s.removesuffix("-dirty")[:7] for s in shas})) or "-"
        now = staleness(shas, r.code) if stale else "-"
        lines.append(
            f"| {r.what} | `{r.command}` | {_link(r, 'docs/results')} | {sha_text} | "
            f"{r.summary(d)} | {now} |"
        )
    return "\n".join(lines)


def readme_table(results: list[Result]) -> str:
    """README's results: one line per result marked ``readme``, linking its file."""
    lines = ["| result | measured | file |", "|---|---|---|"]
    for r in results:
        if not r.readme:
            continue
        if r.exists():
            lines.append(f"| {r.readme} | {r.summary(r.load())} | {_link(r, '')} |")
        else:  # no link to a file that is not there yet
            lines.append(f"| {r.readme} | not run yet | `{r.file}` |")
    return "\n".join(lines)


def _replace_block(text: str, begin: str, end: str, body: str, name: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{name}: markers {begin!r} ... {end!r} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_index(text: str, results: list[Result] | None = None, stale: bool = True) -> str:
    body = index_table(RESULTS if results is None else results, stale)
    return _replace_block(text, BEGIN, END, body, str(INDEX))


def render_readme(text: str, results: list[Result] | None = None) -> str:
    body = readme_table(RESULTS if results is None else results)
    return _replace_block(text, README_BEGIN, README_END, body, str(README))


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
