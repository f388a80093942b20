"""Large-batch accuracy study on Fashion-MNIST at the records' step budget: batch 128 vs batch 4,096.

    .venv/bin/python results/harness/accuracy_study.py --epochs 90 --jobs 6             # the grid on a GPU node
    .venv/bin/python results/harness/accuracy_study.py --epochs 30 --jobs 2             # the CPU stand-in
    .venv/bin/python results/harness/accuracy_study.py --grid target --epochs 90 --seeds 0 --jobs 6   # epochs-to-target
    .venv/bin/python results/harness/accuracy_study.py --holdout 6000 --rows fujitsu_span --extra optim.base_lr=4
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
  chosen_b4096     the chosen batch-4,096 row at the peak LR its 90-epoch held-out tuning chose (20),
                   the recipe's 40% warmup
  chosen_b4096_warmup27  the same with the warmup that tuning chose, 30% of the epochs (27 of 90;
                   issue 52, item 2's batch-4,096 row)
  chosen_<change>  one change each from the chosen batch-4,096 row (issue 52, item 4): no_ls, no_tail,
                   ramp (2,048 through the warmup, then 4,096), b8192 (LARS at 8,192), b8192_lamb
                   (LAMB at 8,192); chosen_no_refit reads the chosen row's runs before the refit
  noise_follow, noise_mikami, chosen_b8192_warmup27   issue 73, item 4: from 2,048 to 8,192 at LR 20
                   and 4,096's warmup, the batch doubling where the measured B_noise passed it
                   (batch.follow_noise), or on Mikami's fixed ramp (4,096 at half the warmup,
                   8,192 after it); the fixed 8,192 at the same LR and warmup
  t3_*             issue 74 (epochs counted in images, data.last_batch=fill): t3_baseline (the
                   tuned batch 128), and at 4,096 and 8,192 the chosen LARS row (t3_lars_b*) and the
                   same schedule with Muon, SOAP or Nesterov SGD (t3_muon_b*, t3_soap_b*,
                   t3_nesterov_b*), at first-screen LRs (--extra optim.base_lr=... for the ladder)
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

A knob of the DeepSpeed JSON is turned with ``--json-set KEY=VALUE ...`` (optimizer parameters,
e.g. ``momentum=0.9 trust_coefficient=0.005``): each row's JSON is copied with them set, named
``<stem>+momentum=0.9_<precision>.json`` beside the runs, a name a new checkout derives it from.

Runs are kept in ``--runs`` (default runs/accuracy_study/<grid>-<epochs>ep[_holdoutN]/<row>-<seed>);
a run whose summary.json exists is read, not retrained, and an interrupted one resumes from its last
checkpoint (every 5 epochs, ``resume=auto``), so a grid stopped (or split across machines) continues
where it stopped; each run records the git SHA it started at, shown in the report. runs/ is not
committed: ``--reuse REPORT.json ...`` reads the finished runs a committed report recorded (a new
checkout continues a grid from its reports; a recorded run of another definition is refused). Runs
are compared by what they are (the config the trainer builds, the JSON's name), not by the words of
their commands: a run recorded under another row counts when it is the same run.

Writes <name>.json (every run's history), <name>.csv, <name>.md and plots (<name>_curves.png,
<name>_ablation.png) under --out (default results/studies), name = accuracy_study_<epochs>ep or
epochs_to_target_<epochs>ep (+ _holdout when tuning).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from results.harness.study.commits import code_between, refuse_mixed_code  # noqa: E402
from results.harness.study.definition import (  # noqa: E402
    changes_between,
    definition,
    definition_or_none,
    trainer_args,
)
from results.harness.study.report import mlperf_rcps, write  # noqa: E402
from results.harness.study.rows import (  # noqa: E402
    DERIVED,
    EMA_DERIVED,
    grid_rows,
    json_for,
    json_settings,
    set_in_stem,
)
from results.harness.study.stats import (  # noqa: E402
    FASHION_MNIST_TRAIN,
    gaps,
    reach_gaps,
    reached,
    time_to,
)


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
        json_for(set_in_stem(stem, args.json_set), args.precision, run_dir.parent),
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


def stored_differs(run_dir: Path, cmd: list[str]) -> str | None:
    """Why the run kept in ``run_dir`` is not this row as now defined, or None: a finished run is
    read, an interrupted one resumed, only if it is the same run."""
    meta = run_dir / "meta.json"
    if not meta.is_file():
        return None
    stored = json.loads(meta.read_text()).get("command") or []
    if not stored:
        return None
    changes = changes_between(trainer_args(stored), trainer_args(cmd))
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
    for row, seed in jobs:
        new = trainer_args(command(row, seed, args, args.runs / f"{row}-{seed}"))
        for report, rec in recorded:
            if rec.get("row") != row or rec.get("seed") != seed:
                continue
            changes = changes_between(
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
                if mine == definition_or_none(rec):  # built once per record (the module's cache)
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
        # the optimizer steps done at each epoch's end: steps to a target where the batch varies
        "step_per_epoch": [h.get("step") for h in hist],
        "train_top1_per_epoch": [h.get("train_top1") for h in hist],
        # the gradient noise scale at each epoch's end beside the loss it was measured at (runs
        # with log.noise_scale and two batch sizes; None before it was measured)
        "train_loss_per_epoch": [h.get("train_loss") for h in hist],
        "noise_scale_per_epoch": [h.get("noise_scale") for h in hist],
        **({"noise_scale": s["noise_scale"]} if "noise_scale" in s else {}),
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
    p.add_argument("--out", default=str(REPO / "results/studies"))
    p.add_argument("--name", help="result file stem (default from grid, epochs, holdout)")
    p.add_argument("--extra", nargs="*", default=[], help="more trainer overrides for every run")
    p.add_argument(
        "--json-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="optimizer parameters changed in every row's DeepSpeed JSON (e.g. momentum=0.9 "
        "weight_decay=1e-4): a copy named by them is written beside the runs",
    )
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
    try:
        set_in_stem("", args.json_set)
    except ValueError as e:
        p.error(str(e))
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
    from bench.common import stop_signals_forwarded

    with stop_signals_forwarded():  # its trainers run from worker threads (--jobs)
        return study(args, argv)


def study(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Train (or read) every row's seeds, then write the report."""
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
    now = provenance("results/harness/accuracy_study.py", argv)["git_sha"]
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
        **provenance("results/harness/accuracy_study.py", argv),
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
        # epochs and steps to 90% against the baseline row, each gap with its Welch interval
        "reach_vs_baseline": reach_gaps(records, rows, args.baseline),
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
    print("\n".join(write(out, args, meta, records, rows, code, pending, rcps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
