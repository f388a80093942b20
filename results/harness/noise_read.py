"""The gradient noise scale along the accuracy study's runs, and the epochs-to-target growth it
predicts (issue 73, item 3).

    .venv/bin/python results/harness/noise_read.py \\
        --reports /work/logs/reports/noise_b4096_b8192_90ep_holdout6000.json \\
                  /work/logs/reports/noise_b128_90ep_holdout6000.json:b128_lr0.8_tail \\
        --reference b128_lr0.8_tail --target 0.9 --name noise_scale_90ep_holdout6000

The runs: results/harness/accuracy_study.py reports (``FILE`` or ``FILE:ROW``) whose runs measured
the gradient noise scale (``log.noise_scale``, two batch sizes: accumulation or ranks), each epoch's
value kept beside its training loss (``noise_scale_per_epoch``, ``train_loss_per_epoch``).
McCandlish et al. (2018): the epochs to a given loss grow with the batch as E_min (1 + B/B_noise).
So a run at batch B whose top-1 first reaches ``--target`` at epoch e, where the run measured
B_noise, predicts its epochs over the reference row's (batch B_ref) as
(1 + B/B_noise) / (1 + B_ref/B_noise); the table puts the measured ratio (its epochs over the
reference row's mean) beside it. Writes <name>.json and <name>.md, and <name>.png (B_noise against
epochs and against training loss, the batches tried drawn across) under --out (default
results/studies).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import provenance, save_png, write_result  # noqa: E402
from results.harness.epochs_tuned import read_runs, split_spec  # noqa: E402
from results.harness.study.definition import batch_of  # noqa: E402
from results.harness.study.stats import epochs_to  # noqa: E402


def predicted_ratio(batch: int, reference_batch: int, noise_scale: float) -> float:
    """McCandlish's epochs at ``batch`` over those at ``reference_batch``, for this B_noise."""
    return (1 + batch / noise_scale) / (1 + reference_batch / noise_scale)


def read(record: dict, target: float, base: float | None, base_batch: int | None) -> dict:
    """One run's row: its batch, epochs to the target, B_noise there, the two ratios."""
    batch = batch_of(record)
    epochs = epochs_to(record["top1_per_epoch"], target)
    noise = record.get("noise_scale_per_epoch") or []
    at = noise[epochs - 1] if epochs and epochs <= len(noise) else None
    measured = [v for v in noise if v is not None]
    return {
        "row": record["row"],
        "seed": record["seed"],
        "batch": batch,
        "epochs_to_target": epochs,
        "noise_scale_there": at,
        "noise_scale_final": measured[-1] if measured else None,
        "predicted_ratio": predicted_ratio(batch, base_batch, at) if at and base_batch else None,
        "measured_ratio": epochs / base if epochs and base else None,
    }


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[dict], target: float, reference: str) -> list[str]:
    lines = [
        f"| run | batch | epochs to {100 * target:.0f}% | B_noise there | predicted vs "
        f"{reference} | measured | B_noise at the end |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} seed {r['seed']} | {r['batch']:,} | {fmt(r['epochs_to_target'], 'd')} "
            f"| {fmt(r['noise_scale_there'], ',.0f')} | {fmt(r['predicted_ratio'], '.2f', 'x')} "
            f"| {fmt(r['measured_ratio'], '.2f', 'x')} | {fmt(r['noise_scale_final'], ',.0f')} |"
        )
    return lines


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in records:
        noise = r.get("noise_scale_per_epoch") or []
        loss = r.get("train_loss_per_epoch") or []
        label = f"{r['row']} s{r['seed']} (batch {batch_of(r):,})"
        points = [(e, v) for e, v in enumerate(noise, 1) if v is not None]
        axes[0].plot([e for e, _ in points], [v for _, v in points], label=label)
        pairs = [(x, v) for x, v in zip(loss, noise, strict=False) if x is not None and v]
        axes[1].plot([x for x, _ in pairs], [v for _, v in pairs], marker=".", label=label)
    for batch in sorted({batch_of(r) for r in records}):
        for ax in axes:
            ax.axhline(batch, color="grey", linestyle="--", linewidth=0.8)
        axes[0].annotate(f"batch {batch:,}", (1, batch), fontsize=7, va="bottom")
    axes[0].set(xlabel="epoch", ylabel="B_noise (images)", yscale="log")
    axes[1].set(xlabel="training loss (epoch mean)")
    axes[1].invert_xaxis()  # training proceeds to the right in both panels
    axes[0].legend(fontsize=7)
    fig.suptitle("Gradient noise scale along the runs (dashed: the batches tried)")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reports", nargs="+", required=True, metavar="FILE[:ROW]")
    p.add_argument("--reference", required=True, help="the row the ratios are taken against")
    p.add_argument("--target", type=float, default=0.9, help="top-1 to reach (fraction)")
    p.add_argument("--out", default=str(REPO / "results/studies"))
    p.add_argument("--name", default="noise_scale")
    args = p.parse_args(argv)
    records, holdouts = [], set()
    for spec in args.reports:
        data, runs = read_runs(p, "--reports", *split_spec(spec))
        holdouts.add(data.get("holdout", 0))
        records += runs
    if len(holdouts) > 1:
        p.error(f"--reports: evaluated on different images (holdout {sorted(holdouts)})")
    unmeasured = [f"{r['row']} seed {r['seed']}" for r in records if not r.get("noise_scale")]
    if unmeasured:
        p.error(f"--reports: {', '.join(unmeasured)} did not measure the noise scale")
    reference = [r for r in records if r["row"] == args.reference]
    if not reference:
        p.error(f"--reference {args.reference}: no run of that row in --reports")
    reached = [epochs_to(r["top1_per_epoch"], args.target) for r in reference]
    base = statistics.mean(reached) if None not in reached else None
    base_batch = batch_of(reference[0])
    rows = [read(r, args.target, base, base_batch) for r in records]
    rows.sort(key=lambda r: (r["batch"], r["row"], r["seed"]))
    holdout = holdouts.pop()
    images = f"{holdout} held-out training images" if holdout else "the test set"
    result = {
        **provenance("results/harness/noise_read.py", argv),
        "reports": args.reports,
        "reference": args.reference,
        "reference_epochs": base,
        "target": args.target,
        "holdout": holdout,
        "rows": rows,
    }
    headline = "; ".join(
        f"batch {r['batch']:,}: predicted {fmt(r['predicted_ratio'], '.2f', 'x')}, measured "
        f"{fmt(r['measured_ratio'], '.2f', 'x')}"
        for r in rows
        if r["row"] != args.reference
    )
    out = Path(args.out)
    title = f"Gradient noise scale and epochs to {100 * args.target:.0f}% top-1 on {images}"
    write_result(out / f"{args.name}.json", result, title=title, headline=headline)
    plot(records, out / f"{args.name}.png")
    md = [
        f"# {title}",
        "",
        f"`{result['command']}` at git {str(result['git_sha'])[:7]}, {result['date']}. Predicted: "
        "McCandlish et al.'s (1 + B/B_noise)/(1 + B_ref/B_noise) with the B_noise each run "
        f"measured where it reached the target; measured: its epochs over {args.reference}'s "
        f"({fmt(base, '.1f')}).",
        "",
        *table(rows, args.target, args.reference),
        "",
        f"![B_noise along the runs]({args.name}.png)",
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(table(rows, args.target, args.reference)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
