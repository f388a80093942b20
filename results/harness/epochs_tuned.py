"""Epochs to target with each batch's LR tuned, as MLPerf's reference convergence points are (issue 52).

    .venv/bin/python results/harness/epochs_tuned.py \\
        --reports /work/logs/reports/target_b*_90ep_holdout6000.json \\
                  results/studies/tuning/chosen_b8192_lr20_90ep_holdout6000.json:chosen_b8192 ... \\
        --seeds 0 --target 0.9254 --extra-targets 0.9 --name epochs_to_target_tuned_90ep_holdout6000

The runs: the chosen recipe at each batch, several peak LRs each, on the same held-out images:
``results/harness/accuracy_study.py --grid target --holdout N --rows target_bB --extra optim.base_lr=L``
reports (any batches and LRs each), and single rows of other grids' reports (``FILE:ROW``: batch
8,192's LR tuning, the chosen row's batch-4,096 runs). A run's batch and LR are read from its
recorded trainer command (else its recipe); every other setting must be the same in all the runs
(one recipe, only its batch and LR tuned), else the run and the setting are named. Per target level
and batch, the LR whose runs reach the level in the fewest epochs (their mean over the seeds kept,
``--seeds``; a seed that never reaches it counts as never) is that batch's, as MLPerf tunes each
batch's hyperparameters for its epochs to converge; its epochs, over batch 128's at its own best
LR, is the batch's ratio. ``--tuned KEY...`` tunes more than the LR (e.g. the warmup and decay
epochs, as MLPerf's points tune them per batch): each combination of their values is a setting of
its own, and the rest of the recipe must still match. The goal (issue 52): batch 8,192's ratio at
or below MLPerf's from its smallest to its largest batch (2.45x, ruleset 4.0.0). Writes
<name>.json (every setting's epochs per batch and level, the choice, the ratios, MLPerf's points)
and <name>.md under --out (default results/studies/tuning).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import provenance, write_result  # noqa: E402
from results.harness.study.definition import (  # noqa: E402
    batch_of,
    differing,
    resolved,
    run_name,
)
from results.harness.study.report import mlperf_rcps, rcp_table  # noqa: E402
from results.harness.study.stats import FASHION_MNIST_TRAIN, epochs_to  # noqa: E402

REFERENCE_BATCH = 128  # the ratios' reference: the smallest batch of the target grid
# what may differ between the runs compared besides the settings tuned (--tuned, default the peak
# LR): the batch, the micro batch that carries it and the seed; everything else (the resolved
# config and the DeepSpeed settings the run read) is one recipe
VARYING = {"batch.global_size", "batch.micro_per_rank", "seed"}
TUNED = ("optim.base_lr",)
SHORT = {
    "optim.base_lr": "LR",
    "optim.warmup_epochs": "warmup",
    "optim.decay_epochs": "decay",
    "polish.last_epochs_without_augmentation": "un-augmented tail",
}


def setting_of(record: dict, tuned: tuple[str, ...] = TUNED) -> tuple:
    """The values of the tuned settings a run trained with, in ``tuned``'s order."""
    values = resolved(record)
    missing = [k for k in tuned if k not in values]
    if missing:
        raise ValueError(f"--tuned {' '.join(missing)}: not a trainer setting")
    return tuple(values[k] for k in tuned)


def label(setting: tuple, tuned: tuple[str, ...] = TUNED) -> str:
    """``LR 20`` or ``LR 20, warmup 9``: a setting as the tables name it."""
    return ", ".join(f"{SHORT.get(k, k)} {v:g}" for k, v in zip(tuned, setting))


def one_definition(records: list[dict], tuned: tuple[str, ...] = TUNED) -> None:
    """The runs compared are one recipe at several batches and tuned settings: every resolved
    setting outside VARYING and ``tuned`` the same in all; else ValueError naming the first that
    differs."""
    if not records:
        return
    first = records[0]
    a = resolved(first)
    for record in records[1:]:
        b = resolved(record)
        keys = differing(a, b, VARYING | set(tuned))
        if keys:
            key = keys[0]
            raise ValueError(
                f"{run_name(record)} differs from {run_name(first)} in {key} ({b.get(key)} "
                f"against {a.get(key)}): epochs to target compare one recipe, only its batch and "
                f"{', '.join(tuned)} tuned; pick the row with --reports FILE:ROW, or tune it "
                "too (--tuned)"
            )


def mean_epochs(runs: list[dict], level: float) -> float | None:
    """The mean epochs to ``level`` over the runs, or None when a run never reaches it."""
    epochs = [epochs_to(r["top1_per_epoch"], level) for r in runs]
    return None if not epochs or None in epochs else statistics.mean(epochs)


def at_the_edge(chosen: tuple, settings: list[tuple], tuned: tuple[str, ...] = TUNED) -> list[str]:
    """Where a batch's chosen setting sits at the end of what was tried at that batch: ``LR 5 (the
    lowest tried)`` for each tuned key of two or more values tried whose chosen value is the
    smallest or the largest. A choice at the ladder's edge says the ladder may not bracket the
    fastest setting: the rung beyond it was not run."""
    out = []
    for i, key in enumerate(tuned):
        values = sorted({st[i] for st in settings})
        if len(values) < 2 or values[0] < chosen[i] < values[-1]:
            continue
        end = "lowest" if chosen[i] == values[0] else "highest"
        out.append(f"{SHORT.get(key, key)} {chosen[i]:g} (the {end} tried)")
    return out


def choose(
    records: list[dict],
    levels: list[float],
    train_images: int,
    reference: list[dict] | None = None,
    tuned: tuple[str, ...] = TUNED,
) -> list[dict]:
    """Per level and batch: every tried setting's mean epochs (``tried``), the setting with the
    fewest (``setting``; ``lr`` its peak LR), and the ratio of its epochs to the base: the fewer
    of batch 128's at its own best setting and the ``reference`` runs' mean (another recipe tuned
    for batch 128, such as the tuned SGD baseline), so no batch gains a ratio from a slow
    reference. Each row names its base (``base``, ``base_epochs``)."""
    by: dict[int, dict[tuple, list[dict]]] = {}
    for r in records:
        by.setdefault(batch_of(r), {}).setdefault(setting_of(r, tuned), []).append(r)
    out = []
    for level in levels:
        rows = []
        for batch in sorted(by):
            tried = {st: mean_epochs(runs, level) for st, runs in sorted(by[batch].items())}
            reaching = {st: e for st, e in tried.items() if e is not None}
            best = min(reaching, key=lambda st: (reaching[st], st)) if reaching else None
            chosen = dict(zip(tuned, best)) if best is not None else None
            rows.append(
                {
                    "level": level,
                    "batch": batch,
                    "share": batch / train_images,
                    "tried": [
                        {"setting": dict(zip(tuned, st)), "epochs": e} for st, e in tried.items()
                    ],
                    "setting": chosen,
                    "label": label(best, tuned) if best is not None else None,
                    "lr": chosen.get("optim.base_lr") if chosen else None,
                    "epochs": reaching.get(best),
                    "seeds": len(by[batch][best]) if best is not None else 0,
                    "edge": at_the_edge(best, list(tried), tuned) if best is not None else [],
                }
            )
        bases = []
        if rows and rows[0]["epochs"] is not None:
            bases.append((rows[0]["epochs"], f"batch {rows[0]['batch']:,} at {rows[0]['label']}"))
        reference_epochs = mean_epochs(reference, level) if reference else None
        if reference_epochs is not None:
            names = ", ".join(sorted({r["row"] for r in reference}))
            bases.append((reference_epochs, f"{names} ({len(reference)} seeds)"))
        base_epochs, base = min(bases) if bases else (None, None)
        for row in rows:
            row["ratio"] = row["epochs"] / base_epochs if row["epochs"] and base_epochs else None
            row["base"], row["base_epochs"] = base, base_epochs
        out += rows
    return out


def goal(rows: list[dict], level: float, rcps: list[dict] | None, reference: bool = False) -> str:
    """Whether the largest batch's ratio is at or below MLPerf's from its smallest to its largest.
    The base is batch 128's: the recipe's own runs at that batch, or ``reference`` runs (another
    recipe tuned for batch 128), whichever reaches the level first (:func:`choose`)."""
    mine = [r for r in rows if r["level"] == level]
    head = (
        f"Goal: batch {mine[-1]['batch']:,}'s epochs to {100 * level:.2f}% at most MLPerf's growth"
    )
    if not rcps:
        return f"{head}: no MLPerf points to compare (mlperf-logging is not installed)."
    mlperf = rcps[-1]["ratio"]
    if mine[0]["batch"] != REFERENCE_BATCH and not reference:
        return f"{head}: no batch-{REFERENCE_BATCH} runs to take the ratio from."
    if mine[-1]["base_epochs"] is None:
        return f"{head} ({mlperf:.2f}x): batch {REFERENCE_BATCH} never reached it."
    if mine[-1]["ratio"] is None:
        return f"{head} ({mlperf:.2f}x): batch {mine[-1]['batch']:,} never reached it -> missed."
    verdict = "met" if mine[-1]["ratio"] <= mlperf else "missed"
    base = f"{mine[-1]['base_epochs']:.1f} epochs of {mine[-1]['base']}"
    return f"{head} ({mlperf:.2f}x): {mine[-1]['ratio']:.2f}x of {base} -> {verdict}."


def table(
    rows: list[dict], levels: list[float], images: str = "held-out", tuned: tuple[str, ...] = TUNED
) -> list[str]:
    lines = []
    what = ", ".join(SHORT.get(k, k) for k in tuned)
    for level in levels:
        mine = [r for r in rows if r["level"] == level]
        settings = sorted({tuple(t["setting"].values()) for r in mine for t in r["tried"]})
        lines += [
            f"To {100 * level:.2f}% top-1 ({images}), each batch at the {what} that gets there "
            f"first; the ratios' base: {mine[0]['base_epochs'] or 0:.1f} epochs of "
            f"{mine[0]['base'] or 'none'}:",
            "",
            f"| global batch | share of the training set per step | {what} chosen | epochs (mean "
            "of its seeds) | vs the base | "
            + " | ".join(f"epochs at {label(st, tuned)}" for st in settings)
            + " |",
            "|---" * (5 + len(settings)) + "|",
        ]
        for r in mine:
            tried = {tuple(t["setting"].values()): t["epochs"] for t in r["tried"]}
            # one setting tuned: its value alone (the column names it); several: each named
            one = r["setting"] and len(tuned) == 1
            chosen = f"{r['setting'][tuned[0]]:g}" if one else r["label"]
            cells = [
                f"{r['batch']:,}",
                f"{100 * r['share']:.2f}%",
                chosen if chosen is not None else "none reaches it",
                f"{r['epochs']:.1f} ({r['seeds']})" if r["epochs"] is not None else "never",
                f"{r['ratio']:.2f}x" if r["ratio"] else "-",
                *(
                    (
                        "-"
                        if st not in tried
                        else "never"
                        if tried[st] is None
                        else f"{tried[st]:.1f}"
                    )
                    for st in settings
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        edges = [f"batch {r['batch']:,}'s {', '.join(r['edge'])}" for r in mine if r["edge"]]
        if edges:
            lines += [
                "",
                "Chosen at the edge of the settings tried, so a setting beyond it might get there "
                f"sooner (not run): {'; '.join(edges)}.",
            ]
        lines.append("")
    return lines


def split_spec(spec: str) -> tuple[str, str]:
    """FILE or FILE:ROW (a file whose own name has a colon is taken whole)."""
    if Path(spec).is_file() or ":" not in spec:
        return spec, ""
    report, row = spec.rsplit(":", 1)
    return report, row


def read_runs(p: argparse.ArgumentParser, option: str, report: str, row: str):
    """A report's data and its runs (of ``row`` alone where named)."""
    try:
        data = json.loads(Path(report).read_text())
    except (OSError, ValueError) as e:
        p.error(f"{option} {report}: not readable as a report ({type(e).__name__}: {e})")
    runs = [r for r in data.get("runs", []) if not row or r["row"] == row]
    if row and not runs:
        p.error(f"{option} {report}:{row}: no run of row {row!r} in {report}")
    return data, runs


def headline(meta: dict) -> str:
    """Per level, each batch's epochs at its best setting and its ratio to the base's."""
    parts = []
    for level in meta["levels"]:
        rows = [r for r in meta["rows"] if r["level"] == level]
        got = [
            f"{r['batch']:,} "
            + (f"{r['epochs']:.1f} ({r['ratio']:.2f}x)" if r["ratio"] else "never")
            for r in rows
        ]
        base = rows[0] if rows else {"base_epochs": 0, "base": "-"}
        parts.append(
            f"to {100 * level:.2f}%: {', '.join(got)} of {base['base_epochs'] or 0:.1f} epochs of "
            f"{base['base']}"
        )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--reports",
        nargs="+",
        required=True,
        help="reports of results/harness/accuracy_study.py (a target grid's, or FILE:ROW for one row of "
        "another grid's), any LRs each",
    )
    p.add_argument("--target", type=float, required=True, help="top-1 to reach (fraction)")
    p.add_argument("--extra-targets", type=float, nargs="*", default=[])
    p.add_argument(
        "--reference",
        nargs="+",
        default=[],
        metavar="FILE:ROW",
        help="batch-128 runs of another recipe tuned for that batch (e.g. the tuned SGD baseline "
        "on the same images): the ratios' base where they reach a level first",
    )
    p.add_argument(
        "--tuned",
        nargs="+",
        default=list(TUNED),
        metavar="KEY",
        help="the trainer settings tuned per batch besides the batch itself (default: "
        "optim.base_lr; e.g. optim.base_lr optim.warmup_epochs optim.decay_epochs)",
    )
    p.add_argument(
        "--seeds", type=int, nargs="+", help="only these seeds' runs (default: every seed)"
    )
    p.add_argument("--out", default=str(REPO / "results/studies/tuning"))
    p.add_argument("--name", default="epochs_to_target_tuned")
    args = p.parse_args(argv)
    records, holdouts = [], set()
    for spec in args.reports:
        report, row = split_spec(spec)
        data, runs = read_runs(p, "--reports", report, row)
        if not row and data.get("grid") != "target":
            p.error(
                f"--reports {report}: a {data.get('grid')!r} grid's report; name the row to "
                f"take from it: {report}:ROW"
            )
        holdouts.add(data.get("holdout", 0))
        records += [r for r in runs if args.seeds is None or r["seed"] in args.seeds]
    reference = []
    for spec in args.reference:
        report, row = split_spec(spec)
        if not row:
            p.error(f"--reference {spec}: name the row: {spec}:ROW")
        data, runs = read_runs(p, "--reference", report, row)
        holdouts.add(data.get("holdout", 0))
        reference += [r for r in runs if args.seeds is None or r["seed"] in args.seeds]
    try:
        if any(batch_of(r) != REFERENCE_BATCH for r in reference):
            p.error(f"--reference: runs at batch {REFERENCE_BATCH} only")
        # a reference on a schedule of another length reaches a level at another point of it:
        # its epochs are only a fair base where the runs' own length is tuned too
        lengths = {resolved(r)["epochs"] for r in records}
        other = [r for r in reference if resolved(r)["epochs"] not in lengths]
        if other and "epochs" not in args.tuned:
            p.error(
                f"--reference: {other[0]['row']} seed {other[0]['seed']} trained "
                f"{resolved(other[0])['epochs']} epochs, the runs {sorted(lengths)}: a base on "
                "another schedule length flatters or penalises every ratio (tune the length too: "
                "--tuned ... epochs)"
            )
    except ValueError as e:
        p.error(str(e))
    if len(holdouts) > 1:
        p.error(f"--reports: evaluated on different images (holdout {sorted(holdouts)})")
    holdout = holdouts.pop()
    levels = [args.target, *args.extra_targets]
    images = f"{holdout} held-out images" if holdout else "the test set"
    try:
        tuned = tuple(args.tuned)
        one_definition(records, tuned)
        rows = choose(records, levels, FASHION_MNIST_TRAIN - holdout, reference, tuned)
    except ValueError as e:
        p.error(str(e))
    rcps = mlperf_rcps()
    meta = {
        **provenance("results/harness/epochs_tuned.py", argv),
        "reports": args.reports,
        "reference": args.reference,
        "tuned": args.tuned,
        "holdout": holdout,
        "levels": levels,
        "rows": rows,
        "goals": [goal(rows, level, rcps, bool(reference)) for level in levels],
        "mlperf_rcps": rcps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"Epochs to target, each batch's {' and '.join(tuned)} tuned, top-1 on {images}"
    write_result(out / f"{args.name}.json", meta, title=title, headline=headline(meta))
    md = [
        "# Epochs to target, each batch's LR tuned (Fashion-MNIST)",
        "",
        f"`{meta['command']}` at git {str(meta['git_sha'])[:7]}, {meta['date']}; "
        f"{len(records)} runs from {len(args.reports)} report(s); top-1 on "
        + (f"{holdout} held-out training images." if holdout else "the test set."),
        "",
        *table(rows, levels, images, tuned),
        *[line for g in meta["goals"] for line in (g, "")],
        *rcp_table(rcps),
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(table(rows, levels, images, tuned) + meta["goals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
