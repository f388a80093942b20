"""Is a changed result the code or the machine? One recipe trained at an older commit and at this tree, alternating.

    python results/harness/commit_ab.py --base c8827d4 [--head REV] [--rounds 2] [--config fashion_mnist]
        [--deepspeed-config ds_configs/X.json [--json-set optimizer.params.KEY=VALUE] ...]
        [key=value ...]  -> results/bench/commit_ab_<base>[_<head>].json

The older commit is checked out in a temporary git worktree and run with this tree's interpreter;
the rounds alternate it with this tree (or with ``--head``, a second worktree), each a fresh
`python -m dstrain --config RECIPE [overrides]` run, and compare the runs' own training time
(summary.json ``wall_time_s``: the epochs' training and evaluation, start-up excluded) and top-1.
Both sides run on the same machine in one session, so the ratio of their medians is what the code
changed; what a result file moved beyond it is the machine. Whether the two sides *trained*
alike is answered bit for bit: ``identical_training`` is true when every run's training loss of
every epoch is the same float on both sides, else ``first_difference`` names the first epoch that
differs (training here is deterministic: a difference is the code). ``--deepspeed-config`` is read
from each side's own tree (each commit's shipped JSON, as its code expects it), with ``--json-set``
applied to both copies (the study's derived JSONs: a shipped JSON with a parameter changed).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import write_result  # noqa: E402
from dstrain.core.provenance import record as provenance_record  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def patched_json(tree: Path, path: str, sets: list[str], out: Path) -> Path:
    """``tree``'s own ``path`` with each ``KEY=VALUE`` of ``sets`` applied (dotted keys into the
    JSON, the value parsed as JSON, else a string), written to ``out``."""
    source = tree / path
    if not source.is_file():
        raise SystemExit(f"--deepspeed-config {path}: not in {tree}")
    raw = json.loads(source.read_text())
    for item in sets:
        key, _, text = item.partition("=")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    out.write_text(json.dumps(raw, indent=2) + "\n")
    return out


def train(tree: Path, recipe: str, overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "dstrain", "--config", recipe, *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"failed in {tree} ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_time_s": summary["wall_time_s"],
        "final_top1": summary["final_top1"],
        "train_loss": [h["train_loss"] for h in summary["history"]],
    }


def first_difference(runs: list[dict]) -> dict | None:
    """The first epoch whose training loss is not the same float in every run (both sides, every
    round), with each side's values there; None when all runs trained alike, bit for bit."""
    losses = [r["train_loss"] for r in runs]
    for epoch in range(max(len(x) for x in losses)):
        seen = [x[epoch] if epoch < len(x) else None for x in losses]
        if len(set(seen)) > 1:
            by_side = {}
            for run, value in zip(runs, seen):
                by_side.setdefault(run["side"], []).append(value)
            return {"epoch": epoch + 1, "train_loss": by_side}
    return None


def headline(record: dict) -> str:
    """The time ratio of the two sides and whether they trained alike."""
    median, base = record["median_wall_time_s"], record["base"][:7]
    differs = record["first_difference"]
    same = (
        "identical training"
        if differs is None
        else f"training differs from epoch {differs['epoch']}"
    )
    return (
        f"training time {record['head_over_base']:.2f}x that at {base} ({median['head']:.1f} vs "
        f"{median['base']:.1f} s); {same}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the older commit (any git revision)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    p.add_argument(
        "--head", help="the newer commit (default: this tree, uncommitted changes included)"
    )
    p.add_argument("--config", default="fashion_mnist", help="recipe, as for python -m dstrain")
    p.add_argument(
        "--deepspeed-config", help="a DeepSpeed JSON, each side's own (a path in its tree)"
    )
    p.add_argument(
        "--json-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set KEY (dotted, e.g. optimizer.params.bn_bias_lr_factor) in both sides' JSON; "
        "once per key",
    )
    p.add_argument(
        "--out", help="result file (default results/bench/commit_ab_<base>[_<head>].json)"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides for both sides")
    args = p.parse_intermixed_args()  # key=value overrides before and after the options
    if args.json_set and not args.deepspeed_config:
        p.error("--json-set: name the JSON it changes with --deepspeed-config")
    for item in args.json_set:
        if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*=.*", item):
            p.error(f"--json-set {item}: not KEY=VALUE (e.g. optimizer.params.momentum=0.9)")
    revisions = {}
    for option, rev in (("--base", args.base), ("--head", args.head)):
        if rev is None:
            continue
        try:
            revisions[option] = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        except subprocess.CalledProcessError:
            p.error(f"{option} {rev}: not a commit of this repository")
    base, head = revisions["--base"], revisions.get("--head")
    record = provenance_record(f"python results/harness/commit_ab.py {shlex.join(sys.argv[1:])}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="dstrain-ab-") as tmp:
        trees = {"base": Path(tmp) / "base", "head": Path(tmp) / "head" if head else REPO}
        made = []
        try:
            for side, rev in (("base", base), ("head", head)):
                if rev:
                    git("worktree", "add", "--detach", str(trees[side]), rev)
                    made.append(trees[side])
            overrides = {side: list(args.overrides) for side in trees}
            if args.deepspeed_config:
                for side, tree in trees.items():
                    own = patched_json(
                        tree, args.deepspeed_config, args.json_set, Path(tmp) / f"{side}.json"
                    )
                    overrides[side] = ["--deepspeed_config", str(own), *overrides[side]]
            for n in range(args.rounds):
                for side, where in trees.items():
                    run = train(where, args.config, overrides[side], Path(tmp) / f"{side}{n}")
                    runs.append({"side": side, "round": n, **run})
                    print(
                        f"round {n} {side}: {run['wall_time_s']:.1f} s, top-1 {run['final_top1']}"
                    )
        finally:
            for tree in made:
                git("worktree", "remove", "--force", str(tree))
    median = {
        side: statistics.median(r["wall_time_s"] for r in runs if r["side"] == side)
        for side in ("base", "head")
    }
    differs = first_difference(runs)
    record.update(
        base=base,
        head=head or "this tree",
        recipe=args.config,
        overrides=args.overrides,
        deepspeed_config=args.deepspeed_config,
        json_set=args.json_set,
        runs=runs,
        median_wall_time_s=median,
        head_over_base=median["head"] / median["base"],
        identical_training=differs is None,
        first_difference=differs,
    )
    name = f"commit_ab_{base[:7]}" + (f"_{head[:7]}" if head else "")
    out = Path(args.out or REPO / f"results/bench/{name}.json")
    title = (
        f"The `{args.config}` recipe at {base[:7]} and at {(head or 'this tree')[:7]}, "
        "alternating on one machine"
    )
    write_result(out, record, title=title, headline=headline(record))
    same = (
        "trained alike, bit for bit"
        if differs is None
        else f"training differs from epoch {differs['epoch']}"
    )
    print(
        f"{(head or 'this tree')[:9]} {median['head']:.1f} s vs {base[:7]} {median['base']:.1f} s "
        f"of training: {record['head_over_base']:.2f}x; {same} -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
