"""Large-batch accuracy study on Fashion-MNIST: baseline vs naive large batch vs the recipe, plus ablations.

    .venv/bin/python bench/accuracy_study.py --jobs 2         # the full grid (~41 min) -> docs/results/accuracy_study.*
    .venv/bin/python bench/accuracy_study.py --rows baseline recipe_lars --seeds 0 --epochs 2   # a subset

Every row trains for the same number of epochs (``--epochs``, default 10) with the same model (``--width``),
for each seed, through the real command line (``python -m dstrain``; ``--launcher`` prefixes it, e.g.
``"deepspeed --num_gpus 8"`` on a GPU node, with ``--precision bf16`` for the BF16 JSONs and ``--micro 128``).
``--jobs 2`` runs two at a time with one torch thread each (the default grid: about 50 min on 2 CPU cores).

Rows
  baseline        batch 128, SGD momentum 0.9, linear rule (0.1 per 256 = 0.05), cosine, no warmup
  naive_4096      batch 4,096, the same SGD with the linear rule only (peak LR 1.6), no warmup
  recipe_lars     batch-size ramp 1,024 (epoch 1) -> 2,048 (epochs 2-3) -> 4,096 (epochs 4-10), LARS at a
                  peak LR of 10 that does not follow the batch (growing the batch at a constant LR acts as
                  an LR decay: Smith et al. 2018, Mikami's batch-size control), half-epoch linear warmup, poly
                  (power 2) decay, label smoothing 0.1, Final Polishing (BN refit); scored after the refit
  recipe_lamb     the same with LAMB (peak LR 0.032)
  ablations       recipe_lars minus one technique: no_polish (the same runs, before the refit), no_warmup,
                  no_label_smoothing, no_ramp (4,096 from the start), sgd (momentum SGD at the linear-rule
                  LR of batch 4,096, 1.6, instead of LARS)
LRs: a 10-epoch, one-seed sweep at this width (docs/results/accuracy_study.md, "How the recipe was tuned").

Writes accuracy_study.json (every run's history), accuracy_study.csv (one line per run),
accuracy_study.md (mean and spread per row) and two plots: top-1 per epoch for baseline, naive and
recipe (accuracy_curves.png) and the ablation bars (accuracy_ablation.png).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RAMP = "batch.ramp=[[1,2048],[3,4096]]"
RECIPE = [
    "batch.global_size=1024",
    RAMP,
    "optim.lr_scaling=none",
    "optim.base_lr=10",
    "optim.warmup=linear",
    "optim.warmup_epochs=0.5",
    "optim.decay=poly",
    "optim.poly_power=2.0",
    "optim.label_smoothing=0.1",
    "polish.enabled=true",
]
SGD = [
    "optim.lr_scaling=linear",
    "optim.warmup_epochs=0",
    "optim.decay=cosine",
    "optim.label_smoothing=0",
]
ROWS = {  # name -> (JSON stem, overrides); a later key=value wins
    "baseline": ("fp32", ["batch.global_size=128"] + SGD),
    "naive_4096": ("fp32", ["batch.global_size=4096"] + SGD),
    "recipe_lars": ("lars", RECIPE),
    "recipe_lamb": ("lamb", RECIPE + ["optim.base_lr=0.032"]),
    "no_warmup": ("lars", RECIPE + ["optim.warmup_epochs=0"]),
    "no_label_smoothing": ("lars", RECIPE + ["optim.label_smoothing=0"]),
    "no_ramp": ("lars", RECIPE + ["batch.global_size=4096", "batch.ramp=[]"]),
    "sgd": ("fp32", RECIPE + ["optim.base_lr=1.6"]),
}
DERIVED = {"no_polish": "recipe_lars"}  # rows read from another row's runs (top-1 before the refit)
JSON_FILE = {
    "fp32": "ds_configs/fp32.json",
    "lars": "ds_configs/lars_{p}.json",
    "lamb": "ds_configs/lamb_{p}.json",
}


def json_for(stem: str, precision: str) -> str:
    path = JSON_FILE[stem].format(p=precision)
    if stem == "fp32" and precision != "fp32":
        path = f"ds_configs/{precision}.json"
    return path


def train(row: str, seed: int, args, run_dir: Path) -> dict:
    stem, overrides = ROWS[row]
    if (
        row != "baseline"
    ):  # batch 128 runs in one micro batch per rank; the large batches accumulate
        overrides = [f"batch.micro_per_rank={args.micro}", *overrides]
    cmd = (
        shlex.split(args.launcher) + ["dstrain/main.py"]
        if args.launcher
        else [sys.executable, "-m", "dstrain"]
    )
    cmd += [
        "--config",
        "fashion_mnist",
        "--deepspeed_config",
        json_for(stem, args.precision),
        f"epochs={args.epochs}",
        f"seed={seed}",
        f"model.width={args.width}",
        "model.channels_last=true",
        "data.augment=false",
        "checkpoint.every_epochs=0",
        "checkpoint.keep_last=1",
        "log.every_steps=50",
        "log.tensorboard=false",
        f"run_dir={run_dir}",
        *overrides,
        *args.extra,
    ]
    from bench.common import run_trainer

    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    summary = run_trainer(cmd, run_dir, env=env, what=f"{row} seed {seed}")
    del summary["stdout"]
    return summary


def time_to(history: list[dict], target: float) -> float | None:
    """Training wall time (s, cumulative epoch times) until test top-1 first reaches target; None if never."""
    elapsed = 0.0
    for h in history:
        elapsed += h["epoch_time_s"]
        if h.get("val_top1", 0.0) >= target:
            return elapsed
    return None


def run_record(row: str, seed: int, s: dict) -> dict:
    hist = s["history"]
    final = (
        s["polish"]["after"]["val_top1"] if "polish" in s else s["final_top1"]
    )  # recipe rows: after the refit
    return {
        "row": row,
        "seed": seed,
        "final_top1": final,
        "best_top1": max(s["best_top1"], final),
        "epochs": s["epochs"],
        "steps": s["steps"],
        "wall_s": s["wall_time_s"],
        "gpu_time_s": s["gpu_time_s"],
        "world_size": s["world_size"],
        "time_to_90": time_to(hist, 0.90),
        "time_to_92": time_to(hist, 0.92),
        "top1_per_epoch": [h.get("val_top1") for h in hist],
        "command": s["command"],
        **({"before_polish": s["polish"]["before"]["val_top1"]} if "polish" in s else {}),
    }


def derived(records: list[dict]) -> list[dict]:
    out = []
    for name, source in DERIVED.items():
        for r in records:
            if r["row"] == source and "before_polish" in r:
                out.append(
                    {
                        **r,
                        "row": name,
                        "final_top1": r["before_polish"],
                        "best_top1": max(t for t in r["top1_per_epoch"] if t is not None),
                    }
                )
    return out


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(records: list[dict], rows: list[str]) -> list[str]:
    lines = [
        "| row | final top-1 % (mean ± sd) | best top-1 % | epochs | steps | wall s | GPU-time s | "
        "s to 90% | s to 92% | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rs = [r for r in records if r["row"] == row]
        if not rs:
            continue
        f, fs = mean_sd([100 * r["final_top1"] for r in rs])
        b, bs = mean_sd([100 * r["best_top1"] for r in rs])

        def reach(key, rs=rs):
            got = [r[key] for r in rs if r[key] is not None]
            return (
                f"{statistics.mean(got):.0f} ({len(got)}/{len(rs)})"
                if got
                else f"never (0/{len(rs)})"
            )

        lines.append(
            f"| {row} | {f:.2f} ± {fs:.2f} | {b:.2f} ± {bs:.2f} | {rs[0]['epochs']} | {rs[0]['steps']} | "
            f"{statistics.mean(r['wall_s'] for r in rs):.0f} | "
            f"{statistics.mean(r['gpu_time_s'] for r in rs):.0f} | {reach('time_to_90')} | "
            f"{reach('time_to_92')} | {len(rs)} |"
        )
    return lines


def plots(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in ("baseline", "naive_4096", "recipe_lars"):
        rs = [r for r in records if r["row"] == row]
        if not rs:
            continue
        curves = [[t for t in r["top1_per_epoch"]] for r in rs]
        n = min(len(c) for c in curves)
        mean = [100 * statistics.mean(c[i] for c in curves) for i in range(n)]
        ax.plot(range(1, n + 1), mean, marker="o", label=f"{row} ({len(rs)} seeds)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title("Fashion-MNIST: batch 128 vs 4,096")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_curves.png", dpi=120)
    plt.close(fig)

    names = [
        r
        for r in [
            "recipe_lars",
            *DERIVED,
            "no_warmup",
            "no_label_smoothing",
            "no_ramp",
            "sgd",
            "recipe_lamb",
            "naive_4096",
            "baseline",
        ]
        if any(x["row"] == r for x in records)
    ]
    stats = [mean_sd([100 * x["final_top1"] for x in records if x["row"] == r]) for r in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(names)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    lo = min(m for m, _ in stats)
    ax.set_ylim(max(0, lo - 5), 100)
    ax.set_ylabel("final test top-1 (%)")
    ax.set_title("Ablation: the batch-4,096 recipe minus one technique")
    fig.tight_layout()
    fig.savefig(out / "accuracy_ablation.png", dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--width", type=int, default=8, help="resnet_small first-stage channels")
    p.add_argument(
        "--micro",
        type=int,
        default=256,
        help="per-rank micro batch of the large-batch rows (8 GPUs: 128, so 1,024 = 128 x 8 ranks)",
    )
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument(
        "--launcher", default="", help='e.g. "deepspeed --num_gpus 8" (default: one process)'
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time; with N > 1 each gets cores/N torch threads (OMP_NUM_THREADS)",
    )
    p.add_argument("--out", default=str(REPO / "docs/results"))
    p.add_argument("extra", nargs="*", help="more trainer overrides for every run (key=value)")
    args = p.parse_args()
    from dstrain.provenance import git_sha

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: must be >= 1")
    args.threads = (
        max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else 0
    )  # 0: the process default
    records, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dstrain-accuracy-") as tmp:

        def one(row_seed):
            row, seed = row_seed
            s = train(row, seed, args, Path(tmp) / f"{row}-{seed}")
            rec = run_record(row, seed, s)
            print(
                f"{row:20s} seed {seed}: final top-1 {100 * rec['final_top1']:.2f}%  "
                f"({rec['wall_s']:.0f} s)",
                flush=True,
            )
            return rec

        with ThreadPoolExecutor(
            args.jobs
        ) as pool:  # each run is its own process; threads only wait for them
            records = list(pool.map(one, [(row, seed) for row in args.rows for seed in args.seeds]))
    records += derived(records)
    rows = [*args.rows[:1], *[r for r in ROWS if r in args.rows and r != args.rows[0]]]
    rows += [d for d in DERIVED if any(r["row"] == d for r in records)]
    meta = {
        "git_sha": git_sha(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "epochs": args.epochs,
        "width": args.width,
        "precision": args.precision,
        "launcher": args.launcher or "python -m dstrain",
        "seeds": args.seeds,
        "jobs": args.jobs,
        "threads_per_run": args.threads or None,
        "grid_wall_s": time.perf_counter() - t0,
        "command": "python bench/accuracy_study.py " + " ".join(sys.argv[1:]),
    }
    (out / "accuracy_study.json").write_text(json.dumps({**meta, "runs": records}, indent=2) + "\n")
    with open(out / "accuracy_study.csv", "w", newline="") as fh:
        cols = [
            "row",
            "seed",
            "final_top1",
            "best_top1",
            "epochs",
            "steps",
            "wall_s",
            "gpu_time_s",
            "world_size",
            "time_to_90",
            "time_to_92",
        ]
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    md = [
        f"# Accuracy study: Fashion-MNIST, {args.epochs} epochs, resnet_small width {args.width}",
        "",
        f"`{meta['command']}` at git {meta['git_sha']}, {meta['date']}, {meta['grid_wall_s'] / 60:.0f} min "
        f"for the grid ({args.jobs} run(s) at a time"
        + (f", {args.threads} torch thread(s) each" if args.threads else "")
        + f"); launcher: {meta['launcher']}; "
        f"precision {args.precision}.",
        "",
        *table(records, rows),
        "",
        "![top-1 per epoch](accuracy_curves.png)",
        "",
        "![ablation](accuracy_ablation.png)",
        "",
    ]
    (out / "accuracy_study.md").write_text("\n".join(md))
    plots(records, out)
    print("\n".join(table(records, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
