"""Large-batch accuracy study on Fashion-MNIST at the records' step budget: batch 128 vs batch 4,096.

    .venv/bin/python bench/accuracy_study.py --epochs 90 --jobs 6             # the grid on a GPU node
    .venv/bin/python bench/accuracy_study.py --epochs 30 --jobs 2             # the CPU stand-in
    .venv/bin/python bench/accuracy_study.py --grid target --epochs 90 --seeds 0 --jobs 6   # epochs-to-target
    .venv/bin/python bench/accuracy_study.py --holdout 6000 --rows fujitsu_span --extra optim.base_lr=4
                                                                  # tuning: held-out training images

Batch 4,096 is 6.8% of Fashion-MNIST's 60,000 training images per step (Fujitsu's 86,016: 6.7% of
ImageNet); 90 epochs give 1,260 steps (Fujitsu: 1,341). Every row trains for the same epochs
(``--epochs``) with the same model (``--width``) and augmentation (2-pixel random crop + flip), for
each seed, through the real command line (``python -m dstrain``; ``--launcher`` prefixes it, e.g.
``"deepspeed --num_gpus 8"``). ``--jobs N`` runs N at once, each with cores/N torch threads; on a
GPU node they share the first GPU (one 10-epoch batch-4,096 run used 20 s of an H100), or, with
``--gpus 0 1 ...``, are dealt round robin over those GPUs.

Grid ``study`` (rows; K = the last 5/90 of the epochs, W = the first 40%):
  baseline         batch 128, SGD momentum 0.9 (fp32.json), the default recipe's 0.4 per 256 images
                   (0.2), cosine, no warmup, no label smoothing
  naive_4096       batch 4,096, the same SGD at the linear rule's 6.4, no warmup (it diverges)
  goyal_4096       Goyal et al.: the same SGD, linear rule from 0.1 per 256 images (1.6; chosen with
                   --holdout; the baseline's 0.4 per 256, 6.4, diverges) after a gradual warmup over
                   5/90 of the epochs, zero-init of each block's last BN gamma
  lars_records     LARS in the records' regime: batch 4,096 throughout, linear warmup over 30% of the
                   epochs, poly 2, momentum 0.95, no zero-init, smoothing 0.1, the last K epochs
                   un-augmented; peak LR 8 unless --extra optim.base_lr=... (choose it with --holdout)
  lars_records_no_last_k   the same, every epoch augmented
  lars, lamb       the fashion_mnist_lars recipe: ramp 1,024 -> 2,048 (epoch 2) -> 4,096 (epoch 4) at a
                   constant peak LR (10; LAMB 0.032), half-epoch warmup, poly 2, label smoothing 0.1
  fujitsu          the fashion_mnist_fujitsu recipe (Fujitsu's MLPerf v0.6 hyperparameters): batch 4,096,
                   LARS eta 0.0025, momentum 0.96, W-epoch warmup, poly 2.2 over 52/90 of the epochs,
                   wd as Fujitsu's code applies it, smoothing 0.1, last K epochs without augmentation;
                   without a BN span
  *_span32         the same with model.bn_span=32 (BN over 32 images, as one GPU of a large run)
  fujitsu_span32_no_last_k   the same LR schedule, every epoch augmented
  fujitsu_span32_<brake>     one brake each on fujitsu_span32 (issue 39): bn_lr0.1 (the BN/bias
                   group at 0.1x the LR), trust_clip1, momentum_correction, warmup50 (50% warmup,
                   the same end of decay), lr5 (half the peak); chosen on held-out images by the
                   worst seed (the report's "Chosen by the worst of N seeds" line)
  records_plus_<difference>  one of Fujitsu's differences each on lars_records (issue 39): eta0.0025,
                   m0.96, trust_decay (wd x peak LR in the trust ratio), warmup40, decay52 (poly
                   2.2 over 52/90 of the epochs to 0.25% of the peak, then held), span32
  b128_lr<L>[_warmup|_ls|_tail|_all]   batch 128 tuned (issue 52, item 1): peak LR L per 256 images
                   (0.1 / 0.2 / 0.4 / 0.8), plain, with a linear warmup over 5/90 of the epochs, with
                   label smoothing 0.1, with the last K epochs un-augmented, or all three; each ends
                   with the BN refit (its *_no_refit twin: the same run before it)
  chosen_<change>  one change each from the chosen batch-4,096 row (issue 52, item 4): no_ls, no_tail,
                   ramp (2,048 through the warmup, then 4,096), b8192 (LARS at 8,192), b8192_lamb
                   (LAMB at 8,192); chosen_no_refit reads the chosen row's runs before the refit
Every recipe row ends with the BN refit (Final Polishing) and is scored after it; derived rows read
the same runs before the refit (``*_no_refit``), so the two polishing ablations share one LR schedule.
Grid ``target``: the chosen row (``CHOSEN``: fujitsu_span32 with BN/bias at 0.1x the LR) at batch
128 ... 8,192 (same LR: MLPerf's LARS table keeps one peak LR below 16K), one run each;
epochs-to-target = first epoch whose top-1 reaches the target (default: the study's baseline final
top-1 minus 0.3 pt, from ``--target-from``, whose batch-128 runs are also the reference row the
ratios are taken against), and to each of ``--extra-targets`` (e.g. 0.9, the level the study's
"s to 90%" column times: a level below every row's final top-1, as MLPerf's 75.9% is). The report
puts MLPerf's ResNet-50 reference convergence points beside it (ruleset 4.0.0, read from
mlperf-logging), each batch also as its share of the training set per step (batch 4,096 is 6.83% of
Fashion-MNIST; MLPerf's 67,840, 5.30% of ImageNet).

Runs are kept in ``--runs`` (default runs/accuracy_study/<grid>-<epochs>ep[_holdoutN]/<row>-<seed>);
a run whose summary.json exists is read, not retrained, and an interrupted one resumes from its last
checkpoint (every 5 epochs, ``resume=auto``), so a grid stopped (or split across machines) continues
where it stopped; each run records the git SHA it started at, shown in the report. runs/ is not
committed: ``--reuse REPORT.json ...`` reads the finished runs a committed report recorded (a new
checkout continues a grid from its reports; a recorded run of another definition is refused). Runs
are compared by what they are (the config the trainer builds, the JSON's name), not by the words of
their commands: a run recorded under another row counts when it is the same run.

Writes <name>.json (every run's history), <name>.csv, <name>.md and plots (<name>_curves.png,
<name>_ablation.png) under --out (default docs/results), name = accuracy_study_<epochs>ep or
epochs_to_target_<epochs>ep (+ _holdout when tuning).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SPAN = "model.bn_span=32"
LARS_RECIPE = [  # fashion_mnist_lars, with the study's augmentation
    "batch.global_size=1024",
    "batch.ramp=[[1,2048],[3,4096]]",
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
TARGET_BATCHES = (128, 512, 1024, 2048, 4096, 8192)
# the batch-4,096 row chosen on held-out images by the worst of 3 seeds (issue 39, item 1:
# docs/results/tuning/README.md); the epochs-to-target grid runs it at every batch
CHOSEN = "fujitsu_span32_bn_lr0.1"


def last_k(epochs: int) -> int:
    """Fujitsu's last 5 of 90 epochs without augmentation, at this length (at least 1)."""
    return max(1, round(5 * epochs / 90))


def fujitsu(epochs: int, *extra: str) -> tuple[str, str, list[str]]:
    """The fashion_mnist_fujitsu recipe at ``epochs``: warmup 40% of them, decay over the next
    52/90, last K unaugmented."""
    return (
        "fashion_mnist_fujitsu",
        "lars_fujitsu",
        [
            f"optim.warmup_epochs={0.4 * epochs:g}",
            f"optim.decay_epochs={52 * epochs / 90:g}",
            f"polish.last_epochs_without_augmentation={last_k(epochs)}",
            "model.bn_span=0",
            *extra,
        ],
    )


def goyal(epochs: int) -> list[str]:
    """Goyal et al.'s large-batch SGD: the linear rule from 0.1 per 256 images (1.6 at 4,096; chosen
    on held-out images from 0.05 / 0.1 / 0.2, docs/results/tuning; the baseline's 0.4 per 256 gives
    6.4 and diverges), 5 of 90 epochs of gradual warmup from the base LR, zero-init of each block's
    last BN gamma."""
    return [
        "batch.global_size=4096",
        *SGD,
        "optim.base_lr=0.1",
        "optim.warmup=gradual",
        f"optim.warmup_epochs={max(1.0, 5 * epochs / 90):g}",
        "model.zero_init_residual=true",
    ]


def records_regime(epochs: int, *extra: str) -> list[str]:
    """LARS where the LARS records run (issue 33): batch 4,096 from the first step, linear warmup
    over ~30% of the steps, poly 2, momentum 0.95 (LARS_M095), no zero-init, label smoothing 0.1,
    the last K epochs un-augmented; the peak LR is chosen on held-out images (--extra)."""
    return [
        "batch.global_size=4096",
        "optim.lr_scaling=none",
        "optim.base_lr=8",
        "optim.warmup=linear",
        f"optim.warmup_epochs={0.3 * epochs:g}",
        "optim.decay=poly",
        "optim.poly_power=2.0",
        "optim.label_smoothing=0.1",
        "model.zero_init_residual=false",
        f"polish.last_epochs_without_augmentation={last_k(epochs)}",
        "polish.enabled=true",
        *extra,
    ]


# study JSONs derived from a shipped one: (shipped stem, optimizer parameters changed)
DERIVED_JSON = {
    "lars_m095": ("lars", {"momentum": 0.95}),
    # issue 39's brakes on the Fujitsu row, one at a time
    "lars_fujitsu_bnlr01": ("lars_fujitsu", {"bn_bias_lr_factor": 0.1}),
    "lars_fujitsu_clip1": ("lars_fujitsu", {"trust_clip": 1.0}),
    "lars_fujitsu_momcorr": ("lars_fujitsu", {"momentum_correction": True}),
    # issue 39's Fujitsu differences on lars_records (lars_m095), one at a time
    "lars_m095_eta0025": ("lars", {"momentum": 0.95, "trust_coefficient": 0.0025}),
    "lars_m096": ("lars", {"momentum": 0.96}),
    "lars_m095_trust_decay": ("lars", {"momentum": 0.95, "trust_decay": "weight_decay_x_peak_lr"}),
}


def brakes(epochs: int) -> dict[str, tuple[str, str, list[str]]]:
    """The records' brakes on fujitsu_span32, one per row (issue 39, item 1; chosen on held-out
    images by the worst of 3 seeds). The values come from the seed-2 diagnosis
    (docs/results/stability): BN/bias tensors, which take plain SGD steps at the scheduled LR, moved
    up to 0.60 of their norm in one step against <= 0.041 for any LARS-adapted weight, and the
    largest trust ratio grew from 0.4 to 1.5-2.2 as the warmup reached the peak."""
    recipe, stem, base = fujitsu(epochs, SPAN)
    warmup, end = 0.5 * epochs, (0.4 + 52 / 90) * epochs  # a longer warmup, the same end of decay
    return {
        # the BN/bias group at a tenth of the scheduled LR
        "fujitsu_span32_bn_lr0.1": (recipe, "lars_fujitsu_bnlr01", base),
        # the trust ratio capped at 1 (it reached 2.2 on seed 2)
        "fujitsu_span32_trust_clip1": (recipe, "lars_fujitsu_clip1", base),
        # Goyal's momentum correction (momentum x lr_t / lr_(t-1))
        "fujitsu_span32_momentum_correction": (recipe, "lars_fujitsu_momcorr", base),
        # warmup over 50% of the epochs instead of 40%, decay ending where it did
        "fujitsu_span32_warmup50": (
            recipe,
            stem,
            [*base, f"optim.warmup_epochs={warmup:g}", f"optim.decay_epochs={end - warmup:g}"],
        ),
        # half the peak LR
        "fujitsu_span32_lr5": (recipe, stem, [*base, "optim.base_lr=5"]),
    }


def differences(epochs: int) -> dict[str, tuple[str, str, list[str]]]:
    """Fujitsu's differences from LARS in the records' regime, one per row on lars_records (issue
    39, item 2: which of them carries fujitsu_span32's lead; held-out images, 2+ seeds). The rest
    of the gap is the peak LR (Fujitsu's 10 against 8), which acts with the trust coefficient:
    a LARS step is lr x eta x |w|/|g|."""
    base = records_regime(epochs)
    return {
        # trust coefficient 0.0025 instead of 0.001
        "records_plus_eta0.0025": ("fashion_mnist", "lars_m095_eta0025", base),
        # momentum 0.96 instead of 0.95
        "records_plus_m0.96": ("fashion_mnist", "lars_m096", base),
        # the weight decay inside the trust ratio times the peak LR (Fujitsu's code)
        "records_plus_trust_decay": ("fashion_mnist", "lars_m095_trust_decay", base),
        # warmup over 40% of the epochs instead of 30% (poly 2 to the end still)
        "records_plus_warmup40": (
            "fashion_mnist",
            "lars_m095",
            [*base, f"optim.warmup_epochs={0.4 * epochs:g}"],
        ),
        # Fujitsu's decay: poly 2.2 over 52/90 of the epochs to 0.25% of the peak, then held
        "records_plus_decay52": (
            "fashion_mnist",
            "lars_m095",
            [
                *base,
                "optim.poly_power=2.2",
                "optim.end_lr_factor=0.0025",
                f"optim.decay_epochs={52 * epochs / 90:g}",
            ],
        ),
        # BN over 32 images
        "records_plus_span32": ("fashion_mnist", "lars_m095", [*base, SPAN]),
    }


# each batch-8,192 row's peak LR, chosen on held-out images at 8,192 and 90 epochs by the worst of 3
# seeds (issue 52; docs/results/tuning/README.md): LARS 20 (10 and 40 worse on seed 0 alone);
# LAMB's is tuned the same way (bench/issue52_runs.sh), the fashion_mnist_lars recipe's until then
B8192_LR = {"lars": 20.0, "lamb": 0.032}


def ablation(epochs: int) -> dict[str, tuple[str, str, list[str]]]:
    """What each technique of the seeds earns at the large batch (issue 52, item 4): one change per
    row from the chosen batch-4,096 row (``CHOSEN``); its BN refit is read from the chosen row's own
    runs (``chosen_no_refit``, a derived row). The batch ramp is Mikami's batch-size control: half
    the batch through the warmup, then 4,096 (the LR, lr_scaling none, does not change with it)."""
    recipe, stem, base = brakes(epochs)[CHOSEN]
    b8192 = ["batch.global_size=8192"]
    return {
        "chosen_no_ls": (recipe, stem, [*base, "optim.label_smoothing=0"]),
        "chosen_no_tail": (recipe, stem, [*base, "polish.last_epochs_without_augmentation=0"]),
        "chosen_ramp": (
            recipe,
            stem,
            [*base, "batch.global_size=2048", f"batch.ramp=[[{round(0.4 * epochs)},4096]]"],
        ),
        "chosen_b8192": (recipe, stem, [*base, *b8192, f"optim.base_lr={B8192_LR['lars']:g}"]),
        "chosen_b8192_lamb": (
            recipe,
            "lamb",
            [*base, *b8192, f"optim.base_lr={B8192_LR['lamb']:g}"],
        ),
    }


# the EMA of the weights (issue 54, optim.ema) at each batch: timm's warmup, and a decay whose
# half-life is 2.8 epochs of the held-out split's 54,000 training images, as timm's 0.9998 is at
# ImageNet's 1,251 steps per epoch (batch 1,024): d = 2^(-1 / (2.8 x steps per epoch))
EMA_HALF_LIFE_EPOCHS = 2.8


def ema_settings(batch: int, train_images: int = 54000) -> list[str]:
    decay = 2 ** (-1 / (EMA_HALF_LIFE_EPOCHS * (train_images // batch)))
    return [f"optim.ema.decay={decay:.6f}", "optim.ema.warmup=true"]


def ema_rows(epochs: int) -> dict[str, tuple[str, str, list[str]]]:
    """The chosen batch-4,096 row and the tuned batch-128 row with an EMA of the weights (issue 54).
    The EMA is passive (training is the same run as the row's without it); each run gives four
    numbers, read as rows: the row itself (trained, refit), ``*_no_refit`` (trained),
    ``*_avg`` (the EMA, its averaged BN statistics) and ``*_avg_refit`` (the EMA, BN refit)."""
    recipe, stem, base = brakes(epochs)[CHOSEN]
    b128 = baseline_tuning(epochs)["b128_lr0.4_tail"]
    return {
        "chosen_ema": (recipe, stem, [*base, *ema_settings(4096)]),
        "b128_lr0.4_tail_ema": (b128[0], b128[1], [*b128[2], *ema_settings(128)]),
    }


# batch 128's peak LR per 256 images tried on held-out images (issue 52: the baseline gets a tuning
# budget of the kind the large batch had); 0.4 is the default recipe's, the untuned baseline's
BASELINE_LRS = (0.1, 0.2, 0.4, 0.8)


def baseline_tuning(epochs: int) -> dict[str, tuple[str, str, list[str]]]:
    """Batch 128 with a tuning budget (issue 52, item 1), every row ending with the BN refit so its
    ``*_no_refit`` twin (the same run before the refit) is the row without it: the peak LR (per 256
    images, the linear rule's 0.4 untuned), each with a linear warmup over 5/90 of the epochs
    (Goyal's), and the batch-independent techniques the large-batch rows get: label smoothing 0.1,
    the last K epochs un-augmented, and all of them together."""
    rows = {}
    for lr in BASELINE_LRS:
        base = ["batch.global_size=128", *SGD, f"optim.base_lr={lr:g}", "polish.enabled=true"]
        warmup = ["optim.warmup=linear", f"optim.warmup_epochs={5 * epochs / 90:g}"]
        smooth = ["optim.label_smoothing=0.1"]
        tail = [f"polish.last_epochs_without_augmentation={last_k(epochs)}"]
        rows |= {
            f"b128_lr{lr:g}": ("fashion_mnist", "fp32", base),
            f"b128_lr{lr:g}_warmup": ("fashion_mnist", "fp32", [*base, *warmup]),
            f"b128_lr{lr:g}_ls": ("fashion_mnist", "fp32", [*base, *smooth]),
            f"b128_lr{lr:g}_tail": ("fashion_mnist", "fp32", [*base, *tail]),
            f"b128_lr{lr:g}_all": ("fashion_mnist", "fp32", [*base, *warmup, *smooth, *tail]),
        }
    return rows


def grid_rows(grid: str, epochs: int) -> dict[str, tuple[str, str, list[str]]]:
    """row -> (recipe, JSON stem, overrides); a later key=value wins."""
    if grid == "target":  # the chosen batch-4,096 row (issue 39) at each batch
        recipe, stem, base = brakes(epochs)[CHOSEN]
        return {
            f"target_b{b}": (
                recipe,
                stem,
                [*base, f"batch.global_size={b}", f"batch.micro_per_rank={min(b, 256)}"],
            )
            for b in TARGET_BATCHES
        }
    return {
        "baseline": ("fashion_mnist", "fp32", ["batch.global_size=128", *SGD]),
        "naive_4096": ("fashion_mnist", "fp32", ["batch.global_size=4096", *SGD]),
        "goyal_4096": ("fashion_mnist", "fp32", goyal(epochs)),
        "lars_records": ("fashion_mnist", "lars_m095", records_regime(epochs)),
        "lars_records_no_last_k": (
            "fashion_mnist",
            "lars_m095",
            records_regime(epochs, "polish.last_epochs_without_augmentation=0"),
        ),
        "lars": ("fashion_mnist", "lars", LARS_RECIPE),
        "lars_span32": ("fashion_mnist", "lars", [*LARS_RECIPE, SPAN]),
        "lamb": ("fashion_mnist", "lamb", [*LARS_RECIPE, "optim.base_lr=0.032"]),
        "lamb_span32": ("fashion_mnist", "lamb", [*LARS_RECIPE, "optim.base_lr=0.032", SPAN]),
        "fujitsu": fujitsu(epochs),
        "fujitsu_span32": fujitsu(epochs, SPAN),
        "fujitsu_span32_no_last_k": fujitsu(
            epochs, SPAN, "polish.last_epochs_without_augmentation=0"
        ),
        **brakes(epochs),
        **differences(epochs),
        **baseline_tuning(epochs),
        **ablation(epochs),
        **ema_rows(epochs),
    }


# rows read from another row's runs: top-1 before the BN refit (same runs, same LR schedule)
DERIVED = {
    "fujitsu_span32_no_refit": "fujitsu_span32",
    "fujitsu_span32_no_last_k_no_refit": "fujitsu_span32_no_last_k",
    "lars_no_refit": "lars",
    "chosen_no_refit": CHOSEN,
    **{f"{row}_no_refit": row for row in baseline_tuning(90)},  # row names do not vary with epochs
    **{f"{row}_no_refit": row for row in ema_rows(90)},
}
# rows read from an EMA row's runs (issue 54): the average's top-1 before and after its refit
EMA_DERIVED = {
    **{f"{row}_avg": (row, "ema_top1") for row in ema_rows(90)},
    **{f"{row}_avg_refit": (row, "ema_polished_top1") for row in ema_rows(90)},
}


def derived_json(stem: str, precision: str) -> dict:
    """A study JSON (``DERIVED_JSON``): its shipped base with some optimizer parameters changed."""
    base, params = DERIVED_JSON[stem]
    raw = json.loads((REPO / json_for(base, precision)).read_text())
    raw["optimizer"]["params"].update(params)
    raw["_comment"] = f"{json_for(base, precision)} with {params} (bench/accuracy_study.py)"
    return raw


def json_for(stem: str, precision: str, runs: Path | None = None) -> str:
    """The DeepSpeed JSON of a row: a shipped one, or (DERIVED_JSON) a copy of one with some
    optimizer parameters changed, written once under ``runs``."""
    if stem in DERIVED_JSON:
        out = (runs or REPO / "runs/accuracy_study") / f"{stem}_{precision}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(derived_json(stem, precision), indent=2) + "\n")
        return str(out)
    return (
        f"ds_configs/{precision}.json" if stem == "fp32" else f"ds_configs/{stem}_{precision}.json"
    )


PRECISIONS = ("fp32", "bf16", "fp16")


def json_settings(path: str) -> dict:
    """What a run's DeepSpeed JSON sets (its ``_comment`` left out), for telling runs apart by what
    they ran, not by a file name: read from the file, or, for a study JSON a new checkout lacks
    (written under runs/), derived again from its shipped base by its name; ``{"missing": name}``
    when neither can be."""
    file = Path(path) if Path(path).is_absolute() else REPO / path
    derivable = {f"{stem}_{p}.json": (stem, p) for stem in DERIVED_JSON for p in PRECISIONS}
    if file.is_file():
        raw = json.loads(file.read_text())
    elif file.name in derivable:
        raw = derived_json(*derivable[file.name])
    else:
        return {"missing": file.name}
    raw.pop("_comment", None)
    # the JSON's lr was never used where the config set optim.base_lr (every study row, through its
    # recipe), and since issue 53 no JSON may set it: runs recorded with one are the same runs
    raw.get("optimizer", {}).get("params", {}).pop("lr", None)
    return raw


def command(row: str, seed: int, args, run_dir: Path) -> list[str]:
    recipe, stem, overrides = grid_rows(args.grid, args.epochs)[row]
    # batch 128 is one micro batch (--micro is the large-batch rows' per-rank micro batch)
    micro = [] if "batch.global_size=128" in overrides else [f"batch.micro_per_rank={args.micro}"]
    cmd = (
        shlex.split(args.launcher) + ["dstrain/main.py"]
        if args.launcher
        else [sys.executable, "-m", "dstrain"]
    )
    return cmd + [
        "--config",
        recipe,
        "--deepspeed_config",
        json_for(stem, args.precision, run_dir.parent),
        f"epochs={args.epochs}",
        f"seed={seed}",
        f"model.width={args.width}",
        "model.channels_last=true",
        "data.augment=true",
        f"data.holdout={args.holdout}",
        "checkpoint.every_epochs=5",  # an interrupted grid continues from here (resume=auto)
        "checkpoint.keep_last=1",
        "resume=auto",
        "log.every_steps=50",
        "log.tensorboard=false",
        f"run_dir={run_dir}",
        *micro,
        *overrides,
        *args.extra,
    ]


# where a run lives and reads its data: not part of a row's definition (a GPU job's tree moves)
LOCATIONS = ("run_dir=", "data.root=")


def trainer_args(cmd: list[str]) -> list[str]:
    """The trainer's own arguments in a command: what follows ``dstrain`` or a script path."""
    start = next(i for i, a in enumerate(cmd) if a == "dstrain" or a.endswith(".py"))
    return [a for a in cmd[start + 1 :] if not a.startswith(LOCATIONS)]


def definition(trainer_argv: list[str], ds_settings: dict | None = None) -> dict:
    """What a run is, whatever words its command used: what its DeepSpeed JSON sets
    (:func:`json_settings`, or ``ds_settings`` as a report recorded them when the run ended) and
    the config the trainer builds from the recipe and the overrides (a later key=value wins, a
    value equal to the recipe's is no change), without the locations (``LOCATIONS``) and the
    recipe's default JSON path (the JSON the run was given is compared by content)."""
    from omegaconf import OmegaConf

    from dstrain.settings.config import load_config

    recipe, ds_json, overrides, rest = None, None, [], iter(trainer_argv)
    for arg in rest:
        if arg == "--config":
            recipe = next(rest)
        elif arg == "--deepspeed_config":
            ds_json = next(rest)
        elif not arg.startswith(LOCATIONS):
            overrides.append(arg)
    config = OmegaConf.to_container(load_config(recipe, overrides))
    config.pop("run_dir")
    config["data"].pop("root")
    recipe_json = config.pop("deepspeed_config")
    if ds_settings is None:
        ds_settings = json_settings(ds_json or recipe_json)
    else:  # as recorded: the JSON's lr left out as json_settings leaves it out
        ds_settings = json.loads(json.dumps(ds_settings))
        ds_settings.get("optimizer", {}).get("params", {}).pop("lr", None)
    return {"deepspeed_config": ds_settings, **config}


def _definition_or_none(record: dict) -> dict | None:
    from dstrain.settings.config import ConfigError

    try:
        return definition(
            trainer_args(shlex.split(record["command"])), record.get("deepspeed_settings")
        )
    except ConfigError:  # a recipe or key that no longer exists: not the same run
        return None


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changes(old: list[str], new: list[str], old_settings: dict | None = None) -> str | None:
    """``key: old -> new, ...`` between the runs two trainer argument lists define (``old``'s JSON
    as recorded, ``old_settings``, when given), or None when they define the same run."""
    from dstrain.settings.config import ConfigError

    try:
        before = _flat(definition(old, old_settings))
    except ConfigError as err:
        return f"its settings no longer load: {err}"
    after = _flat(definition(new))
    changed = [
        f"{key}: {before.get(key)} -> {after.get(key)}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    ]
    return ", ".join(changed) or None


def stored_differs(run_dir: Path, cmd: list[str]) -> str | None:
    """Why the run kept in ``run_dir`` is not this row as now defined, or None: a finished run is
    read, an interrupted one resumed, only if it is the same run."""
    meta = run_dir / "meta.json"
    if not meta.is_file():
        return None
    stored = json.loads(meta.read_text()).get("command") or []
    if not stored:
        return None
    changes = _changes(stored[1:], trainer_args(cmd))
    if changes is None:
        return None
    return (
        f"{run_dir}: kept from a run started with other settings ({changes}); the row is "
        f"defined differently now. Remove {run_dir} to train it again, or pass --runs DIR to "
        "keep both"
    )


def reported_runs(reports: list[str], jobs, args) -> tuple[dict, str | None]:
    """The finished runs that committed reports (``--reuse``) recorded for these jobs, by (row,
    seed), read instead of trained: runs/ is not committed, so a new checkout resumes a grid from
    its reports. A run recorded under the job's row must be that row as now defined (else the
    error is the message); a run recorded under another row is this job's when it is the same run
    (the same seed and definition: the chosen row's batch-4,096 run is ``target_b4096``'s)."""
    found: dict[tuple[str, int], dict] = {}
    recorded: list[tuple[str, dict]] = []
    for report in reports:
        try:
            runs = json.loads(Path(report).read_text())["runs"]
        except (OSError, ValueError, KeyError) as e:
            return {}, f"--reuse {report}: not a study report ({type(e).__name__}: {e})"
        recorded += [(report, rec) for rec in runs if rec.get("command")]
    theirs: dict[str, dict | None] = {}  # each recorded command's definition, built once
    for row, seed in jobs:
        new = trainer_args(command(row, seed, args, args.runs / f"{row}-{seed}"))
        for report, rec in recorded:
            if rec.get("row") != row or rec.get("seed") != seed:
                continue
            changes = _changes(
                trainer_args(shlex.split(rec["command"])), new, rec.get("deepspeed_settings")
            )
            if changes is not None:
                return {}, (
                    f"--reuse {report}: {row} seed {seed} was recorded with other settings "
                    f"({changes}); the row is defined differently now. Leave that report out "
                    "to train the row again"
                )
            found[row, seed] = rec
            break
        else:
            mine = definition(new)
            for report, rec in recorded:
                if rec.get("seed") != seed:
                    continue
                key = rec["command"] + json.dumps(rec.get("deepspeed_settings"))
                if key not in theirs:
                    theirs[key] = _definition_or_none(rec)
                if mine == theirs[key]:
                    same = f"{report}: {rec['row']} seed {seed}"
                    found[row, seed] = {**rec, "row": row, "same_run_as": same}
                    break
    return found, None


def train(row: str, seed: int, args, run_dir: Path, gpu: str | None = None) -> dict:
    """The run's summary: read from run_dir when it finished before, else trained now (on ``gpu``,
    as CUDA_VISIBLE_DEVICES, when given)."""
    done = run_dir / "summary.json"
    cmd = command(row, seed, args, run_dir)
    if finished(run_dir):
        summary = json.loads(done.read_text())
        summary["command"] = shlex.join(cmd)
    else:
        from bench.common import run_trainer

        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        summary = run_trainer(cmd, run_dir, env=env, what=f"{row} seed {seed}")
        del summary["stdout"]
    meta = run_dir / "meta.json"
    summary["git_sha"] = json.loads(meta.read_text()).get("git_sha") if meta.is_file() else None
    return summary


def finished(run_dir: Path) -> bool:
    """A run whose summary is kept (and that did not fail): read, not trained."""
    return (run_dir / "summary.json").is_file() and not (run_dir / "failed.json").exists()


def time_to(history: list[dict], target: float) -> float | None:
    """Training wall time (s, cumulative epoch times) until test top-1 first reaches target; None if never."""
    elapsed = 0.0
    for h in history:
        elapsed += h["epoch_time_s"]
        if h.get("val_top1", 0.0) >= target:
            return elapsed
    return None


def epochs_to(top1_per_epoch: list[float | None], target: float) -> int | None:
    """The first epoch (1-based) whose top-1 reaches target; None if none does."""
    for epoch, top1 in enumerate(top1_per_epoch, start=1):
        if top1 is not None and top1 >= target:
            return epoch
    return None


def _arg_after(command: str, flag: str) -> str:
    words = shlex.split(command)
    return words[words.index(flag) + 1]


def run_record(row: str, seed: int, s: dict) -> dict:
    hist = s["history"]
    final = s["polish"]["after"]["val_top1"] if "polish" in s else s["final_top1"]
    return {
        "row": row,
        "seed": seed,
        "final_top1": final,
        # training top-1 of the last epoch (augmented images, or not in the last K): beside the
        # test top-1 it tells under-fitting (both low) from over-fitting (train high, test low)
        "final_train_top1": hist[-1].get("train_top1"),
        "best_top1": max(s["best_top1"], final),
        "epochs": s["epochs"],
        "steps": s["steps"],
        "wall_s": s["wall_time_s"],
        "gpu_time_s": s["gpu_time_s"],
        "world_size": s["world_size"],
        "time_to_90": time_to(hist, 0.90),
        "time_to_92": time_to(hist, 0.92),
        "top1_per_epoch": [h.get("val_top1") for h in hist],
        "train_top1_per_epoch": [h.get("train_top1") for h in hist],
        "command": s["command"],
        # what the JSON set when the run was reported: a later report compares by it (a derived
        # JSON under runs/ is gone in a new checkout, a shipped one may have changed)
        "deepspeed_settings": json_settings(_arg_after(s["command"], "--deepspeed_config")),
        "git_sha": s.get("git_sha"),
        **({"before_polish": s["polish"]["before"]["val_top1"]} if "polish" in s else {}),
        **({"ema_top1": s["ema"]["final_top1"]} if "ema" in s else {}),
        **(
            {"ema_polished_top1": s["polish_ema"]["after"]["val_top1"]} if "polish_ema" in s else {}
        ),
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
    for name, (source, key) in EMA_DERIVED.items():
        out += [
            {**r, "row": name, "final_top1": r[key], "best_top1": r[key]}
            for r in records
            if r["row"] == source and key in r
        ]
    return out


def mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1 in the denominator; 0 for one value): the
    ± every table prints."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def gap_interval(row: list[float], reference: list[float]) -> tuple[float, float, float] | None:
    """(gap, low, high): ``row``'s mean minus ``reference``'s and its 95% interval (Welch's t: the
    two rows' variances are not assumed equal). None below two values a side (no spread to use)."""
    if len(row) < 2 or len(reference) < 2:
        return None
    from scipy.stats import t as student_t

    gap = statistics.mean(row) - statistics.mean(reference)
    v_row, v_ref = (
        statistics.variance(row) / len(row),
        statistics.variance(reference) / len(reference),
    )
    se = (v_row + v_ref) ** 0.5
    if se == 0:
        return gap, gap, gap
    df = (v_row + v_ref) ** 2 / (v_row**2 / (len(row) - 1) + v_ref**2 / (len(reference) - 1))
    half = float(student_t.ppf(0.975, df)) * se
    return gap, gap - half, gap + half


def gaps(records: list[dict], rows: list[str], reference: str = "baseline") -> dict:
    """Each row's final top-1 gap to ``reference`` in points, with its 95% interval (Welch) and the
    seeds on each side: what the report prints and the docs link to."""
    ref = [100 * r["final_top1"] for r in records if r["row"] == reference]
    out = {}
    for row in rows:
        values = [100 * r["final_top1"] for r in records if r["row"] == row]
        if not values or row == reference or not ref:
            continue
        found = gap_interval(values, ref)
        out[row] = {
            "gap_pt": statistics.mean(values) - statistics.mean(ref),
            "ci95_pt": list(found[1:]) if found else None,
            "seeds": len(values),
            "reference_seeds": len(ref),
        }
    return out


def largest_dip(top1_per_epoch: list[float | None]) -> float:
    """How far (pt) top-1 ever fell below the best of the epochs before it: a spike, recovered
    from or not, shows here even when the final top-1 hides it."""
    best, dip = None, 0.0
    for top1 in top1_per_epoch:
        if top1 is None:
            continue
        if best is not None:
            dip = max(dip, 100 * (best - top1))
        best = top1 if best is None else max(best, top1)
    return dip


def worst_seed_choice(records: list[dict], rows: list[str]) -> list[str]:
    """The row whose worst seed is best (issue 39: a recipe is chosen by the worst of its seeds,
    not by one seed or the mean), among rows with the most seeds."""
    by_row = {
        row: [100 * r["final_top1"] for r in records if r["row"] == row]
        for row in rows
        # a batch-128 row without its refit is a recipe of its own (the refit is one of the
        # techniques the baseline may take or leave: issue 52)
        if (row not in DERIVED or row.startswith("b128_")) and row != "baseline"
    }
    by_row = {row: v for row, v in by_row.items() if v}
    if len(by_row) < 2:
        return []
    most = max(len(v) for v in by_row.values())
    full = {row: v for row, v in by_row.items() if len(v) == most}
    best = max(full, key=lambda row: min(full[row]))
    worst = min(full[best])
    partial = sorted(set(by_row) - set(full))
    # a row's worst of all its seeds is at most the worst of those it has: below the chosen row's
    # worst seed already, more seeds cannot make it the choice
    out = [row for row in partial if min(by_row[row]) < worst]
    open_ = [row for row in partial if row not in out]
    return [
        f"Chosen by the worst of {most} seeds: {best} (worst seed {worst:.2f}%, mean "
        f"{statistics.mean(full[best]):.2f}%)"
        + (
            f"; ruled out with fewer seeds (a seed already below {worst:.2f}%): {', '.join(out)}"
            if out
            else ""
        )
        + (f"; not compared, fewer seeds: {', '.join(open_)}" if open_ else "")
        + "."
    ]


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


def table(records: list[dict], rows: list[str], reference: str = "baseline") -> list[str]:
    """Mean ± sample sd per row, its worst seed and largest dip, the distance to the reference
    row's mean final top-1 and that gap's 95% interval (Welch)."""
    ref = [100 * r["final_top1"] for r in records if r["row"] == reference]
    intervals = gaps(records, rows, reference)
    lines = [
        "| row | final top-1 % (mean ± sample sd) | worst seed % | largest dip (pt) | "
        "vs baseline (pt) | train top-1 % | best top-1 % | epochs | steps | wall s | GPU-time s | "
        "s to 90% | s to 92% | seeds | gap's 95% interval (pt, Welch) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {row} | {f:.2f} ± {fs:.2f} | {min(100 * r['final_top1'] for r in rs):.2f} | "
            f"{max(largest_dip(r.get('top1_per_epoch') or []) for r in rs):.1f} | "
            f"{gap} | {train} | {b:.2f} ± {bs:.2f} | {rs[0]['epochs']} | "
            f"{rs[0]['steps']} | {statistics.mean(r['wall_s'] for r in rs):.0f} | "
            f"{statistics.mean(r['gpu_time_s'] for r in rs):.0f} | {reach('time_to_90')} | "
            f"{reach('time_to_92')} | {len(rs)} | {interval_cell(intervals.get(row))} |"
        )
    return lines


def interval_cell(gap: dict | None) -> str:
    if gap is None or gap["ci95_pt"] is None:
        return "-"
    low, high = gap["ci95_pt"]
    return f"{low:+.2f} to {high:+.2f}"


FASHION_MNIST_TRAIN, IMAGENET_TRAIN = 60_000, 1_281_167  # training images: share per step


def _batch(record: dict) -> int:
    return int(record["row"].split("_b")[-1])


def reached(
    records: list[dict],
    targets: list[float],
    reference: list[dict] | None = None,
    train_images: int = FASHION_MNIST_TRAIN,
) -> list[dict]:
    """Per target level and row, the epochs to reach it and the ratio to the reference's: the goal's
    batch-128 runs (``reference``; their mean, where every seed reached it) as row ``baseline``,
    else the smallest batch's run. Written into the report (``epochs_to_target``), so the docs can
    name each value: ``epochs_to_target[level=0.9,row=target_b4096].ratio``; ``share``: the batch's
    share of the training set per step."""
    grid = sorted(records, key=_batch)
    out = []
    for t in targets:
        if reference:
            seeds = [epochs_to(r["top1_per_epoch"], t) for r in reference]
            base = statistics.mean(seeds) if all(seeds) else None
            final = statistics.mean(r.get("final_top1", 0.0) for r in reference)
            out.append(
                {
                    "level": t,
                    "row": "baseline",
                    "batch": 128,
                    "share": 128 / train_images,
                    "seed_epochs": seeds,
                    "epochs": base,
                    "ratio": 1.0 if base else None,
                    "final_top1": final,
                }
            )
        else:
            base = epochs_to(grid[0]["top1_per_epoch"], t) if grid else None
        for r in grid:
            e = epochs_to(r["top1_per_epoch"], t)
            out.append(
                {
                    "level": t,
                    "row": r["row"],
                    "batch": _batch(r),
                    "share": _batch(r) / train_images,
                    "epochs": e,
                    "ratio": e / base if e and base else None,
                    "final_top1": r.get("final_top1"),
                    "epochs_run": r.get("epochs"),
                }
            )
    return out


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
    fig.savefig(out / f"{name}_curves.png", dpi=120)
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
    fig.savefig(out / f"{name}_ablation.png", dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=("study", "target"), default="study")
    p.add_argument("--rows", nargs="+", help="a subset of the grid's rows (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=90)
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
        help="runs at a time (sharing the GPU on a GPU node); each gets cores/N torch threads",
    )
    p.add_argument(
        "--gpus",
        nargs="+",
        default=[],
        help="spread the runs over these GPUs, round robin (CUDA_VISIBLE_DEVICES); default: all "
        "runs see every GPU and use the first",
    )
    p.add_argument(
        "--holdout",
        type=int,
        default=0,
        help="tune: evaluate on this many held-out training images (data.holdout), not the test set",
    )
    p.add_argument("--target", type=float, help="grid target: top-1 to reach (fraction)")
    p.add_argument(
        "--target-from",
        help="grid target: a study's .json; target = its baseline final top-1 minus 0.3 pt, and its "
        "baseline runs (batch 128, SGD) are the reference row the ratios are taken against",
    )
    p.add_argument(
        "--extra-targets",
        type=float,
        nargs="*",
        default=[],
        help="grid target: more top-1 levels to count epochs to (fractions), e.g. a fixed level "
        "below every row's final top-1, as MLPerf's 75.9%% is",
    )
    p.add_argument(
        "--across-commits",
        nargs="+",
        default=[],
        metavar="SHA",
        help="compare runs made at these commits although dstrain/ changed between them (each "
        "named, 7 characters or more); without it such a report is refused",
    )
    p.add_argument("--runs", help="where runs are kept (default runs/accuracy_study/<grid>-...)")
    p.add_argument("--out", default=str(REPO / "docs/results"))
    p.add_argument("--name", help="result file stem (default from grid, epochs, holdout)")
    p.add_argument("--extra", nargs="*", default=[], help="more trainer overrides for every run")
    p.add_argument(
        "--reuse",
        nargs="+",
        default=[],
        metavar="REPORT",
        help="study reports (.json) whose finished runs are read, not trained, when runs/ lacks "
        "them (a new checkout); each must be the row as defined now",
    )
    p.add_argument(
        "--baseline",
        default="baseline",
        help="the batch-128 row the gaps, their intervals and the goal are taken against "
        "(issue 52: the tuned b128_lr0.4_tail; default: the untuned baseline)",
    )
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="report the runs that have finished, train none (a grid still running elsewhere); "
        "the report names the others",
    )
    args = p.parse_args(argv)
    rows = grid_rows(args.grid, args.epochs)
    unknown = [r for r in args.rows or [] if r not in rows]
    if unknown:
        p.error(f"--rows {' '.join(unknown)}: not in grid {args.grid} ({', '.join(rows)})")
    args.rows = args.rows or list(rows)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be >= 1")
    suffix = f"{args.epochs}ep" + (f"_holdout{args.holdout}" if args.holdout else "")
    stem = "accuracy_study" if args.grid == "study" else "epochs_to_target"
    args.name = args.name or f"{stem}_{suffix}"
    args.runs = Path(args.runs or REPO / "runs" / "accuracy_study" / f"{args.grid}-{suffix}")
    args.reference = []  # the goal's batch-128 runs (the study's baseline), when read from one
    if args.grid == "target" and (args.target is None or args.target_from):
        source = Path(args.target_from or Path(args.out) / f"accuracy_study_{suffix}.json")
        if not source.is_file():
            p.error(f"--grid target needs --target or a study result to take it from ({source})")
        args.reference = [
            r for r in json.loads(source.read_text())["runs"] if r["row"] == "baseline"
        ]
        if not args.reference:
            p.error(f"{source} has no baseline runs to take the target from")
        if args.target is None:
            args.target = statistics.mean(r["final_top1"] for r in args.reference) - 0.003
    args.threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.common import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def one(job):
        index, (row, seed) = job
        gpu = args.gpus[index % len(args.gpus)] if args.gpus else None
        s = train(row, seed, args, args.runs / f"{row}-{seed}", gpu)
        rec = run_record(row, seed, s)
        print(
            f"{row:28s} seed {seed}: final top-1 {100 * rec['final_top1']:.2f}%  "
            f"({rec['wall_s']:.0f} s, git {str(rec['git_sha'])[:7]})",
            flush=True,
        )
        return rec

    jobs = [(row, seed) for row in args.rows for seed in args.seeds]
    for row, seed in jobs:  # before anything trains: a kept run must be the row as defined now
        run_dir = args.runs / f"{row}-{seed}"
        why = stored_differs(run_dir, command(row, seed, args, run_dir))
        if why:
            print(f"accuracy_study: error: {why}", file=sys.stderr)
            return 2
    reported, why = reported_runs(args.reuse, jobs, args)
    if why:
        print(f"accuracy_study: error: {why}", file=sys.stderr)
        return 2
    # a run finished in runs/ is read from there; one only a report has, from the report
    reported = {j: r for j, r in reported.items() if not finished(args.runs / f"{j[0]}-{j[1]}")}
    for (row, seed), rec in reported.items():
        print(
            f"{row:28s} seed {seed}: final top-1 {100 * rec['final_top1']:.2f}%  (from --reuse"
            + (f", the same run as {rec['same_run_as']})" if "same_run_as" in rec else ")")
        )
    pending = []
    if args.finished_only:  # a report of a grid still running elsewhere: train nothing
        pending = [
            job
            for job in jobs
            if job not in reported and not finished(args.runs / f"{job[0]}-{job[1]}")
        ]
        jobs = [job for job in jobs if job not in pending]
        if not jobs:
            print(
                "accuracy_study: error: --finished-only: no run has finished yet", file=sys.stderr
            )
            return 2
    trained = [job for job in jobs if job not in reported]
    # before training: the recorded runs and those about to train at this commit
    now = provenance("accuracy_study.py", argv)["git_sha"]
    planned = [str(r.get("git_sha")) for r in reported.values()] + [now] * bool(trained)
    if refuse_mixed_code(code_between(planned), args.across_commits):
        return 2
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process
        done = dict(zip(trained, pool.map(one, enumerate(trained)), strict=True))
    records = [reported.get(job) or done[job] for job in jobs]
    code = code_between([str(r.get("git_sha")) for r in records])
    if refuse_mixed_code(code, args.across_commits):
        return 2
    records += derived(records)
    rows = [
        *args.rows,
        *[d for d in [*DERIVED, *EMA_DERIVED] if any(r["row"] == d for r in records)],
    ]
    rcps = mlperf_rcps() if args.grid == "target" else None
    meta = {
        **provenance("accuracy_study.py", argv),
        "grid": args.grid,
        "epochs": args.epochs,
        "width": args.width,
        "precision": args.precision,
        "holdout": args.holdout,
        "launcher": args.launcher or "python -m dstrain",
        "seeds": args.seeds,
        "jobs": args.jobs,
        "threads_per_run": args.threads or None,
        "grid_wall_s": time.perf_counter() - t0,
        "run_git_shas": sorted({str(r["git_sha"]) for r in records}),
        "code_between_runs": code,
        "sd": "sample standard deviation (n - 1): the ± of every table",
        # a list, so that a doc can select a row whose name holds a dot (fujitsu_span32_bn_lr0.1)
        "gaps_vs_baseline": [
            {
                "row": row,
                **gap,
                "ci95_low_pt": (gap["ci95_pt"] or [None])[0],
                "ci95_high_pt": (gap["ci95_pt"] or [None, None])[1],
            }
            for row, gap in gaps(records, rows, args.baseline).items()
        ],
        "baseline_row": args.baseline,
        "pending": [f"{row} seed {seed}" for row, seed in pending],
        **(
            {
                "target": args.target,
                "extra_targets": args.extra_targets,
                "reference": args.target_from,
                "epochs_to_target": reached(
                    records,
                    [args.target, *args.extra_targets],
                    args.reference,
                    FASHION_MNIST_TRAIN - args.holdout,
                ),
            }
            if args.grid == "target"
            else {}
        ),
        **({"mlperf_rcps": rcps} if args.grid == "target" else {}),
    }
    (out / f"{args.name}.json").write_text(json.dumps({**meta, "runs": records}, indent=2) + "\n")
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
        *(
            [*choice, ""]
            if args.grid == "study" and (choice := worst_seed_choice(records, rows))
            else []
        ),
        f"![top-1 per epoch]({args.name}_curves.png)",
        "",
        f"![rows]({args.name}_ablation.png)",
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(md))
    plots(records, out, args.name, rows)
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
