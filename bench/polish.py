"""Final Polishing evidence on Fashion-MNIST at batch 4,096 (LARS, warmup, ramp): what helps, what does not.

    .venv/bin/python bench/polish.py                      # -> results/bench/polish.json and polish.md
    .venv/bin/python bench/polish.py --seeds 0 1 2 --epochs 5 --k 1 --sweep 512 2048 10240 0
    .venv/bin/python bench/polish.py --seeds 0 --epochs 2 --sweep 64 --out /tmp/p KEY=VALUE ...
                                                          # elsewhere, with trainer overrides

Per seed, two training runs of the fashion_mnist_lars recipe (batch 1,024 -> 4,096 at epoch 3,
LARS, hybrid warmup, label smoothing) with augmentation on (random crop + flip), both with
polish.enabled=true:
  A: augmentation in every epoch       -> top-1 "none" (before the refit) and "refit" (after)
  B: the last K epochs un-augmented    -> top-1 "K-epochs" (before) and "both" (after)
The refit uses the defaults (polish.images=10240, the training micro batch per forward).
Then, on seed 0's run A, ``python -m dstrain.polish`` re-polishes the final checkpoint with
each polish-set size in ``--sweep`` (0 = all 60,000 images): top-1 and refit time against N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import mean_pm  # noqa: E402

BASE = [
    "--config",
    "fashion_mnist_lars",
    "--deepspeed_config",
    "ds_configs/lars_fp32.json",
    "data.augment=true",
    "polish.enabled=true",
    "checkpoint.every_epochs=0",
    "log.every_steps=100",
]


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def train(run_dir: Path, seed: int, args, k: int) -> dict:
    from bench.common import TRAINER, run_trainer

    return run_trainer(
        [
            *TRAINER,
            *BASE,
            f"epochs={args.epochs}",
            f"seed={seed}",
            f"polish.last_epochs_without_augmentation={k}",
            f"run_dir={run_dir}",
            *args.overrides,
        ],
        run_dir,
    )


def mean_sd(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--k", type=int, default=1, help="last epochs without augmentation in run B")
    p.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        default=[512, 2048, 10240, 0],
        help="polish-set sizes (0 = all)",
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "results" / "bench", help="folder of polish.json/.md"
    )
    p.add_argument("overrides", nargs="*", help="more trainer overrides for every run (key=value)")
    args = p.parse_args()
    from bench.common import provenance, write_result

    rows, sweep = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            a = train(Path(tmp) / f"a{seed}", seed, args, 0)
            b = train(Path(tmp) / f"b{seed}", seed, args, args.k)
            rows.append(
                {
                    "seed": seed,
                    "none": a["polish"]["before"]["val_top1"],
                    "refit": a["polish"]["after"]["val_top1"],
                    "k_epochs": b["polish"]["before"]["val_top1"],
                    "both": b["polish"]["after"]["val_top1"],
                    "train_time_s": a["wall_time_s"],
                    "refit_s": a["polish"]["refit_s"],
                    "refit_fraction": a["polish"]["refit_fraction_of_training"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        first = Path(tmp) / f"a{args.seeds[0]}"
        for n in args.sweep:
            run(
                [
                    sys.executable,
                    "-m",
                    "dstrain.polish",
                    "--checkpoint",
                    str(first),
                    "--images",
                    str(n),
                    "--force",
                ]
            )
            info = json.loads((first / "polished" / "polish.json").read_text())
            sweep.append(
                {
                    "images": info["images"],
                    "top1_before": info["before"]["val_top1"],
                    "top1_after": info["after"]["val_top1"],
                    "refit_s": info["refit_s"],
                }
            )
            print(json.dumps(sweep[-1]), flush=True)
    summary = {
        key: mean_sd([r[key] for r in rows])
        for key in ("none", "refit", "k_epochs", "both", "refit_fraction")
    }
    result = {
        **provenance("polish.py"),
        "setup": {
            "training": " ".join([*BASE, *args.overrides]) + f" epochs={args.epochs}",
            "k": args.k,
            "seeds": args.seeds,
            "polish_images": 10240,
        },
        "per_seed": rows,
        "summary": summary,
        "sweep_seed0": sweep,
    }
    out_dir = args.out
    title = (
        f"Final Polishing (BN refit, last {args.k} epoch(s) un-augmented), "
        f"{len(args.seeds)} seed(s), {args.epochs} epochs"
    )
    write_result(out_dir / "polish.json", result, title=title, headline=headline(result))
    (out_dir / "polish.md").write_text(table(result))
    print(table(result))
    return 0


def headline(r: dict) -> str:
    """Top-1 of each variant (mean over the seeds) and the refit's share of the training time."""
    s = r["summary"]
    return (
        f"{len(s['none']['values'])} seed(s): none {s['none']['mean']:.2%}, refit "
        f"{s['refit']['mean']:.2%}, last K {s['k_epochs']['mean']:.2%}, both "
        f"{s['both']['mean']:.2%}; refit {s['refit_fraction']['mean']:.1%} of training time"
    )


def table(r: dict) -> str:
    s = r["summary"]
    pct = lambda d: mean_pm(100 * d["mean"], 100 * d["sd"], len(d["values"]))  # noqa: E731
    lines = [
        f"Fashion-MNIST, fashion_mnist_lars recipe with augmentation, {r['setup']['training'].split('epochs=')[-1]}"
        f" epochs, seeds {r['setup']['seeds']}, K={r['setup']['k']} (git {r['git_sha'][:7]})",
        "",
        "| variant | test top-1 % (mean ± sample sd) | per seed |",
        "|---|---|---|",
    ]
    names = {
        "none": "no polishing",
        "refit": "BN refit",
        "k_epochs": f"last {r['setup']['k']} epoch(s) un-augmented",
        "both": "both",
    }
    for key, name in names.items():
        lines.append(
            f"| {name} | {pct(s[key])} | {', '.join(f'{100 * v:.2f}' for v in s[key]['values'])} |"
        )
    lines += [
        "",
        f"BN refit cost: {100 * s['refit_fraction']['mean']:.2f}% of the training time "
        f"({statistics.mean(x['refit_s'] for x in r['per_seed']):.1f} s).",
        "",
        "| polish images (seed 0, run A) | top-1 before % | top-1 after % | refit s |",
        "|---|---|---|---|",
    ]
    for row in r["sweep_seed0"]:
        lines.append(
            f"| {row['images']} | {100 * row['top1_before']:.2f} | {100 * row['top1_after']:.2f} | "
            f"{row['refit_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
