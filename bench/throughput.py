"""ResNet-50 training throughput on one GPU: dstrain (synthetic data, DALI) vs a bare PyTorch loop, side by side.

    .venv/bin/python bench/throughput.py              # on a GPU node -> results/bench/throughput_<gpu>.{json,md}
    .venv/bin/python bench/throughput.py --model resnet18 --batch 16 --image-size 64 --warmup-steps 4 \\
        --epochs 2 --dali-images 64 --out /tmp/tp.json                    # CPU smoke run (fp32)

One run measures every combination on the same device, one after the other:
  bare     torchvision resnet50 + torch.autocast (fp16 with a GradScaler, or bf16; none for fp32) + torch.optim.SGD
           (nesterov momentum 0.9, as the shipped JSONs), one fixed synthetic batch on the device,
           cudnn.benchmark; no DeepSpeed, no data loading: the ceiling for this model on this GPU
  dstrain  the real trainer (``python -m dstrain --config imagenet_resnet50``) with ds_configs/fp16.json or
           bf16.json, either ``data.loader=synthetic`` (random device batches) or ``data.loader=dali``
           (GPU JPEG decode + random-resized crop + flip from a generated folder of ImageNet-like 500x375 JPEGs)
for precision fp16 and bf16 and channels_last on and off. dstrain's images/s come from the run's own
summary.json: images of the timed epochs / their training time (``train_s``, evaluation excluded).

A pair is measured alike on both sides: ``--warmup-steps`` untimed steps (compilation, cuDNN
autotuning, DALI start-up), then ``(--epochs - 1) x --warmup-steps`` timed steps: dstrain's
untimed first epoch is that many steps (its synthetic epoch is ``--warmup-steps x --batch``
images), the bare loop runs the same counts. With ``--repeats`` the order within a pair alternates:
bare twin first in repeats 0, 2, ..., dstrain first in 1, 3, ... (each row records its
``order``); the DALI rows' epoch is their JPEG folder (``--dali-images``). Each row records the
steps it warmed up and timed. Every number is images/s per GPU (one process, one GPU).

References (METHODS.md): 2,470 img/s on one A100 (NVIDIA's PyTorch example, AMP), ~7,160 img/s per H100
(NVIDIA's MLPerf MXNet stack). On a CPU the default is fp32 only; fp16_native needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
REFERENCES = {"A100 (NVIDIA PyTorch example, AMP)": 2470, "H100 (NVIDIA MLPerf MXNet)": 7160}
# --precisions name -> (what the table says, the DeepSpeed JSON dstrain runs, the bare twin's autocast)
PRECISIONS = {
    "fp32": ("fp32", "fp32.json", "fp32"),
    "fp16": ("fp16 (autocast + GradScaler)", "fp16.json", "fp16"),
    "bf16": ("bf16 (autocast)", "bf16.json", "bf16"),
    "fp16_native": ("fp16 (DeepSpeed's native engine)", "fp16_native.json", "fp16"),
}


@dataclass
class BareTwin:
    """The plain PyTorch AMP loop's parts: model, optimizer, scaler, autocast dtype, one batch."""

    model: object
    opt: object
    scaler: object
    dtype: object  # torch.float16 / torch.bfloat16, or None (fp32)
    x: object
    y: object


def bare_twin(
    model_name: str,
    precision: str,
    channels_last: bool,
    batch: int,
    side: int,
    device,
    compile_mode: str | None = None,
) -> BareTwin:
    """The bare loop's set-up (bench/profile_step.py profiles the same): torchvision model, the
    shipped JSONs' SGD, a GradScaler for fp16, one fixed device batch; ``compile_mode``: compiled."""
    import torch
    import torchvision

    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision.models.get_model(model_name, weights=None, num_classes=1000).to(
        device, memory_format=fmt
    )
    # the shipped JSONs' SGD (ds_configs/bf16.json ...): nesterov momentum 0.9, weight decay 5e-5
    opt = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, nesterov=True
    )
    if compile_mode:
        model.compile(mode=compile_mode)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)  # None: fp32
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    x = torch.randn(batch, 3, side, side, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (batch,), device=device)
    return BareTwin(model, opt, scaler, dtype, x, y)


def bare_loop(
    model_name: str,
    precision: str,
    channels_last: bool,
    batch: int,
    side: int,
    warmup: int,
    steps: int,
    device,
    compile_mode: str | None = None,
) -> float:
    """images/s of the plain PyTorch AMP loop on one fixed device batch (``compile_mode``: torch.compile
    it; the warm-up steps absorb the compilation)."""
    import torch
    import torch.nn.functional as F

    twin = bare_twin(model_name, precision, channels_last, batch, side, device, compile_mode)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in range(warmup + steps):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=twin.dtype, enabled=twin.dtype is not None):
            loss = F.cross_entropy(twin.model(twin.x), twin.y)
        twin.opt.zero_grad(set_to_none=True)
        twin.scaler.scale(loss).backward()
        twin.scaler.step(twin.opt)
        twin.scaler.update()
    sync()
    seconds = time.perf_counter() - t0
    del twin, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return batch * steps / seconds


def twin_overrides(
    model: str, channels_last: bool, compiled: bool, compile_mode: str, image_size: int, batch: int
) -> list[str]:
    """The trainer settings that make dstrain's run the bare twin's (model, layout, compile, image
    size, one batch per step on one rank, no warmup) and keep it to training (no checkpoints, no
    TensorBoard); bench/profile_step.py builds the same run."""
    return [
        f"model.name={model}",
        f"model.channels_last={str(channels_last).lower()}",
        f"model.compile={str(compiled).lower()}",
        f"model.compile_mode={compile_mode}",
        f"data.image_size={image_size}",
        f"data.val_resize={image_size}",
        f"batch.global_size={batch}",
        f"batch.micro_per_rank={batch}",
        f"batch.eval_per_rank={batch}",
        "optim.warmup_epochs=0",
        "checkpoint.every_epochs=0",
        "checkpoint.keep_last=1",
        "log.tensorboard=false",
    ]


def dstrain_run(
    loader: str,
    precision: str,
    channels_last: bool,
    compiled: bool,
    args,
    folder: Path | None,
    tmp: Path,
    repeat: int = 0,
) -> dict:
    run_dir = tmp / f"{loader}-{precision}-cl{int(channels_last)}-c{int(compiled)}-r{repeat}"
    data = (
        [
            "data.loader=synthetic",
            # the untimed first epoch is the pair's warm-up
            f"data.synthetic_train_size={args.warmup_steps * args.batch}",
            f"data.synthetic_val_size={args.batch}",
        ]
        if loader == "synthetic"
        else ["data.loader=dali", f"data.root={folder}", f"data.num_workers={args.dali_threads}"]
    )
    cmd = [
        sys.executable,
        "-m",
        "dstrain",
        "--config",
        "imagenet_resnet50",
        "--deepspeed_config",
        f"ds_configs/{PRECISIONS[precision][1]}",
        f"epochs={args.epochs}",
        f"eval_every_epochs={args.epochs}",
        *twin_overrides(
            args.model, channels_last, compiled, args.compile_mode, args.image_size, args.batch
        ),
        "log.every_steps=1000",
        f"run_dir={run_dir}",
        *data,
    ]
    from bench.common import run_trainer

    history = run_trainer(cmd, run_dir, what=f"dstrain {loader} {precision} compile={compiled}")[
        "history"
    ]
    hist = history[1:]  # epoch 1 untimed: the warm-up
    images = sum(h["steps_per_epoch"] * h["global_batch"] for h in hist)
    return {
        "images_per_s": images / sum(h["train_s"] for h in hist),
        "timed_images": images,
        "warmup_steps": history[0]["steps_per_epoch"],
        "timed_steps": sum(h["steps_per_epoch"] for h in hist),
        "command": shlex.join(cmd[1:]).replace(str(tmp), "$TMP"),
    }


def environment(device) -> dict:
    import deepspeed
    import torch
    import torchvision

    try:
        import nvidia.dali as dali

        dali_version = dali.__version__
    except ImportError:
        dali_version = None
    from dstrain.core.provenance import record

    where = {k: v for k, v in record("").items() if k != "command"}  # git SHA, date, versions
    return {
        **where,
        "device": torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "deepspeed": deepspeed.__version__,
        "dali": dali_version,
        "cuda": torch.version.cuda,
    }


def markdown(result: dict) -> str:
    env, rows = result["environment"], result["rows"]
    lines = [
        f"# ResNet training throughput: {env['device']}",
        "",
        f"`{result['command']}` at git {env['git_sha']}, {env['date']}; torch {env['torch']}, DeepSpeed "
        f"{env['deepspeed']}, DALI {env['dali']}, CUDA {env['cuda']}. Model {result['model']}, batch "
        f"{result['batch']} per GPU, {result['image_size']} px. Images/s per GPU.",
        "",
    ]
    if result.get("warmup_steps"):
        lines += [
            f"Both loops of a pair: {result['warmup_steps']} untimed warm-up steps, then "
            f"{result['timed_steps']} timed steps (each row's own counts in the JSON).",
            "",
        ]
    if any(p["repeats"] > 1 for p in result.get("pairs", [])):
        lines += [
            "Each pair measured repeatedly, its order alternating (bare twin first in even repeats, "
            "dstrain first in odd ones): the median of the per-repeat ratios (each dstrain run "
            "against the twin of its repeat, measured next to it) and their range.",
            "",
            "| data | precision | channels_last | torch.compile | repeats | bare images/s (median) "
            "| dstrain images/s (median) | vs bare twin (median) | range |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for pair in result["pairs"]:
            lines.append(
                f"| {pair['data']} | {PRECISIONS[pair['precision']][0]} | "
                f"{'on' if pair['channels_last'] else 'off'} | {'on' if pair['compile'] else 'off'} | "
                f"{pair['repeats']} | {pair['bare_images_per_s']:.0f} | {pair['images_per_s']:.0f} | "
                f"{pair['vs_bare']:.3f}x | {pair['vs_bare_min']:.3f}-{pair['vs_bare_max']:.3f}x |"
            )
        lines += ["", "Every run:", ""]
    lines += [
        "| loop | data | precision | channels_last | torch.compile | repeat | images/s | vs bare twin "
        "(same precision, layout, compile) | DALI vs synthetic data (same settings) | order |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['vs_bare']:.2f}x" if r.get("vs_bare") else "-"
        fed = f"{r['vs_synthetic']:.2f}x" if r.get("vs_synthetic") else "-"
        lines.append(
            f"| {r['loop']} | {r['data']} | {PRECISIONS[r['precision']][0]} | "
            f"{'on' if r['channels_last'] else 'off'} | {'on' if r['compile'] else 'off'} | "
            f"{r.get('repeat', 0)} | {r['images_per_s']:.0f} | {ratio} | {fed} | "
            f"{r.get('order', '-')} |"
        )
    lines += ["", *(f"Not run: {n}" for n in result.get("not_run", []))]
    lines += [
        f"Failed: {f['row']}: {f['error'].strip().splitlines()[-1]}"
        for f in result.get("failed", [])
    ]
    if len(result.get("git_shas", [])) > 1:
        lines += [
            "",
            "Rows from commits " + ", ".join(result["git_shas"]) + " (each row's `git_sha` "
            "in the JSON; a ratio compares a row with its twin of the same commit).",
        ]
    if not result.get("complete", True):
        lines += ["", "Incomplete: `--resume` measures the rows missing from this table."]
    lines += [
        "",
        "References: " + "; ".join(f"{k}: {v:,} img/s" for k, v in REFERENCES.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The settings, checked; ``timed_steps`` and the ``--rows`` grid (or None) derived."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="torchvision model name")
    p.add_argument("--batch", type=int, default=256, help="images per step per GPU")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument(
        "--precisions",
        nargs="+",
        default=None,
        choices=tuple(PRECISIONS),
        help="default: fp16 bf16 fp16_native on a GPU, fp32 on a CPU (bf16 and fp16 autocast run "
        "there too, but a CPU without AVX-512 BF16/FP16 emulates them ~20x slower than fp32; "
        "fp16_native needs a GPU)",
    )
    p.add_argument(
        "--loaders", nargs="+", default=["synthetic", "dali"], choices=("synthetic", "dali")
    )
    p.add_argument("--channels-last", nargs="+", default=["on", "off"], choices=("on", "off"))
    p.add_argument(
        "--compile",
        nargs="+",
        default=["off", "on"],
        choices=("off", "on"),
        help="torch.compile rows (bare: model.compile; dstrain: model.compile=true)",
    )
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    p.add_argument(
        "--dali-images", type=int, default=6400, help="JPEGs generated for the DALI runs"
    )
    p.add_argument(
        "--dali-root",
        default="",
        help="the DALI rows' JPEG folder (completed to --dali-images; default: a temporary one)",
    )
    p.add_argument(
        "--dali-threads", type=int, default=8, help="DALI CPU threads (data.num_workers)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=50,
        help="untimed steps before the timed ones, the same on both sides of a pair: the bare "
        "loop's first steps and dstrain's first epoch (--warmup-steps x --batch synthetic images); "
        "compilation and cuDNN autotuning happen in them",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=3,
        help="dstrain epochs; all but the first are timed, and the bare loop times as many steps: "
        "(--epochs - 1) x --warmup-steps",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each pair this many times, the order alternating: bare twin first in repeat "
        "0, dstrain first in repeat 1, ... (the table gives each pair's median ratio and its range: "
        "one run each cannot tell 0.94x from 0.96x)",
    )
    for gone in ("--images", "--bare-steps", "--bare-warmup"):
        p.add_argument(gone, help=argparse.SUPPRESS)
    p.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no row that would end past this many seconds (estimate: the slowest row so "
        "far); the rows left are listed as not run (0: no limit)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in --out (same model, batch, size) and measure the rest; a row "
        "that failed is kept as failed, not retried (run without --resume to retry it)",
    )
    p.add_argument(
        "--rows",
        nargs="+",
        metavar="PRECISION:LAYOUT:COMPILE",
        help="only these rows, in this order, e.g. bf16:nhwc:on bf16:nchw:off (each with its bare "
        "twin; LAYOUT nhwc = channels_last, nchw; COMPILE on/off); default: the whole grid",
    )
    p.add_argument(
        "--out",
        default="",
        help="result JSON (default results/bench/throughput_<device>.json; "
        "a .md table is written next to it)",
    )
    args = p.parse_args(argv)
    if any(v is not None for v in (args.images, args.bare_steps, args.bare_warmup)):
        p.error(
            "--images, --bare-steps and --bare-warmup are gone: both loops of a pair warm up "
            "--warmup-steps steps and time (--epochs - 1) x --warmup-steps steps"
        )
    if args.epochs < 2:
        raise SystemExit("--epochs must be >= 2: the first epoch is not timed")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_steps < 1:
        raise SystemExit(f"--warmup-steps must be >= 1, got {args.warmup_steps}")
    args.timed_steps = (args.epochs - 1) * args.warmup_steps
    args.grid = [parse_row(row, p) for row in args.rows] if args.rows else None
    return args


def main() -> int:
    args = parse_args()
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precisions = args.precisions or (
        ["fp16", "bf16", "fp16_native"] if device.type == "cuda" else ["fp32"]
    )
    if "fp16_native" in precisions and device.type != "cuda":
        raise SystemExit(
            "--precisions fp16_native needs a GPU (DeepSpeed's native fp16 engine is CUDA-only); "
            "fp16 (autocast + GradScaler) and bf16 run on a CPU"
        )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    env = environment(device)
    print(f"{env['device']}: {args.model}, batch {args.batch}, {args.image_size} px", flush=True)
    layouts = [c == "on" for c in args.channels_last]
    compiles = [c == "on" for c in args.compile]
    not_run, loaders = [], list(args.loaders)
    if "dali" in loaders and env["dali"] is None:  # environment() found no nvidia.dali
        not_run.append("the DALI rows: nvidia.dali is not installed (pip install -e .[dali])")
        loaders.remove("dali")
    slug = re.sub(r"[^a-z0-9]+", "_", env["device"].lower()).strip("_")
    out = Path(args.out or REPO / f"results/bench/throughput_{slug}.json")
    result = {
        "what": "training images/s per GPU, dstrain vs a bare PyTorch AMP loop, one device; each "
        "pair --repeats times, its order alternating (pairs: medians and ranges)",
        "command": "python bench/throughput.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "batch": args.batch,
        "image_size": args.image_size,
        "compile_mode": args.compile_mode,
        "warmup_steps": args.warmup_steps,  # untimed, both loops of a pair
        "timed_steps": args.timed_steps,
        "environment": env,
        "references": REFERENCES,
        "total_s": 0.0,
        "complete": False,
        "not_run": not_run,
        "failed": [],
        "rows": [],
    }
    if args.resume and out.is_file():
        result = resume_from(out, result)
    grid = args.grid or [(pr, cl, co) for pr in precisions for cl in layouts for co in compiles]
    jobs = plan_jobs(grid, loaders, args.repeats)
    t_start, slowest = time.perf_counter(), 0.0
    with tempfile.TemporaryDirectory(prefix="dstrain-throughput-") as tmp:
        folder = None
        for job in jobs:
            if done(job, jobs, result["rows"], env.get("git_sha")):
                continue  # --resume: measured by an earlier call
            if any(f["row"] == label(job) for f in result["failed"]):
                continue  # --resume: failed in an earlier call, recorded; not retried
            elapsed = time.perf_counter() - t_start
            if args.budget_s and slowest and elapsed + slowest > args.budget_s:
                result["not_run"].append(
                    f"{label(job)}: did not fit --budget-s {args.budget_s:g} "
                    f"({elapsed:.0f} s used, the slowest row took {slowest:.0f} s); "
                    "rerun with --resume to measure it"
                )
                continue
            if job[1] == "dali" and folder is None:
                from bench.loader import make_folder_parallel

                t0 = time.perf_counter()
                folder = Path(args.dali_root or Path(tmp) / "images")
                have = len(list(folder.glob("train/*/*.JPEG")))
                make_folder_parallel(folder, max(have, args.dali_images), classes=100, start=have)
                print(f"generated {args.dali_images} JPEGs in {time.perf_counter() - t0:.0f} s")
            t0 = time.perf_counter()
            try:
                row = measure_row(job, args, device, folder, Path(tmp))
            except (SystemExit, RuntimeError) as err:  # a failed run: recorded, the grid goes on
                result["failed"].append({"row": label(job), "error": str(err)[-3000:]})
                print(f"FAILED   {label(job)}: {str(err)[-500:]}", flush=True)
            else:
                result["rows"].append({**row, "git_sha": env.get("git_sha")})
                link_twins(result["rows"])
                report(result["rows"][-1], result["rows"])
            slowest = max(slowest, time.perf_counter() - t0)
            result["total_s"] = result.get("total_s", 0.0) + time.perf_counter() - t0
            write(out, result)  # every row ends in the file
    for r in result["rows"]:  # DALI-fed training against the same training on synthetic data
        twin = [
            t["images_per_s"]
            for t in result["rows"]
            if t["loop"] == "dstrain"
            and t["data"] == "synthetic"
            and r["data"] == "dali"
            and all(t[k] == r[k] for k in ("precision", "channels_last", "compile"))
            and t.get("repeat", 0) == r.get("repeat", 0)
        ]
        if twin:
            r["vs_synthetic"] = r["images_per_s"] / twin[0]
    result["complete"] = all(
        any(row_key(r) == j for r in result["rows"])
        or any(f["row"] == label(j) for f in result["failed"])
        for j in jobs
    )
    result["git_shas"] = sorted({r["git_sha"] for r in result["rows"] if r.get("git_sha")})
    write(out, result)
    print(markdown(result))
    return 1 if result["failed"] else 0


def done(job: tuple, jobs: list[tuple], rows: list[dict], sha: str | None) -> bool:
    """Measured by an earlier call: a dstrain row at any commit (rows carry their SHA); a bare twin
    only at this commit, unless no dstrain row of its repeat still needs it (a ratio compares one
    commit's pair)."""
    if job[0] != "bare PyTorch":
        return any(row_key(r) == job for r in rows)
    if any(row_key(r) == job and r.get("git_sha") == sha for r in rows):
        return True
    needing = [
        j for j in jobs if j[0] == "dstrain" and PRECISIONS[j[2]][2] == job[2] and j[3:] == job[3:]
    ]
    return any(row_key(r) == job for r in rows) and all(
        any(row_key(r) == j for r in rows) for j in needing
    )


KEY = ("loop", "data", "precision", "channels_last", "compile", "repeat")


def order_in_pair(repeat: int) -> str:
    """Which side of a pair runs first in ``repeat``: it alternates, so neither side always gets
    the device (clocks, caches, the allocator) as the other left it."""
    return "bare first" if repeat % 2 == 0 else "dstrain first"


def plan_jobs(grid: list[tuple[str, bool, bool]], loaders: list[str], repeats: int) -> list[tuple]:
    """The rows in priority order: per bare twin (the autocast, layout and compile its dstrain rows
    share: fp16 and fp16_native share one), repeat by repeat, the twin next to its dstrain rows:
    the twin first in even repeats, last in odd ones (the dstrain rows then in reverse order, so
    each stays as near its twin both ways)."""
    twins: dict[tuple, list[str]] = {}
    for precision, cl, compiled in grid:
        precisions = twins.setdefault((PRECISIONS[precision][2], cl, compiled), [])
        precisions += [] if precision in precisions else [precision]
    jobs = []
    for (autocast, cl, compiled), precisions in twins.items():
        for repeat in range(repeats):
            bare = [("bare PyTorch", "synthetic", autocast, cl, compiled, repeat)]
            ours = [
                ("dstrain", loader, precision, cl, compiled, repeat)
                for precision in precisions
                for loader in loaders
            ]
            jobs += bare + ours if order_in_pair(repeat) == "bare first" else ours[::-1] + bare
    return jobs


def twin_key(row: dict) -> tuple:
    """The bare twin a dstrain row is compared with: same autocast, layout, compile and repeat."""
    return (
        "bare PyTorch",
        "synthetic",
        PRECISIONS[row["precision"]][2],
        row["channels_last"],
        row["compile"],
        row.get("repeat", 0),
    )


def link_twins(rows: list[dict]) -> None:
    """Each dstrain row's ratio to the twin of its repeat measured at the same commit (before or
    after it: the order alternates), once both are measured; None until then."""
    for r in rows:
        if r["loop"] != "dstrain":
            continue
        bare = next(
            (
                b["images_per_s"]
                for b in reversed(rows)
                if row_key(b) == twin_key(r) and b.get("git_sha") == r.get("git_sha")
            ),
            None,
        )
        r["vs_bare"] = r["images_per_s"] / bare if bare else None


def row_key(row: dict) -> tuple:
    return (*(row[k] for k in KEY[:-1]), row.get("repeat", 0))  # rows before --repeats: repeat 0


def label(job: tuple) -> str:
    """How a job is named in ``failed`` and ``not_run``: repeat 0 as before --repeats existed."""
    return " ".join(map(str, job[:-1])) + (f" repeat {job[-1]}" if job[-1] else "")


def pairs(rows: list[dict]) -> list[dict]:
    """Each dstrain row's repeats, summarised: the median images/s of both loops, the median of the
    per-repeat ratios (each against the twin measured just before it) and their range."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["loop"] == "dstrain" and r.get("vs_bare"):
            groups.setdefault(row_key(r)[1:-1], []).append(r)
    out = []
    for (data, precision, cl, compiled), runs in groups.items():
        runs.sort(key=lambda r: r.get("repeat", 0))
        ratios = sorted(r["vs_bare"] for r in runs)
        out.append(
            {
                "data": data,
                "precision": precision,
                "channels_last": cl,
                "compile": compiled,
                "repeats": len(runs),
                "images_per_s": statistics.median(r["images_per_s"] for r in runs),
                "bare_images_per_s": statistics.median(
                    r["images_per_s"] / r["vs_bare"] for r in runs
                ),
                "vs_bare": statistics.median(ratios),
                "vs_bare_min": ratios[0],
                "vs_bare_max": ratios[-1],
                "orders": [r.get("order") for r in runs],  # repeat by repeat
            }
        )
    return out


def resume_from(out: Path, fresh: dict) -> dict:
    """The rows an earlier call measured, when it measured the same model, batch, image size and
    step counts."""
    old = json.loads(out.read_text())
    settings = ("model", "batch", "image_size", "compile_mode", "warmup_steps", "timed_steps")
    same = all(old.get(k) == fresh[k] for k in settings)
    if not same:
        raise SystemExit(f"--resume: {out} measured other settings; choose another --out")
    failed = old.get("failed", [])
    print(f"--resume: {len(old['rows'])} rows and {len(failed)} failed in {out}", flush=True)
    return {**fresh, "rows": old["rows"], "failed": failed, "total_s": old.get("total_s", 0.0)}


def parse_row(text: str, parser: argparse.ArgumentParser) -> tuple[str, bool, bool]:
    """``bf16:nhwc:on`` -> ("bf16", True, True): a --rows entry."""
    parts = text.split(":")
    layouts, switches = {"nhwc": True, "nchw": False}, {"on": True, "off": False}
    if (
        len(parts) != 3
        or parts[0] not in PRECISIONS
        or parts[1] not in layouts
        or parts[2] not in switches
    ):
        parser.error(
            f"--rows {text}: expected PRECISION:LAYOUT:COMPILE with PRECISION one of "
            f"{', '.join(PRECISIONS)}, LAYOUT nhwc or nchw, COMPILE on or off"
        )
    return parts[0], layouts[parts[1]], switches[parts[2]]


def measure_row(job: tuple, args, device, folder, tmp: Path) -> dict:
    """One row, its warm-up and timed steps and its place in the pair; the ratio is link_twins'."""
    loop, data, precision, cl, compiled, repeat = job
    row = dict(zip(KEY, job)) | {"order": order_in_pair(repeat)}
    if loop == "bare PyTorch":
        ips = bare_loop(
            args.model,
            precision,
            cl,
            args.batch,
            args.image_size,
            args.warmup_steps,
            args.timed_steps,
            device,
            args.compile_mode if compiled else None,
        )
        steps = {"warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps}
        return row | {"images_per_s": ips, **steps}
    return row | dstrain_run(data, precision, cl, compiled, args, folder, tmp, repeat)


def report(row: dict, rows: list[dict]) -> None:
    """The row's line; a bare row measured after its dstrain rows gives their ratios."""
    ratio = (
        f" ({row['vs_bare']:.2f}x the bare twin)"
        if row.get("vs_bare")
        else " (its bare twin: not measured yet or failed)"
        if row["loop"] == "dstrain"
        else ""
    )
    print(
        f"{'bare' if row['loop'] != 'dstrain' else 'dstrain':8s} {row['data']:9s} "
        f"{row['precision']} channels_last={row['channels_last']} compile={row['compile']}: "
        f"{row['images_per_s']:.0f} img/s{ratio} (repeat {row['repeat']}, {row['order']})",
        flush=True,
    )
    if row["loop"] != "dstrain" and row["order"] == "dstrain first":
        for r in rows:
            same = twin_key(r) == row_key(row) and r.get("git_sha") == row.get("git_sha")
            if r["loop"] == "dstrain" and r.get("vs_bare") and same:
                print(
                    f"         pair {r['data']} {r['precision']}: {r['vs_bare']:.2f}x", flush=True
                )


def headline(result: dict) -> str:
    """The file's one line: each pair's median ratio, dstrain over its bare twin."""
    ratios = [p["vs_bare"] for p in result["pairs"] if p.get("vs_bare")]
    if not ratios:
        return f"{len(result['rows'])} rows measured, no complete pair yet"
    return (
        f"dstrain {min(ratios):.2f}x-{max(ratios):.2f}x its bare PyTorch twin ({len(ratios)} pairs)"
    )


def write(out: Path, result: dict) -> None:
    """The JSON (described for results/evidence.py, its provenance from the environment) and its
    .md table beside it, each written atomically: a job cut mid-write leaves the last whole file."""
    from bench.common import write_result
    from dstrain.core.files import atomic_write_text

    result["pairs"] = pairs(result["rows"])
    env = result["environment"]
    title = (
        f"Training throughput, {result['model']} at batch {result['batch']}, "
        f"{result['image_size']} px, on {env['device']}: dstrain vs its bare PyTorch twin"
    )
    where = {k: env.get(k) for k in ("git_sha", "date", "machine")}
    body = {k: v for k, v in result.items() if k not in ("title", "headline", *where)}
    write_result(out, {**where, **body}, title=title, headline=headline(result))
    atomic_write_text(out.with_suffix(".md"), markdown(result))


if __name__ == "__main__":
    sys.exit(main())
