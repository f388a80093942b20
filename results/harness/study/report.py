"""The accuracy study's report: its tables (rows, epochs to target, MLPerf's reference convergence
points), the goal lines, the plots, and the files a report is written as (.json, .csv, .md, .png).
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from bench.common import mean_pm, save_png, write_result
from results.harness.study.commits import code_lines
from results.harness.study.rows import DERIVED, EMA_DERIVED
from results.harness.study.stats import (
    FASHION_MNIST_TRAIN,
    IMAGENET_TRAIN,
    epochs_to,
    gaps,
    largest_dip,
    mean_sd,
    reach_gaps,
    reached,
    steps_to,
    worst_seed_choice,
)


def table(records: list[dict], rows: list[str], reference: str = "baseline") -> list[str]:
    """Mean ± sample sd per row, its worst seed and largest dip, the distance to the reference
    row's mean final top-1 and that gap's 95% interval (Welch)."""
    ref = [100 * r["final_top1"] for r in records if r["row"] == reference]
    intervals = gaps(records, rows, reference)
    lines = [
        "| row | final top-1 % (mean ± sample sd) | worst seed % | largest dip (pt) | "
        "vs baseline (pt) | train top-1 % | best top-1 % | epochs | steps | wall s | GPU-time s | "
        "s to 90% | s to 92% | seeds | gap's 95% interval (pt, Welch) | epochs to 90% | "
        "steps to 90% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rs = [r for r in records if r["row"] == row]
        if not rs:
            continue
        f, fs = mean_sd([100 * r["final_top1"] for r in rs])
        b, bs = mean_sd([100 * r["best_top1"] for r in rs])
        gap = f"{f - statistics.mean(ref):+.2f}" if ref else "-"

        def reach(key, rs=rs):
            got = [r[key] for r in rs if r[key] is not None]
            return (
                f"{statistics.mean(got):.0f} ({len(got)}/{len(rs)})"
                if got
                else f"never (0/{len(rs)})"
            )

        trains = [100 * r["final_train_top1"] for r in rs if r.get("final_train_top1") is not None]
        train = f"{statistics.mean(trains):.2f}" if trains else "-"
        lines.append(
            f"| {row} | {mean_pm(f, fs, len(rs))} | {min(100 * r['final_top1'] for r in rs):.2f} | "
            f"{max(largest_dip(r.get('top1_per_epoch') or []) for r in rs):.1f} | "
            f"{gap} | {train} | {mean_pm(b, bs, len(rs))} | {rs[0]['epochs']} | "
            f"{rs[0]['steps']} | {statistics.mean(r['wall_s'] for r in rs):.0f} | "
            f"{statistics.mean(r['gpu_time_s'] for r in rs):.0f} | {reach('time_to_90')} | "
            f"{reach('time_to_92')} | {len(rs)} | {interval_cell(intervals.get(row))} | "
            f"{counted([epochs_to(r.get('top1_per_epoch') or [], 0.9) for r in rs], '.1f')} | "
            f"{counted([steps_to(r, 0.9) for r in rs])} |"
        )
    return lines


def counted(values: list, spec: str = ".0f") -> str:
    """The mean of the seeds that reached a level (± their sample sd from two on), and how many did:
    "45 (1/3)", "45.3 ± 1.2 (3/3)", "never (0/3)"."""
    got = [v for v in values if v is not None]
    if not got:
        return f"never (0/{len(values)})"
    mean, sd = mean_sd(got)
    spread = f" ± {sd:{spec}}" if len(got) > 1 else ""
    return f"{mean:{spec}}{spread} ({len(got)}/{len(values)})"


def reach_lines(records: list[dict], rows: list[str], reference: str) -> list[str]:
    """Epochs and steps to 90% against the reference row, each gap with its 95% interval (Welch):
    a ramp is judged on both (issue 73)."""
    found = reach_gaps(records, rows, reference)
    if not found:
        return []

    def cell(g: dict, spec: str) -> str:
        ci = g["ci95"] and f" (95% interval {g['ci95'][0]:+{spec}} to {g['ci95'][1]:+{spec}})"
        (n, of), (ref_n, ref_of) = g["reached"], g["reference_reached"]
        # a mean over a smaller share of its seeds than the other's flatters it
        unlike = " (not every seed reached it on both sides)" if n * ref_of != ref_n * of else ""
        return (
            f"{g['mean']:{spec}} ({n}/{of}) against {g['reference_mean']:{spec}} "
            f"({ref_n}/{ref_of}): {g['gap']:+{spec}}{ci or ''}{unlike}"
        )

    lines = [
        f"To 90% against {reference} (the seeds that reached it; gap of the means, Welch):",
        "",
    ]
    for row, entry in found.items():
        parts = [
            f"{way} {cell(entry[way], spec)}" if way in entry else f"{way} not recorded"
            for way, spec in (("epochs", ".1f"), ("steps", ".0f"))
        ]
        lines.append(f"- {row}: {'; '.join(parts)}")
    return lines


def interval_cell(gap: dict | None) -> str:
    if gap is None or gap["ci95_pt"] is None:
        return "-"
    low, high = gap["ci95_pt"]
    return f"{low:+.2f} to {high:+.2f}"


def target_table(
    records: list[dict],
    targets: list[float],
    reference: list[dict] | None = None,
    train_images: int = FASHION_MNIST_TRAIN,
) -> list[str]:
    """Epochs to reach each of ``targets`` per batch size (one run per row) and the ratio to the
    reference's (:func:`reached`); each batch also as its share of the training set per step
    (MLPerf's points: :func:`rcp_table`)."""
    entries = reached(records, targets, reference, train_images)
    ref_label = f"batch 128, baseline ({len(reference)} seeds)" if reference else None
    head = ["global batch", "recipe", "share of the training set per step"]
    for t in targets:
        head += [f"epochs to {100 * t:.2f}%", f"vs {ref_label or 'the smallest batch'}"]
    lines = ["| " + " | ".join([*head, "final top-1 %"]) + " |", "|---" * (len(head) + 1) + "|"]
    rows = list(dict.fromkeys(e["row"] for e in entries))  # baseline first, then by batch
    for row in rows:
        mine = [e for e in entries if e["row"] == row]
        batch = mine[0]["batch"]
        recipe = "baseline (SGD), the goal's reference" if row == "baseline" else "the chosen row"
        cells = [f"{batch:,}", recipe, f"{100 * mine[0]['share']:.2f}%"]
        for e in mine:
            if row == "baseline":
                shown = ", ".join(str(x) if x else "never" for x in e["seed_epochs"])
                cells.append(f"mean {e['epochs']:.1f}: {shown}" if e["epochs"] else shown)
            else:
                cells.append(str(e["epochs"]) if e["epochs"] else f"not in {e['epochs_run']}")
            cells.append(f"{e['ratio']:.2f}x" if e["ratio"] else "-")
        final = f"{100 * mine[0]['final_top1']:.2f}" + (" (mean)" if row == "baseline" else "")
        lines.append("| " + " | ".join([*cells, final]) + " |")
    return lines


RCP_RULESET = "4.0.0"  # the ResNet rules MLPerf's logger ends at (dstrain/loop/mlperf.py)


def mlperf_rcps(ruleset: str = RCP_RULESET) -> list[dict] | None:
    """MLPerf's ResNet-50 reference convergence points, read from the installed mlperf-logging as
    its RCP checker reads them: per batch, the mean epochs to 75.9% top-1 over the reference runs
    without the fastest and the slowest, its ratio to the smallest batch's, and the batch's share
    of ImageNet's training set per step. None without mlperf-logging (``pip install
    mlperf-logging``; requirements.txt pins it)."""
    try:
        from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker
    except ImportError:
        return None
    data = RCP_Checker("training", ruleset, "resnet", verbose=False).rcp_data
    points = sorted(data.values(), key=lambda r: r["BS"])
    first = float(points[0]["RCP Mean"])
    return [
        {
            "batch": int(p["BS"]),
            "share": p["BS"] / IMAGENET_TRAIN,
            "epochs": float(p["RCP Mean"]),
            "ratio": float(p["RCP Mean"]) / first,
            "runs": len(p["Epochs to converge"]),
        }
        for p in points
    ]


def rcp_table(rcps: list[dict] | None, ruleset: str = RCP_RULESET) -> list[str]:
    """MLPerf's points in the columns of :func:`target_table`, for reading the two side by side."""
    if not rcps:
        return ["MLPerf's reference convergence points: mlperf-logging is not installed."]
    return [
        f"MLPerf's ResNet-50 reference convergence points (ruleset {ruleset}, ImageNet, epochs to "
        "75.9% top-1, mean of the reference runs without the fastest and the slowest):",
        "",
        "| global batch | share of the training set per step | epochs to 75.9% | reference runs | "
        f"vs batch {rcps[0]['batch']:,} |",
        "|---|---|---|---|---|",
        *(
            f"| {p['batch']:,} | {100 * p['share']:.2f}% | {p['epochs']:.2f} | {p['runs']} | "
            f"{p['ratio']:.2f}x |"
            for p in rcps
        ),
    ]


def target_goal(
    records: list[dict], target: float, rcps: list[dict] | None, reference: list[dict] | None = None
) -> str:
    """Whether epochs to ``target`` grow from batch 128 (the reference runs' mean where given, else
    the smallest batch's run) to the largest batch by less than MLPerf's from its smallest to its
    largest batch (:func:`mlperf_rcps`)."""
    if not rcps:
        return "Goal (epochs-to-target grow less than MLPerf's): no MLPerf points to compare."
    mlperf = rcps[-1]["ratio"]
    entries = reached(records, [target], reference)
    who = "batch 128's baseline" if reference else "the smallest batch"
    head = (
        f"Goal: epochs to {100 * target:.2f}% grow by less than MLPerf's {mlperf:.2f}x (batch "
        f"{rcps[0]['batch']:,} to {rcps[-1]['batch']:,})"
    )
    if not records or not entries[0]["epochs"]:
        return f"{head}: {who} never reached it, nothing to compare."
    small, largest = entries[0], entries[-1]
    if largest["epochs"] is None:
        return f"{head}: batch {largest['batch']:,} never reached it -> missed."
    return (
        f"{head}: from {who} ({small['epochs']:.1f} epochs) to batch {largest['batch']:,} "
        f"({largest['epochs']} epochs), {largest['ratio']:.2f}x -> "
        f"{'met' if largest['ratio'] < mlperf else 'missed'}."
    )


def goal_lines(
    records: list[dict],
    grid: str,
    target: float | None,
    rcps: list[dict] | None = None,
    reference: list[dict] | None = None,
    extra_targets: list[float] = (),
    baseline: str = "baseline",
) -> list[str]:
    """The issue's goals, with the measured distance (whatever it is): every large-batch row's
    mean within 0.3 pt of the batch-128 row ``baseline`` (issue 52: the tuned one), its worst seed
    beside it."""
    if grid == "target":
        lines = [target_goal(records, t, rcps, reference) for t in [target, *extra_targets]]
        return [x for line in lines for x in (line, "")][:-1]  # a paragraph each
    base = [100 * r["final_top1"] for r in records if r["row"] == baseline]
    batches = {b for r in records if r["row"] == baseline and (b := _first_batch(r))}
    if batches - {128}:  # --baseline names a large-batch row (a ramp against a fixed batch)
        sizes = ", ".join(f"{b:,}" for b in sorted(batches))
        return [
            f"Goal (large batch within 0.3 pt of batch 128): not measurable from these rows "
            f"(the reference row {baseline} trains at batch {sizes})."
        ]
    finals = {
        row: [100 * r["final_top1"] for r in records if r["row"] == row]
        for row in sorted({r["row"] for r in records})
        if row not in (baseline, "baseline", "naive_4096", "goyal_4096")
        and not row.startswith("b128_")
    }
    if not base or not finals:
        return [f"Goal (large batch within 0.3 pt of {baseline}): not measurable from these rows."]
    ref = statistics.mean(base)
    lines = [
        f"Goal: each large-batch row within 0.3 pt of batch 128 ({baseline}, "
        f"{ref:.2f}% over {len(base)} seeds) on the mean, at the same epochs:"
    ]
    for row, values in finals.items():
        gap = statistics.mean(values) - ref
        verdict = "met" if gap >= -0.3 else "missed"
        lines.append(
            f"- {row}: {statistics.mean(values):.2f}% over {len(values)} seeds (worst "
            f"{min(values):.2f}%), {gap:+.2f} pt -> {verdict}"
        )
    return lines


def _first_batch(record: dict) -> int | None:
    """The global batch a run record starts at (its settings resolved); None where they do not
    load (a record without its command, a recipe gone)."""
    from results.harness.study.definition import batch_of

    if not isinstance(record.get("command"), str):
        return None
    try:
        return batch_of(record)
    except (KeyError, ValueError, StopIteration, TypeError):
        return None


def plots(records: list[dict], out: Path, name: str, rows: list[str]) -> None:
    """Top-1 per epoch, one line per seed (a row's seeds share a colour), test beside training
    top-1; the y-axis reaches the lowest value shown, so a diverged seed is seen, not clipped.
    The rows chart: mean +- sd bars with every seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    shown: list[float] = []
    for colour, row in enumerate(r for r in rows if r not in DERIVED and r not in EMA_DERIVED):
        rs = [r for r in records if r["row"] == row]
        for n, r in enumerate(rs):
            for ax, key in zip(axes, ("top1_per_epoch", "train_top1_per_epoch"), strict=True):
                curve = [100 * v for v in r.get(key) or [] if v is not None]
                if not curve:
                    continue
                shown += curve[1:]  # the first epoch's low start does not set the scale
                label = f"{row} ({len(rs)} seeds)" if n == 0 else None
                ax.plot(
                    range(1, len(curve) + 1),
                    curve,
                    color=f"C{colour}",
                    lw=1,
                    alpha=0.8,
                    label=label,
                )
    for ax, what in zip(axes, ("test top-1 (%)", "training top-1 (%, augmented)"), strict=True):
        ax.set_xlabel("epoch")
        ax.set_title(what, fontsize=9)
        ax.grid(alpha=0.3)
    if not axes[1].lines:  # records written before the study kept it
        axes[1].text(
            0.5,
            0.5,
            "no per-epoch training top-1\nin these records",
            ha="center",
            va="center",
            transform=axes[1].transAxes,
            fontsize=9,
        )
    axes[0].set_ylabel("top-1 (%)")
    axes[0].set_ylim(max(0, min(shown, default=80) - 2), min(100, max(shown, default=95) + 1))
    axes[0].legend(fontsize=7)
    fig.suptitle("Fashion-MNIST: one line per seed", fontsize=10)
    fig.tight_layout()
    save_png(fig, out / f"{name}_curves.png", dpi=120)
    plt.close(fig)

    present = [r for r in rows if any(x["row"] == r for x in records)]
    finals = {r: [100 * x["final_top1"] for x in records if x["row"] == r] for r in present}
    stats = [mean_sd(finals[r]) for r in present]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar(
        range(len(present)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3, alpha=0.6
    )
    for i, r in enumerate(present):
        ax.plot([i] * len(finals[r]), finals[r], "k.", ms=5)
    ax.set_xticks(range(len(present)), present, rotation=35, ha="right", fontsize=7)
    every = [v for vs in finals.values() for v in vs]
    ax.set_ylim(max(0, min(every) - 2), min(100, max(every) + 1))
    ax.set_ylabel("final test top-1 (%)")
    ax.set_title("Rows and ablations (mean ± sd over seeds; dots: each seed)")
    fig.tight_layout()
    save_png(fig, out / f"{name}_ablation.png", dpi=120)
    plt.close(fig)


def choice_lines(records: list[dict], rows: list[str], args) -> list[str]:
    """The worst-seed choice among the rows, for a tuning report only (held-out images): a report
    on the test set measures rows already chosen, and naming a winner there invites choosing on it."""
    if args.grid != "study" or not args.holdout:
        return []
    return worst_seed_choice(records, rows)


def title(args) -> str:
    """What a report compared, from its arguments: the grid, its rows, length, seeds and images."""
    evaluated = f"{args.holdout} held-out images" if args.holdout else "the test set"
    seeds = f"{len(args.seeds)} seed(s)"
    if args.grid == "target":
        return f"Epochs to target: batch 128 ... 8,192, {args.epochs} epochs, {seeds}, {evaluated}"
    rows = ", ".join(args.rows)
    return f"Accuracy study: {rows}, {args.epochs} epochs, {seeds}, {evaluated}"


def headline(data: dict) -> str:
    """One line of what a report measured: each row's mean final top-1 over its seeds (the first
    six rows, derived no-refit rows left out), or per target level each batch's epochs to it."""
    if data.get("grid") == "target":
        parts = []
        for level in [data["target"], *data.get("extra_targets", [])]:
            got = [
                f"{e['batch']:,}{' SGD' if e['row'] == 'baseline' else ''} "
                + (f"{round(e['epochs'], 1):g}" if e["epochs"] else "never")
                for e in data["epochs_to_target"]
                if e["level"] == level
            ]
            parts.append(f"to {100 * level:.2f}%: {', '.join(got)}")
        return f"{data['epochs']} epochs, epochs " + "; ".join(parts)
    by_row: dict[str, list[float]] = {}
    for r in data["runs"]:
        by_row.setdefault(r["row"], []).append(r["final_top1"])
    seeds = max((len(v) for v in by_row.values()), default=0)
    shown = [k for k in by_row if not k.endswith("_no_refit")][:6]
    body = ", ".join(f"{k} {100 * statistics.mean(by_row[k]):.2f}%" for k in shown)
    return f"{data['epochs']} epochs, {seeds} seed(s): {body}"


def write(
    out: Path,
    args,
    meta: dict,
    records: list[dict],
    rows: list[str],
    code: dict,
    pending: list[tuple[str, int]],
    rcps: list[dict] | None,
) -> list[str]:
    """Write the report as ``out``/<name>.json (``meta`` and every run), .csv, .md and its plots; the
    table (``body``) is returned for the terminal."""
    data = {**meta, "runs": records}
    write_result(out / f"{args.name}.json", data, title=title(args), headline=headline(data))
    cols = ["row", "seed", "final_top1", "before_polish", "best_top1", "epochs", "steps", "wall_s"]
    cols += ["gpu_time_s", "world_size", "time_to_90", "time_to_92", "git_sha"]
    with open(out / f"{args.name}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    evaluated = f"{args.holdout} held-out training images" if args.holdout else "the test set"
    if args.grid == "target":
        body = [
            *target_table(
                records,
                [args.target, *args.extra_targets],
                args.reference,
                FASHION_MNIST_TRAIN - args.holdout,
            ),
            "",
            *rcp_table(rcps),
        ]
    else:
        body = table(records, rows, args.baseline)
    md = [
        f"# {'Epochs to target' if args.grid == 'target' else 'Accuracy study'}: Fashion-MNIST, "
        f"{args.epochs} epochs, resnet_small width {args.width}",
        "",
        f"`{meta['command']}` on {meta.get('host', '?')} ({meta['cpu_count']} cores"
        + (f", {meta['cuda']}" if meta.get("cuda") else "")
        + f"), {meta['date']}; runs at git {', '.join(s[:7] for s in meta['run_git_shas'])}; "
        f"{meta['grid_wall_s'] / 60:.0f} min for what was trained now ({args.jobs} run(s) at a time); "
        f"launcher {meta['launcher']}; precision {args.precision}; top-1 on {evaluated}.",
        "",
        *body,
        "",
        *([*reach, ""] if (reach := reach_lines(records, rows, args.baseline)) else []),
        *([*code_lines(code), ""] if code_lines(code) else []),
        *(
            [f"Not finished yet, left out (--finished-only): {', '.join(meta['pending'])}.", ""]
            if pending
            else []
        ),
        *goal_lines(
            records,
            args.grid,
            args.target,
            rcps,
            args.reference,
            args.extra_targets,
            baseline=args.baseline,
        ),
        "",
        *([*choice, ""] if (choice := choice_lines(records, rows, args)) else []),
        f"![top-1 per epoch]({args.name}_curves.png)",
        "",
        f"![rows]({args.name}_ablation.png)",
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(md))
    plots(records, out, args.name, rows)
    return body
