"""Epochs to target with each batch's LR tuned, as MLPerf's reference convergence points are (issue 52).

    .venv/bin/python bench/epochs_tuned.py \\
        --reports docs/results/tuning/epochs_to_target_90ep_holdout6000_lr5.json \\
                  docs/results/tuning/epochs_to_target_90ep_holdout6000_lr10.json ... \\
        --target 0.924 --extra-targets 0.9 --name epochs_to_target_tuned_90ep_holdout6000

Each report is one ``bench/accuracy_study.py --grid target --holdout N --extra optim.base_lr=L`` run
of the chosen row at every batch (one LR per report); the LR a run trained with is read from its
recorded command. Per target level and batch, the LR whose runs reach the level in the fewest
epochs (their mean over seeds; a seed that never reaches it counts as never) is that batch's, as
MLPerf tunes each batch's hyperparameters for its epochs to converge; its epochs, over batch 128's
at its own best LR, is the batch's ratio. The goal (issue 52): batch 8,192's ratio at or below
MLPerf's from its smallest to its largest batch (2.45x, ruleset 4.0.0). Writes <name>.json (every
LR's epochs per batch and level, the choice, the ratios, MLPerf's points) and <name>.md under
--out (default docs/results/tuning).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.accuracy_study import (  # noqa: E402
    FASHION_MNIST_TRAIN,
    _batch,
    epochs_to,
    mlperf_rcps,
    rcp_table,
)
from bench.common import provenance  # noqa: E402


def lr_of(record: dict) -> float:
    """The peak LR a run trained with: the last optim.base_lr= of its command (the row's own, or
    --extra's after it)."""
    given = [w for w in shlex.split(record["command"]) if w.startswith("optim.base_lr=")]
    if not given:
        raise ValueError(
            f"{record['row']} seed {record['seed']}: its command sets no optim.base_lr"
        )
    return float(given[-1].split("=", 1)[1])


def mean_epochs(runs: list[dict], level: float) -> float | None:
    """The mean epochs to ``level`` over the runs, or None when a run never reaches it."""
    epochs = [epochs_to(r["top1_per_epoch"], level) for r in runs]
    return None if not epochs or None in epochs else statistics.mean(epochs)


def choose(records: list[dict], levels: list[float], train_images: int) -> list[dict]:
    """Per level and batch: every LR's mean epochs, the LR with the fewest, and the ratio of its
    epochs to batch 128's (or the smallest batch's) at that batch's own best LR."""
    by: dict[int, dict[float, list[dict]]] = {}
    for r in records:
        by.setdefault(_batch(r), {}).setdefault(lr_of(r), []).append(r)
    out = []
    for level in levels:
        rows = []
        for batch in sorted(by):
            tried = {lr: mean_epochs(runs, level) for lr, runs in sorted(by[batch].items())}
            reaching = {lr: e for lr, e in tried.items() if e is not None}
            best = min(reaching, key=lambda lr: (reaching[lr], lr)) if reaching else None
            rows.append(
                {
                    "level": level,
                    "batch": batch,
                    "share": batch / train_images,
                    "lrs": [{"lr": lr, "epochs": e} for lr, e in tried.items()],
                    "lr": best,
                    "epochs": reaching.get(best),
                    "seeds": len(by[batch][best]) if best is not None else 0,
                }
            )
        base = rows[0]["epochs"] if rows else None
        for row in rows:
            row["ratio"] = row["epochs"] / base if row["epochs"] and base else None
        out += rows
    return out


def goal(rows: list[dict], level: float, rcps: list[dict] | None) -> str:
    """Whether the largest batch's ratio is at or below MLPerf's from its smallest to its largest."""
    mine = [r for r in rows if r["level"] == level]
    head = (
        f"Goal: batch {mine[-1]['batch']:,}'s epochs to {100 * level:.2f}% at most MLPerf's growth"
    )
    if not rcps:
        return f"{head}: no MLPerf points to compare (mlperf-logging is not installed)."
    mlperf = rcps[-1]["ratio"]
    if mine[0]["epochs"] is None:
        return f"{head} ({mlperf:.2f}x): batch {mine[0]['batch']:,} never reached it."
    if mine[-1]["ratio"] is None:
        return f"{head} ({mlperf:.2f}x): batch {mine[-1]['batch']:,} never reached it -> missed."
    verdict = "met" if mine[-1]["ratio"] <= mlperf else "missed"
    return f"{head} ({mlperf:.2f}x): {mine[-1]['ratio']:.2f}x -> {verdict}."


def table(rows: list[dict], levels: list[float]) -> list[str]:
    lines = []
    for level in levels:
        mine = [r for r in rows if r["level"] == level]
        lrs = sorted({t["lr"] for r in mine for t in r["lrs"]})
        lines += [
            f"To {100 * level:.2f}% top-1 (held-out), each batch at the LR that gets there first:",
            "",
            "| global batch | share of the training set per step | LR chosen | epochs (mean of its "
            "seeds) | vs the smallest batch | "
            + " | ".join(f"epochs at LR {lr:g}" for lr in lrs)
            + " |",
            "|---" * (5 + len(lrs)) + "|",
        ]
        for r in mine:
            tried = {t["lr"]: t["epochs"] for t in r["lrs"]}
            cells = [
                f"{r['batch']:,}",
                f"{100 * r['share']:.2f}%",
                f"{r['lr']:g}" if r["lr"] is not None else "none reaches it",
                f"{r['epochs']:.1f} ({r['seeds']})" if r["epochs"] is not None else "never",
                f"{r['ratio']:.2f}x" if r["ratio"] else "-",
                *(
                    (
                        "-"
                        if lr not in tried
                        else "never"
                        if tried[lr] is None
                        else f"{tried[lr]:.1f}"
                    )
                    for lr in lrs
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reports", nargs="+", required=True, help="target-grid reports, one per LR")
    p.add_argument("--target", type=float, required=True, help="top-1 to reach (fraction)")
    p.add_argument("--extra-targets", type=float, nargs="*", default=[])
    p.add_argument("--out", default=str(REPO / "docs/results/tuning"))
    p.add_argument("--name", default="epochs_to_target_tuned")
    args = p.parse_args(argv)
    records, holdouts = [], set()
    for report in args.reports:
        try:
            data = json.loads(Path(report).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--reports {report}: not readable as a report ({type(e).__name__}: {e})")
        if data.get("grid") != "target":
            p.error(f"--reports {report}: not a target-grid report (grid {data.get('grid')!r})")
        holdouts.add(data.get("holdout", 0))
        records += data["runs"]
    if len(holdouts) > 1:
        p.error(f"--reports: evaluated on different images (holdout {sorted(holdouts)})")
    holdout = holdouts.pop()
    levels = [args.target, *args.extra_targets]
    try:
        rows = choose(records, levels, FASHION_MNIST_TRAIN - holdout)
    except ValueError as e:
        p.error(str(e))
    rcps = mlperf_rcps()
    meta = {
        **provenance("epochs_tuned.py", argv),
        "reports": args.reports,
        "holdout": holdout,
        "levels": levels,
        "rows": rows,
        "goals": [goal(rows, level, rcps) for level in levels],
        "mlperf_rcps": rcps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    md = [
        "# Epochs to target, each batch's LR tuned (Fashion-MNIST)",
        "",
        f"`{meta['command']}` at git {str(meta['git_sha'])[:7]}, {meta['date']}; "
        f"{len(records)} runs from {len(args.reports)} report(s); top-1 on "
        + (f"{holdout} held-out training images." if holdout else "the test set."),
        "",
        *table(rows, levels),
        *[line for g in meta["goals"] for line in (g, "")],
        *rcp_table(rcps),
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(table(rows, levels) + meta["goals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
