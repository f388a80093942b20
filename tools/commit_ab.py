"""Is a changed result the code or the machine? One recipe trained at an older commit and at this tree, alternating.

    python tools/commit_ab.py --base c8827d4 [--rounds 2] [--config fashion_mnist] [key=value ...]
        -> bench/results/commit_ab_<base>.json

The older commit is checked out in a temporary git worktree and run with this tree's interpreter;
the rounds alternate it with this tree, each a fresh `python -m dstrain --config RECIPE [overrides]`
run, and compare the runs' own training time (summary.json ``wall_time_s``: the epochs' training and
evaluation, start-up excluded) and top-1. Both sides run on the same machine in one session, so the
ratio of their medians is what the code changed; what a result file moved beyond it is the machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dstrain.core.provenance import record as provenance_record  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def train(tree: Path, recipe: str, overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "dstrain", "--config", recipe, *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"failed in {tree} ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"wall_time_s": summary["wall_time_s"], "final_top1": summary["final_top1"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the older commit (any git revision)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    p.add_argument("--config", default="fashion_mnist", help="recipe, as for python -m dstrain")
    p.add_argument("--out", help="result file (default bench/results/commit_ab_<base>.json)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for both sides")
    args = p.parse_args()
    try:
        base = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    except subprocess.CalledProcessError:
        p.error(f"--base {args.base}: not a commit of this repository")
    record = provenance_record(f"python tools/commit_ab.py {shlex.join(sys.argv[1:])}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="dstrain-ab-") as tmp:
        tree = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(tree), base)
        try:
            for n in range(args.rounds):
                for side, where in (("base", tree), ("head", REPO)):
                    run = train(where, args.config, args.overrides, Path(tmp) / f"{side}{n}")
                    runs.append({"side": side, "round": n, **run})
                    print(
                        f"round {n} {side}: {run['wall_time_s']:.1f} s, top-1 {run['final_top1']}"
                    )
        finally:
            git("worktree", "remove", "--force", str(tree))
    median = {
        side: statistics.median(r["wall_time_s"] for r in runs if r["side"] == side)
        for side in ("base", "head")
    }
    record.update(
        base=base,
        recipe=args.config,
        overrides=args.overrides,
        runs=runs,
        median_wall_time_s=median,
        head_over_base=median["head"] / median["base"],
    )
    out = Path(args.out or REPO / f"bench/results/commit_ab_{base[:7]}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"this tree {median['head']:.1f} s vs {base[:7]} {median['base']:.1f} s of training: "
        f"{record['head_over_base']:.2f}x -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
