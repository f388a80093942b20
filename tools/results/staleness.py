"""Whether the code a result measures changed since it ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tools.results.registry import REPO, Result

# ------------------------------------------------------------------- staleness


def _git(*args: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def staleness(shas: list[str], code: tuple[str, ...], repo: Path = REPO) -> str:
    """'current', or what changed in the measured code since the result's commit."""
    if not shas:
        return "no commit recorded"
    notes, changed = [], set()
    for sha in shas:
        base = sha.removesuffix("-dirty")
        if _git("cat-file", "-e", f"{base}^{{commit}}", repo=repo).returncode != 0:
            return f"commit {base[:7]} not in this history"
        if sha.endswith("-dirty"):
            notes.append(f"ran on an uncommitted tree at {base[:7]}")
        # against the working tree: later commits and uncommitted edits count; docs measure nothing
        diff = _git("diff", "--name-only", base, "--", *code, ":(exclude)*.md", repo=repo)
        changed |= set(diff.stdout.split())
    if changed:
        names = sorted(changed)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        notes.append("stale: " + ", ".join(names[:3]) + more + " changed since")
    return "; ".join(sorted(set(notes), key=notes.index)) or "current"


def stale_report(results: list[Result]) -> str:
    lines = []
    for r in results:
        state = staleness(r.shas(r.load()), r.code) if r.exists() else "not run"
        lines.append(f"{r.key:28s} {state}")
    n = sum(1 for line in lines if " stale:" in line)
    return "\n".join([*lines, f"{n} of {len(results)} results stale for this tree"])
