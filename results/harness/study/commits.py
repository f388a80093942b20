"""What code the runs of a report ran (issue 52, item 5): the commits, those that changed dstrain/
between them, runs of an uncommitted tree; a comparison across such commits is refused unless each is
named (``--across-commits``).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def code_between(shas: list[str]) -> dict:
    """What separates the code the runs of a report ran: their commits (``-dirty`` stripped, oldest
    first), the commits that changed ``dstrain/`` between the oldest and the newest, and how many
    runs ran a tree with uncommitted changes. ``unknown``: SHAs git does not know here (a tree
    without .git, a run recorded elsewhere): nothing can be said of what changed between them."""
    import subprocess

    bases = sorted({s.removesuffix("-dirty") for s in shas if s and s != "None"})
    dirty = sum(1 for s in shas if s and s.endswith("-dirty"))
    git = ["git", "-C", str(REPO)]

    def run(*args: str) -> str | None:
        proc = subprocess.run([*git, *args], capture_output=True, text=True, timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else None

    dated, unknown = [], []
    for sha in bases:
        when = run("show", "-s", "--format=%ct", f"{sha}^{{commit}}")
        (dated if when else unknown).append((int(when or 0), sha))
    dated.sort()
    changed: list[str] = []
    if len(dated) > 1:
        log = run("log", "--format=%h %s", f"{dated[0][1]}..{dated[-1][1]}", "--", "dstrain/")
        # oldest first, each commit with the start of its subject
        changed = [c if len(c) <= 70 else c[:67] + "..." for c in (log or "").splitlines()[::-1]]
    return {
        "commits": [sha for _, sha in dated] + [sha for _, sha in unknown],
        "unknown": [sha for _, sha in unknown],
        "dstrain_changes": changed,
        "dirty_runs": dirty,
    }


def mixed_code(code: dict) -> bool:
    """Whether the runs compared may have run different trainer code."""
    return bool(code["dstrain_changes"] or code["unknown"] and len(code["commits"]) > 1)


def refuse_mixed_code(code: dict, named: list[str], prog: str = "accuracy_study") -> bool:
    """Say so and return True when the runs ran different trainer code and not every commit was
    named with --across-commits (issue 52: a comparison across such commits is asked for by name)."""
    unnamed = [sha for sha in code["commits"] if not any(sha.startswith(n) for n in named)]
    if not (mixed_code(code) and unnamed):
        return False
    print(
        f"{prog}: error: these runs were made at different code: "
        + code_lines(code)[0]
        + " Compare them anyway by naming the commits: --across-commits "
        + " ".join(sha[:7] for sha in code["commits"])
        + " (or train the rows again at one commit)",
        file=sys.stderr,
    )
    return True


def code_lines(code: dict) -> list[str]:
    """The report's word on the code its runs ran (issue 52: a table across commits says so)."""
    if len(code["commits"]) <= 1 and not code["dirty_runs"]:
        return []
    short = ", ".join(sha[:7] for sha in code["commits"])
    lines = [f"Runs made at {len(code['commits'])} commit(s): {short}."]
    if code["dstrain_changes"]:
        lines[0] += (
            f" dstrain/ changed between them in {len(code['dstrain_changes'])} commit(s): "
            + "; ".join(code["dstrain_changes"][:12])
            + ("; ..." if len(code["dstrain_changes"]) > 12 else "")
            + "."
        )
    if code["unknown"]:
        lines[0] += f" Not in this checkout's history: {', '.join(s[:7] for s in code['unknown'])}."
    if code["dirty_runs"]:
        lines[0] += (
            f" {code['dirty_runs']} run(s) ran a tree with uncommitted changes (their run "
            "directories keep the diff: code-N.diff)."
        )
    return lines
