"""Every result file: its command, its file, the code it measures, its headline (the index's row);
the published and derived figures the docs cite by name."""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "docs/results/README.md"
README = REPO / "README.md"
BEGIN, END = "<!-- evidence:index begin -->", "<!-- evidence:index end -->"
README_BEGIN, README_END = "<!-- evidence:readme begin -->", "<!-- evidence:readme end -->"
RESULT_DIRS = ("bench/results", "docs/results")  # every .json here is a registered result
GPU_IMPORTS = "bench/results/gpu_imports.json"  # written by ./run.sh gpu-import (tools/gpu_pack.py)
NOT_RESULTS = {
    "docs/results/results_run.txt": "the log of the last `./run.sh results`: steps and times",
    GPU_IMPORTS: "the GPU result files ./run.sh gpu-import brought in, each registered from it",
}

TRAINER = ("dstrain", "ds_configs")  # the code a training run measures: the package and its JSONs
# a script's modules of its own, part of what its results measure
SCRIPT_PARTS = {
    script: ("bench/study",)
    for script in ("bench/accuracy_study.py", "bench/ablation.py", "bench/epochs_tuned.py")
}
# what a run of the test suite depends on: the code, the tests, the scripts they run, the pins
SUITE = (
    *TRAINER,
    "tests",
    "bench/*.py",
    "bench/study/*.py",
    "tools/*.py",
    "tools/results/*.py",
    "launch.sh",
    "run.sh",
    "hostfiles",
    "pyproject.toml",
)

if str(REPO) not in sys.path:  # run as a script: tools/ is on the path, the repository is not
    sys.path.insert(0, str(REPO))
from tools.suite import headline as suite_headline  # noqa: E402


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


@dataclass(frozen=True)
class Result:
    key: str
    what: str
    command: str  # from the repository root; `python` is this interpreter
    file: str  # the file the command writes (json, or md for ./run.sh evidence)
    headline: str | Callable[[dict], str]  # a template of values ({key.path:format}) or a function
    # what it measures, a change to which makes it stale (default: the trainer, the command's script)
    code: tuple[str, ...] | None = None
    # part of `run`; False: the long accuracy studies and the test suite, each its own step
    rerun: bool = True
    readme: str = ""  # a row of README's results table, with this label (empty: the index only)

    def __post_init__(self):
        if self.code is None:
            scripts = re.findall(r"(?:bench|tools)/\w+\.py", self.command)
            parts = [part for script in scripts for part in SCRIPT_PARTS.get(script, ())]
            object.__setattr__(self, "code", (*TRAINER, *scripts, *parts))

    def exists(self) -> bool:
        return (REPO / self.file).is_file()

    def load(self) -> dict:
        path = REPO / self.file
        if path.suffix == ".json":
            return json.loads(path.read_text())
        text = path.read_text()  # faults.md: "git <sha>" in its header
        m = re.search(r"\bgit ([0-9a-f]{40}(?:-dirty)?)", text)
        return {"git_sha": m.group(1) if m else None, "text": text}

    def summary(self, d: dict) -> str:
        """The headline of the result's data ``d``."""
        if callable(self.headline):
            return self.headline(d)

        from tools.results.numbers import resolve  # the key-path language

        def value(m: re.Match) -> str:
            v = resolve(d, m[1])
            return format(int(v) if v.is_integer() and not m[2] else v, m[2] or "")

        return re.sub(r"\{([^{}:]+)(?::([^{}]*))?\}", value, self.headline)

    def shas(self, d: dict) -> list[str]:
        shas = d.get("run_git_shas") or [
            d.get("git_sha") or d.get("environment", {}).get("git_sha")
        ]
        return [s for s in shas if s]


# ------------------------------------------------------------------- headlines


def _loader(d: dict) -> str:
    return ", ".join(
        f"{ratio(r['ratio_dali_over_plain'])} at {r['batches_per_epoch']} batches/epoch"
        for r in d["rows"]
    )


def _loader_formats(d: dict) -> str:
    r = d["rows"][0]
    return "; ".join(
        f"{name} from shards: "
        + ", ".join(
            f"{fmt} {ratio(r[key])}"
            for fmt in ("wds", "recordio")
            if (key := f"ratio_{name}_{fmt}_over_folder") in r
        )
        + " the folder's images/s"
        for name in ("dali", "torchvision")
        if any(k.startswith(f"ratio_{name}_") and k.endswith("_over_folder") for k in r)
    )


def _comm(d: dict) -> str:
    rows = {r["config"].split("/")[-1].removesuffix(".json"): r for r in d["rows"]}
    sign = rows["comm_sign"]
    return (
        f"torus2d {100 * rows['comm_torus2d']['top1_vs_fp32']:+.2f} pt vs all-reduce; sign "
        f"{ratio(sign['bytes_vs_fp32'], 3)} bytes, {100 * sign['top1_vs_fp32']:+.2f} pt"
    )


def _throughput_ratios(d: dict) -> list[float]:
    """dstrain / bare images/s for each (data, precision, channels_last, compile) pair in one run."""
    bare, ours = {}, {}
    for r in d["rows"]:
        k = (r.get("data"), r.get("precision"), r.get("channels_last"), r.get("compile"))
        (bare if r["loop"].startswith("bare") else ours)[k] = r["images_per_s"]
    return [ours[k] / bare[k] for k in ours if k in bare]


def _throughput(d: dict) -> str:
    rs = _throughput_ratios(d)
    return f"dstrain {min(rs):.2f}x-{max(rs):.2f}x its bare PyTorch twin ({len(rs)} pairs)"


def _by_row(d: dict) -> dict[str, list[float]]:
    """A study's final top-1 per row, one value per seed."""
    by_row: dict[str, list[float]] = {}
    for r in d["runs"]:
        by_row.setdefault(r["row"], []).append(r["final_top1"])
    return by_row


def _study(d: dict) -> str:
    by_row = _by_row(d)
    n = max(len(v) for v in by_row.values())
    shown = [k for k in by_row if not k.endswith("_no_refit")][:6]
    body = ", ".join(f"{k} {100 * statistics.mean(by_row[k]):.2f}%" for k in shown)
    return f"{d['epochs']} epochs, {n} seed(s): {body}"


def _target(d: dict) -> str:
    """Epochs to each target per batch, as the study computed them (its ``epochs_to_target``)."""
    parts = []
    for level in [d["target"], *d.get("extra_targets", [])]:
        got = [
            f"{e['batch']:,}{' SGD' if e['row'] == 'baseline' else ''} "
            + (f"{round(e['epochs'], 1):g}" if e["epochs"] else "never")
            for e in d["epochs_to_target"]
            if e["level"] == level
        ]
        parts.append(f"to {100 * level:.2f}%: {', '.join(got)}")
    return f"{d['epochs']} epochs, epochs " + "; ".join(parts)


def _tuning(d: dict) -> str:
    (run,) = [r for r in d["runs"] if not r["row"].endswith("_no_refit")]
    lr = re.search(r"optim\.base_lr=(\S+)", d["command"]).group(1)
    return f"LR {lr}, {d['epochs']} epochs: {pct(run['final_top1'], 2)} held-out top-1"


def _epochs_tuned(d: dict) -> str:
    """bench/epochs_tuned.py: per level, each batch's epochs at its best setting and the ratio."""
    parts = []
    for level in d["levels"]:
        got = [
            f"{r['batch']:,} "
            + (f"{r['epochs']:.1f} ({r['ratio']:.2f}x)" if r["ratio"] else "never")
            for r in d["rows"]
            if r["level"] == level
        ]
        base = next(r for r in d["rows"] if r["level"] == level)
        parts.append(
            f"to {100 * level:.2f}%: {', '.join(got)} of {base['base_epochs'] or 0:.1f} epochs of "
            f"{base['base']}"
        )
    return "; ".join(parts)


def _ablation(d: dict) -> str:
    """bench/ablation.py: what each technique earns (positive: it helps), with its 95% interval."""
    parts = []
    for e in d["entries"]:
        ci = e["earns_ci95_pt"]
        parts.append(
            f"{e['row']}: {e['earns_pt']:+.2f} pt"
            + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")
        )
    return "the technique earns: " + "; ".join(parts)


def _lars_tensors(d: dict) -> str:
    rises = [b["loss"] - a["loss"] for a, b in zip(d["steps"], d["steps"][1:])]
    lars = max(r["max_step_lars"] for r in d["steps"][20:])
    bn = max(r["max_step_bn_bias"] for r in d["steps"][20:])
    return (
        f"{len(d['top1_per_epoch'])} epochs; largest one-step loss rise {max(rises):.2f} (step "
        f"{d['worst_step']}); after step 20, relative steps up to {bn:.2f} (BN/bias) vs "
        f"{lars:.3f} (LARS weights)"
    )


def _faults(d: dict) -> str:
    rows = [line for line in d["text"].splitlines() if line.startswith("| ") and "---" not in line]
    return f"{len(rows) - 1} bad inputs and faults, each with its exit status and message"


RECORDS_ROWS = (
    "baseline",
    "goyal_4096",
    "lars_records",
    "lars_records_no_last_k",
    "fujitsu_span32",
)


def _code_shape(d: dict) -> str:
    widest = d["widest_signatures"][0]["parameters"] if d["widest_signatures"] else 0
    floors = f", {d['floors']} floors" if "floors" in d else ""
    return (
        f"{d['files']} files, {d['lines']:,} lines, {len(d['import_cycles'])} import cycles, "
        f"widest signature {widest} parameters{floors}"
    )


def _crash(d: dict) -> str:
    bad = [r for r in d["rows"] if r["outcome"] != "ok"]
    return f"{len(bad)} of {len(d['rows'])} conv shapes crash oneDNN's channels_last backward"


def _sweep(d: dict) -> str:
    best = max(d["runs"], key=lambda r: r["final_top1"])
    return f"{len(d['runs'])} runs; best {pct(best['final_top1'], 2)} ({best['name']}); no commit recorded"


# issue 33's peak-LR choices at the CPU study's budget: (file stem, study row, what, LRs run)
TUNING_30EP = (
    ("records", "lars_records", "LARS in the records' regime (peak LR)", ("4", "8", "16")),
    ("fujitsu", "fujitsu_span32", "Fujitsu recipe (peak LR)", ("10", "25")),
    ("goyal", "goyal_4096", "Goyal SGD (LR per 256 images)", ("0.05", "0.1", "0.2")),
)
# batch 4,096's peak-LR ladder at 90 epochs beside the recipe's LR 10 (issue 52): (LR, against 10)
B4096_LADDER_90EP = (
    ("20", "twice the recipe's"),
    ("5", "half the recipe's"),
    ("2.5", "a quarter of the recipe's"),
)
OPTIMIZER_CODE = (
    "dstrain/techniques/lars.py",
    "dstrain/techniques/lamb.py",
    "dstrain/techniques/multitensor.py",
    "bench/optimizer_step.py",
)
R = "python bench/"  # a benchmark
T = "python tools/"  # project tooling
# issue 52, item 3's inputs to bench/epochs_tuned.py (--reports FILE:ROW): batch 8,192's and 4,096's
# LR and warmup tunings at 90 epochs, held-out; then the target grid's LR ladders (batch:LR) at
# batch 128 ... 2,048; and the tuned baseline's held-out runs (--reference)
LARGE_BATCH_TUNINGS_90EP = " ".join(
    f"docs/results/tuning/chosen_b{name}_90ep_holdout6000{seeds}.json:{row}"
    for name, seeds, row in (
        ("8192_lr10", "", "chosen_b8192"),
        ("8192_lr20", "", "chosen_b8192"),
        ("8192_lr20", "_s1_2", "chosen_b8192"),
        ("8192_lr40", "_s0", "chosen_b8192"),
        ("4096_lr2.5", "", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr5", "", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr5", "_s1_2", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr10", "", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr10", "_s1_2", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr20", "", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr20", "_s1_2", "fujitsu_span32_bn_lr0.1"),
        ("8192_lr20_warmup18", "", "chosen_b8192"),
        ("8192_lr20_warmup27", "", "chosen_b8192"),
        ("8192_lr20_warmup27", "_s1", "chosen_b8192"),
        ("4096_lr20_warmup18", "", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr20_warmup27", "", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr20_warmup27", "_s1", "fujitsu_span32_bn_lr0.1"),
        ("4096_lr20_warmup27", "_s2", "fujitsu_span32_bn_lr0.1"),
    )
)
TARGET_LADDERS_90EP = " ".join(
    f"docs/results/tuning/target_b{pair.replace(':', '_lr')}_90ep_holdout6000.json"
    for pair in (
        "128:0.25 128:0.5 128:1 128:2 512:0.625 512:1.25 512:2.5 512:5 1024:0.625 1024:1.25 "
        "1024:2.5 1024:5 1024:10 2048:1.25 2048:2.5 2048:5 2048:10"
    ).split()
)
BASELINE_HOLDOUT_90EP = (
    "docs/results/tuning/b128_lr0.8_tail_90ep_holdout6000.json:b128_lr0.8_tail "
    "docs/results/tuning/b128_lr0.8_tail_90ep_holdout6000_s1_2.json:b128_lr0.8_tail"
)
# the levels (the baseline's held-out final minus 0.3 pt, and 90%) and the settings tuned
EPOCHS_TUNED_90EP = (
    "--target 0.937389 --extra-targets 0.9 --tuned optim.base_lr optim.warmup_epochs "
    "optim.decay_epochs --out docs/results/tuning"
)
# The registry, one entry per result file (bench/results, docs/results): key, what, command, file,
# headline (a template of the file's values, or a function), then what differs from the defaults.
# fmt: off
RESULTS = [
    Result("default_recipe", "default recipe (`fashion_mnist`)", R + "default_recipe.py",
           "bench/results/default_recipe.json",
           "{final_top1:.1%} top-1, {epochs} epochs, {train_wall_time_s:.0f} s training",
           readme="default recipe (`./run.sh train`), 2 CPU cores"),
    Result("recipe_fashion_mnist_lars", "shipped `fashion_mnist_lars` recipe",
           R + "default_recipe.py --config fashion_mnist_lars",
           "bench/results/recipe_fashion_mnist_lars.json",
           "{final_top1:.1%} top-1, {epochs} epochs, {train_wall_time_s:.0f} s training",
           readme="the `fashion_mnist_lars` recipe (batch ramp to 4,096, LARS)"),
    Result("overhead_1rank", "trainer overhead, 1 rank", R + "overhead.py",
           "bench/results/overhead_cpu_1rank.json",
           "trainer step {overhead_ratio:.3f}x a bare DeepSpeed step (bare {median_step_ms.bare:.1f} ms)",
           readme="trainer step vs a bare DeepSpeed loop, 1 rank"),
    Result("overhead_1rank_1thread", "trainer overhead, 1 rank, 1 thread",
           "OMP_NUM_THREADS=1 " + R + "overhead.py --out bench/results/overhead_cpu_1rank_1thread.json",
           "bench/results/overhead_cpu_1rank_1thread.json",
           "trainer step {overhead_ratio:.3f}x a bare DeepSpeed step (bare {median_step_ms.bare:.1f} ms)"),
    Result("overhead_2rank", "trainer overhead, 2 ranks",
           "OMP_NUM_THREADS=1 deepspeed --num_gpus 2 bench/overhead.py",
           "bench/results/overhead_cpu_2rank.json",
           "trainer step {overhead_ratio:.3f}x a bare DeepSpeed step (bare {median_step_ms.bare:.1f} ms)",
           readme="the same, 2 ranks"),
    Result("scaling", "multi-rank CPU scaling (`./launch.sh`)", R + "scaling.py",
           "bench/results/scaling_cpu.json",
           "1 -> 2 ranks (1 thread each): {images_per_s.1x1:,.0f} -> {images_per_s.2x1:,.0f} img/s, "
           "{speedup:.2f}x, {scaling_efficiency:.0%} efficiency",
           code=(*TRAINER, "launch.sh", "bench/scaling.py"),
           readme="1 -> 2 CPU ranks under `./launch.sh`"),
    Result("scaling_threads1",
           "2 CPU ranks on 2 cores, 1 torch thread each (what dist.share_cpu_cores gives)",
           R + "scaling.py --threads 1 --repeats 1 --out bench/results/scaling_cpu_threads1.json "
           "data.limit_train=2048 data.limit_val=512 model.width=8",
           "bench/results/scaling_cpu_threads1.json",
           "2 ranks x 1 thread: {images_per_s.2x1:,.0f} img/s",
           code=(*TRAINER, "launch.sh", "bench/scaling.py")),
    Result("scaling_threads2",
           "2 CPU ranks on 2 cores, 2 torch threads each (DeepSpeed's launcher's default before)",
           R + "scaling.py --threads 2 --repeats 1 --out bench/results/scaling_cpu_threads2.json "
           "data.limit_train=2048 data.limit_val=512 model.width=8",
           "bench/results/scaling_cpu_threads2.json",
           "2 ranks x 2 threads: {images_per_s.2x2:,.0f} img/s",
           code=(*TRAINER, "launch.sh", "bench/scaling.py")),
    Result("single_rank_allreduce", "DeepSpeed's single-rank all-reduce (now skipped)",
           R + "single_rank_allreduce.py", "bench/results/single_rank_allreduce_cpu.json",
           "a step {speedup_without_allreduce:.2f}x faster without it",
           code=("dstrain/loop/trainer.py", "dstrain/run/compat.py", "bench/single_rank_allreduce.py")),
    Result("bn_span", "BN span 32 cost, channels_last", R + "bn_span.py",
           "bench/results/bn_span_cpu.json", "{span_over_plain:.2f}x the plain-BN step",
           code=("dstrain/techniques/bn_span.py", "bench/bn_span.py")),
    Result("bn_span_nchw", "BN span 32 cost, NCHW",
           R + "bn_span.py --channels-last off --out bench/results/bn_span_cpu_nchw.json",
           "bench/results/bn_span_cpu_nchw.json", "{span_over_plain:.2f}x the plain-BN step",
           code=("dstrain/techniques/bn_span.py", "bench/bn_span.py")),
    Result("bn_group", "BN group over 2 CPU ranks (gloo)", R + "bn_group.py",
           "bench/results/bn_group_cpu_2ranks.json",
           "{group_over_plain:.2f}x the per-rank-BN step ({group_of_one_over_plain:.2f}x with a "
           "group of one rank)",
           code=("dstrain/techniques/bn_group.py", "bench/bn_group.py")),
    Result("bn_group_bytes", "BN groups of 2 among 8 ranks: bytes per step and rank, ResNet-50",
           R + "bn_group.py --bytes-only --model resnet50 --classes 1000 --ranks 8 --group 2",
           "bench/results/bn_group_bytes_resnet50_8ranks_group2.json",
           "BN {bn_mib:.2f} MiB in {per_step_and_rank.bn_collectives} collectives against the "
           "gradient all-reduce's {gradient_allreduce_mib:.1f} MiB",
           code=("bench/bn_group.py",)),
    Result("startup", "What a process imports before it trains; the import guard's saving",
           R + "startup.py --repeats 7", "bench/results/startup_cpu.json",
           "torch {derived.torch_s.median:.2f} s, torch._dynamo {derived.dynamo_s.median:.2f} s, "
           "DeepSpeed {derived.deepspeed_s.median:.2f} s; the guard saves "
           "{derived.guard_saves_s.median:.2f} s a process; a refused config "
           "{statements.config_error.median_s:.2f} s",
           code=("bench/startup.py", "dstrain/__init__.py", "dstrain/core/import_guard.py",
                 "pyproject.toml")),
    Result("optimizer_step", "LARS/LAMB step on ResNet-50's parameters", R + "optimizer_step.py",
           "bench/results/optimizer_step_cpu.json",
           "LARS {ratio_vs_sgd_foreach.dstrain_lars:.2f}x, LAMB {ratio_vs_sgd_foreach.dstrain_lamb:.2f}x"
           " the time of SGD(foreach)",
           code=OPTIMIZER_CODE, readme="LARS/LAMB step on ResNet-50 parameters vs SGD"),
    Result("loader", "DALI loader vs a plain DALI pipeline (the ceiling)",
           R + "loader.py --batch 64 --batches-per-epoch 25 100 --threads 2 --prefetch 2 --epochs 3",
           "bench/results/loader_cpu.json", _loader, code=("dstrain/data", "bench/loader.py"),
           readme="DALI loader vs a plain DALI pipeline (CPU decode)"),
    Result("loader_formats",
           "the same loader over shards (WebDataset, RecordIO) vs the folder, same files",
           R + "loader.py --batch 64 --batches-per-epoch 25 --threads 2 --prefetch 2 --epochs 3 "
           "--devices cpu --loaders dali dali@wds dali@recordio torchvision torchvision@wds "
           "torchvision@recordio --out bench/results/loader_cpu_formats.json",
           "bench/results/loader_cpu_formats.json", _loader_formats,
           code=("dstrain/data", "bench/loader.py")),
    Result("polish", "Final Polishing (BN refit, last K epochs)", R + "polish.py",
           "bench/results/polish.json",
           "{summary.none.values | count:.0f} seeds, batch 4,096: none {summary.none.mean:.2%}, refit "
           "{summary.refit.mean:.2%}, last K {summary.k_epochs.mean:.2%}, both {summary.both.mean:.2%}; "
           "refit {summary.refit_fraction.mean:.1%} of training time",
           readme="Final Polishing at batch 4,096, 3 seeds (top-1 %)"),
    Result("comm_accuracy", "gradient communication, accuracy and bytes (2 ranks)",
           R + "comm_accuracy.py --epochs 2", "bench/results/comm_accuracy.json", _comm,
           readme="2D-Torus and 1-bit compression vs all-reduce, 2 ranks"),
    Result("throughput_cpu",
           "the GPU throughput bench on CPU (resnet18, 64 px, fp32; synthetic and DALI data)",
           R + "throughput.py --model resnet18 --batch 32 --image-size 64 --images 1280 --bare-steps 40 "
           "--bare-warmup 5 --epochs 3 --dali-images 1280 --dali-threads 2",
           "bench/results/throughput_cpu_2_cores.json", _throughput,
           readme="throughput bench on CPU (resnet18, 64 px)"),
    Result("throughput_cpu_compile",
           "the same, synthetic data only, channels_last and torch.compile on/off (a second run)",
           R + "throughput.py --model resnet18 --batch 32 --image-size 64 --images 640 --bare-steps 20 "
           "--bare-warmup 5 --epochs 3 --loaders synthetic --channels-last on off --compile off on "
           "--out bench/results/throughput_cpu_2_cores_compile.json",
           "bench/results/throughput_cpu_2_cores_compile.json", _throughput),
    Result("loader_settings", "DALI loader threads / prefetch",
           R + "loader.py --batch 64 --batches-per-epoch 25 --threads 1 2 --prefetch 1 2 3 --epochs 3 "
           "--out bench/results/loader_cpu_settings.json", "bench/results/loader_cpu_settings.json",
           lambda d: f"{len(d['rows'])} settings: {_loader(d).split(',')[0]} (first); see docs/data.md",
           code=("dstrain/data", "bench/loader.py")),
    Result("comm_model",
           "all-reduce cost model (ring, hierarchical, 2D-Torus; modelled, not measured)",
           R + "comm_model.py", "bench/results/comm_model.json",
           "{rows | count:.0f} cluster sizes, {rows[0].gpus} to {rows[-1].gpus} GPUs",
           code=("bench/comm_model.py",)),
    Result("faults", "bad inputs and faults, what the user sees", "./run.sh evidence",
           "docs/results/faults.md", _faults, code=(*TRAINER, "launch.sh", "run.sh")),
    Result("commit_ab_default",
           "the default recipe at c8827d4 (its first result) and now, alternating on one machine",
           T + "commit_ab.py --base c8827d4 --rounds 2 epochs=2",
           "bench/results/commit_ab_c8827d4.json",
           "training time now {head_over_base:.2f}x that at c8827d4 ({median_wall_time_s.head:.1f} vs "
           "{median_wall_time_s.base:.1f} s)"),
    Result("commit_ab_study_code",
           "issue 52: do 2b1af3d (the last restart of the earlier batch-4,096 runs) and 541f812 (every "
           "run of the final comparison) train the chosen row alike? Seed 0, stopped at 75% top-1",
           T + "commit_ab.py --base 2b1af3d --head 541f812 --rounds 1 --config fashion_mnist_fujitsu "
           "--deepspeed-config ds_configs/lars_fujitsu_fp32.json --json-set "
           "optimizer.params.bn_bias_lr_factor=0.1 epochs=90 seed=0 model.width=8 "
           "model.channels_last=true data.augment=true data.holdout=0 checkpoint.every_epochs=0 "
           "log.tensorboard=false batch.micro_per_rank=256 optim.warmup_epochs=36 "
           "optim.decay_epochs=52 polish.last_epochs_without_augmentation=5 model.bn_span=32 "
           "target_top1=0.75",
           "bench/results/commit_ab_2b1af3d_541f812.json",
           "identical training: {identical_training}",
           code=("tools/commit_ab.py",), rerun=False),
    Result("replay_b4096_lr5_s0",
           "issue 52: does this session's machine train batch 4,096's LR-5 held-out seed 0 (541f812, "
           "made on an earlier session's machine) as it was trained? Its first 3 epochs replayed",
           T + "replay.py docs/results/tuning/chosen_b4096_lr5_90ep_holdout6000.json "
           "--row fujitsu_span32_bn_lr0.1 --seed 0 --epochs 3",
           "bench/results/replay_chosen_b4096_lr5_90ep_holdout6000_fujitsu_span32_bn_lr0.1_s0.json",
           "identical: {identical}, first difference at epoch {first_difference}",
           code=("tools/replay.py",), rerun=False),
    Result("replay_b4096_lr5_s1",
           "issue 52: batch 4,096's LR-5 held-out seed 1 (541f812), replayed for 3 epochs on the "
           "machine that trained it (the same session)",
           T + "replay.py docs/results/tuning/chosen_b4096_lr5_90ep_holdout6000_s1_2.json "
           "--row fujitsu_span32_bn_lr0.1 --seed 1 --epochs 3",
           "bench/results/replay_chosen_b4096_lr5_90ep_holdout6000_s1_2_fujitsu_span32_bn_lr0.1_s1.json",
           "identical: {identical}",
           code=("tools/replay.py",), rerun=False),
    Result("suite_cpu", "the test suite on this CPU (CI's first step)",
           "./run.sh test -q --junitxml=/tmp/dstrain-suite.xml; python tools/suite.py "
           "--junit /tmp/dstrain-suite.xml --ran './run.sh test -q'",
           "bench/results/suite_cpu_2_cores.json", suite_headline,
           code=(*SUITE, "requirements.txt"), rerun=False, readme="the test suite (CI step 1)"),
    Result("suite_cpu_cold", "the test suite cold, as a newcomer runs it (fresh clone, empty HOME)",
           "git clone; HOME=EMPTY ./run.sh setup; HOME=EMPTY ./run.sh test -q --junitxml=/tmp/cold.xml; "
           "python tools/suite.py --junit /tmp/cold.xml --out bench/results/suite_cpu_2_cores_cold.json",
           "bench/results/suite_cpu_2_cores_cold.json",
           lambda d: f"{suite_headline(d)}, after a {d['cold']['setup_s']} s install",
           code=(*SUITE, "requirements.txt"), rerun=False,
           readme="the test suite cold: fresh clone, empty HOME"),
    Result("suite_cpu_oldest", "the `oldest` tests on the oldest torch declared (CI's second step)",
           "./run.sh test-oldest -q --junitxml=/tmp/dstrain-oldest.xml; .venv-oldest/bin/python "
           "tools/suite.py --junit /tmp/dstrain-oldest.xml --ran './run.sh test-oldest -q' "
           "--out bench/results/suite_cpu_2_cores_oldest.json",
           "bench/results/suite_cpu_2_cores_oldest.json",
           lambda d: f"torch {d['torch']}: {suite_headline(d)}",
           code=(*SUITE, "requirements-oldest.txt"), rerun=False,
           readme="the `oldest` tests on torch 2.11 (CI step 2)"),
    Result("study_30ep", "large-batch study at the records' step budget (CPU: 30 epochs)",
           R + "accuracy_study.py --epochs 30 --rows baseline naive_4096 lars lars_span32 --seeds 0",
           "docs/results/accuracy_study_30ep.json", _study, rerun=False),
    Result("study_30ep_records",
           "large-batch study, issue 33's rows: Goyal SGD, LARS in the records' regime, Fujitsu recipe",
           R + "accuracy_study.py --epochs 30 --rows " + " ".join(RECORDS_ROWS) + " --seeds 0 "
           "--name accuracy_study_30ep_records", "docs/results/accuracy_study_30ep_records.json",
           _study, rerun=False, readme="large-batch study, 30 epochs, seed 0 (test top-1)"),
    Result("study_30ep_seeds",
           "large-batch study, 30 epochs, 3 seeds: batch 128 vs the best batch-4,096 row",
           R + "accuracy_study.py --epochs 30 --rows baseline fujitsu_span32 --seeds 0 1 2 "
           "--name accuracy_study_30ep_seeds", "docs/results/accuracy_study_30ep_seeds.json",
           _study, rerun=False, readme="batch 128 vs 4,096 (Fujitsu recipe), 30 epochs, 3 seeds"),
    Result("study_90ep_baseline",
           "the goal's measurement, batch 128 half: 90 epochs, 3 seeds, test set (CPU)",
           R + "accuracy_study.py --epochs 90 --rows baseline --seeds 0 1 2 "
           "--name accuracy_study_90ep_baseline", "docs/results/accuracy_study_90ep_baseline.json",
           _study, rerun=False, readme="batch 128 untuned, 90 epochs, 3 seeds (issue 39's reference)"),
    Result("ema_holdout",
           "issue 54, item 3: an EMA of the weights on the chosen batch-4,096 row and the tuned "
           "batch-128 row, 30 epochs, 6,000 held-out images, 3 seeds; each run's trained model, "
           "its refit, the EMA and the EMA refit",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows chosen_ema b128_lr0.4_tail_ema "
           "--seeds 0 1 2 --finished-only --reuse docs/results/tuning/ema_30ep_holdout6000.json "
           "--runs runs/accuracy_study/ema-30ep --out docs/results/tuning --name "
           "ema_30ep_holdout6000",
           "docs/results/tuning/ema_30ep_holdout6000.json", _study, rerun=False),
    Result("final_90ep_b128",
           "issue 52, item 2: the tuned batch-128 row (b128_lr0.4_tail) at 90 epochs on the test "
           "set, the goal's reference, 5 seeds at 541f812",
           R + "accuracy_study.py --epochs 90 --rows b128_lr0.4_tail --seeds 0 1 2 3 4 "
           "--finished-only --reuse docs/results/final_90ep_b128.json --runs "
           "runs/accuracy_study/final-90ep-b128 --out docs/results --name final_90ep_b128",
           "docs/results/final_90ep_b128.json", _study, rerun=False),
    Result("final_90ep_b4096",
           "issue 52, item 2: batch 4,096 (the chosen row, fujitsu_span32_bn_lr0.1) at 90 epochs on "
           "the test set, 5 seeds at 541f812, at the recipe's LR 10 (its 90-epoch tuning chose 20: "
           "final_90ep_b4096_lr20 is item 2's row)",
           R + "accuracy_study.py --epochs 90 --rows fujitsu_span32_bn_lr0.1 --seeds 0 1 2 3 4 "
           "--finished-only --reuse docs/results/final_90ep_b4096.json --runs "
           "runs/accuracy_study/final-90ep-b4096 --out docs/results --name final_90ep_b4096",
           "docs/results/final_90ep_b4096.json", _study, rerun=False),
    Result("final_90ep_b8192",
           "issue 52, item 2: batch 8,192 (chosen_b8192, the chosen row at its held-out-tuned peak LR "
           "20) at 90 epochs on the test set, 5 seeds at 541f812",
           R + "accuracy_study.py --epochs 90 --rows chosen_b8192 --seeds 0 1 2 3 4 --extra "
           "optim.base_lr=20 --finished-only --reuse docs/results/final_90ep_b8192.json --runs "
           "runs/accuracy_study/final-90ep-b8192-lr20 --out docs/results --name final_90ep_b8192",
           "docs/results/final_90ep_b8192.json", _study, rerun=False),
    Result("final_90ep_b4096_lr20",
           "issue 52, item 2: batch 4,096 (chosen_b4096: the chosen row at the peak LR its 90-epoch "
           "held-out tuning chose, 20) at 90 epochs on the test set, 5 seeds at 541f812 (seeds 0-2 "
           "trained by this command's first run, seeds 3-4 read from their report)",
           R + "accuracy_study.py --epochs 90 --rows chosen_b4096 --seeds 0 1 2 3 4 --finished-only "
           "--reuse docs/results/final_90ep_b4096_lr20.json "
           "docs/results/final_90ep_b4096_lr20_s3_4.json --runs "
           "runs/accuracy_study/final-90ep-b4096-lr20 --out docs/results --name "
           "final_90ep_b4096_lr20",
           "docs/results/final_90ep_b4096_lr20.json", _study, rerun=False),
    Result("final_90ep_b4096_lr20_s3_4",
           "issue 52, item 2: batch 4,096 (the chosen row) at the peak LR its 90-epoch held-out "
           "tuning chose (20), test set, seeds 3 and 4, at 541f812",
           R + "accuracy_study.py --epochs 90 --rows fujitsu_span32_bn_lr0.1 --seeds 3 4 --extra "
           "optim.base_lr=20 --runs runs/accuracy_study/final-90ep-b4096-lr20 --out docs/results "
           "--name final_90ep_b4096_lr20_s3_4",
           "docs/results/final_90ep_b4096_lr20_s3_4.json", _study, rerun=False),
    Result("final_90ep_b4096_lr20_warmup27",
           "issue 52, item 2: batch 4,096 (chosen_b4096_warmup27: the chosen row at the peak LR, 20, "
           "and warmup, 30%, its 90-epoch held-out tuning chose) at 90 epochs on the test set, 5 "
           "seeds at 541f812 (seeds 0-2 trained by this command's first run, seeds 3-4 read from "
           "their report)",
           R + "accuracy_study.py --epochs 90 --rows chosen_b4096_warmup27 --seeds 0 1 2 3 4 "
           "--finished-only --reuse docs/results/final_90ep_b4096_lr20_warmup27.json "
           "docs/results/final_90ep_b4096_lr20_warmup27_s3_4.json --runs "
           "runs/accuracy_study/final-90ep-b4096-lr20-warmup27 --out docs/results --name "
           "final_90ep_b4096_lr20_warmup27",
           "docs/results/final_90ep_b4096_lr20_warmup27.json", _study, rerun=False),
    Result("final_90ep_b4096_lr20_warmup27_s3_4",
           "issue 52, item 2: batch 4,096 (the chosen row) at the peak LR (20) and warmup (30%, 27 "
           "of 90 epochs) its 90-epoch held-out tuning chose, test set, seeds 3 and 4, at 541f812",
           R + "accuracy_study.py --epochs 90 --rows fujitsu_span32_bn_lr0.1 --seeds 3 4 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/final-90ep-b4096-lr20-warmup27 --out docs/results --name "
           "final_90ep_b4096_lr20_warmup27_s3_4",
           "docs/results/final_90ep_b4096_lr20_warmup27_s3_4.json", _study, rerun=False),
    Result("final_90ep_b128_lr0.8",
           "issue 52, item 2: the tuned baseline at the peak LR its 90-epoch held-out ladder chose "
           "(b128_lr0.8_tail: SGD, LR 0.8, the un-augmented tail, the BN refit), 90 epochs, test "
           "set, 5 seeds at 541f812 (seeds 0-2 trained by this command's first run, seeds 3-4 read "
           "from their report)",
           R + "accuracy_study.py --epochs 90 --rows b128_lr0.8_tail --seeds 0 1 2 3 4 "
           "--finished-only --reuse docs/results/final_90ep_b128_lr0.8.json "
           "docs/results/final_90ep_b128_lr0.8_s3_4.json --runs "
           "runs/accuracy_study/final-90ep-b128-lr0.8 --out docs/results --name "
           "final_90ep_b128_lr0.8",
           "docs/results/final_90ep_b128_lr0.8.json", _study, rerun=False),
    Result("final_90ep_b128_lr0.8_s3_4",
           "issue 52, item 2: the tuned baseline at LR 0.8, 90 epochs, test set, seeds 3 and 4, at "
           "541f812",
           R + "accuracy_study.py --epochs 90 --rows b128_lr0.8_tail --seeds 3 4 --runs "
           "runs/accuracy_study/final-90ep-b128-lr0.8 --out docs/results --name "
           "final_90ep_b128_lr0.8_s3_4",
           "docs/results/final_90ep_b128_lr0.8_s3_4.json", _study, rerun=False),
    Result("final_90ep",
           "issue 52, item 2: the goal's comparison, the tuned batch 128 (at the LR its 90-epoch "
           "ladder chose, 0.8) against batch 4,096 and 8,192 (each at the peak LR, 20, and warmup "
           "its 90-epoch held-out tuning chose: 30% at 4,096, 40% at 8,192), 90 epochs, test set, "
           "every run at 541f812; each gap with its 95% interval (Welch), read from the three "
           "rows' reports (5 seeds each)",
           R + "accuracy_study.py --epochs 90 --rows b128_lr0.8_tail chosen_b4096_warmup27 "
           "chosen_b8192 --seeds 0 1 2 3 4 --baseline b128_lr0.8_tail --reuse "
           "docs/results/final_90ep_b128_lr0.8.json "
           "docs/results/final_90ep_b4096_lr20_warmup27.json "
           "docs/results/final_90ep_b8192.json --finished-only --runs "
           "runs/accuracy_study/final-90ep --out docs/results --name final_90ep",
           "docs/results/final_90ep.json", _study, rerun=False,
           readme="batch 128 vs 4,096 vs 8,192, each tuned, 90 epochs, 5 seeds (the goal, issue 52)"),
    Result("final_90ep_baseline_lr0.4",
           "issue 52, item 2: the same comparison against the baseline at the LR its 30-epoch "
           "budget chose (b128_lr0.4_tail), before its LR was tuned at 90 epochs too, 5 seeds a "
           "row, test set, every run at 541f812",
           R + "accuracy_study.py --epochs 90 --rows b128_lr0.4_tail chosen_b4096_warmup27 "
           "chosen_b8192 --seeds 0 1 2 3 4 --baseline b128_lr0.4_tail --reuse "
           "docs/results/final_90ep_b128.json docs/results/final_90ep_b4096_lr20_warmup27.json "
           "docs/results/final_90ep_b8192.json --finished-only --runs "
           "runs/accuracy_study/final-90ep --out docs/results --name final_90ep_baseline_lr0.4",
           "docs/results/final_90ep_baseline_lr0.4.json", _study, rerun=False),
    Result("final_90ep_warmup40",
           "issue 52, item 2: the goal's comparison with batch 4,096 at its tuned LR 20 but the "
           "recipe's 40% warmup (chosen_b4096; its tuning then chose 30%: final_90ep has that row), "
           "the tuned batch 128 and batch 8,192, 90 epochs, test set, every run at 541f812, 5 seeds "
           "a row, each gap with its 95% interval (Welch)",
           R + "accuracy_study.py --epochs 90 --rows b128_lr0.4_tail chosen_b4096 chosen_b8192 "
           "--seeds 0 1 2 3 4 --baseline b128_lr0.4_tail --reuse docs/results/final_90ep_b128.json "
           "docs/results/final_90ep_b4096_lr20.json docs/results/final_90ep_b8192.json "
           "--finished-only --runs runs/accuracy_study/final-90ep --out docs/results --name "
           "final_90ep_warmup40",
           "docs/results/final_90ep_warmup40.json", _study, rerun=False),
    Result("study_90ep",
           "the goal's measurement: batch 128 vs the chosen batch-4,096 row, 90 epochs, 3 seeds, test "
           "set (CPU; batch 128's runs read from accuracy_study_90ep_baseline.json)",
           R + "accuracy_study.py --epochs 90 --rows baseline fujitsu_span32_bn_lr0.1 --seeds 0 1 2 "
           "--reuse docs/results/accuracy_study_90ep.json docs/results/accuracy_study_90ep_baseline.json "
           "--finished-only --across-commits 00a19ac ad260be 595ef6c 2b1af3d 8074058 "
           "--name accuracy_study_90ep",
           "docs/results/accuracy_study_90ep.json", _study, rerun=False,
           readme="batch 128 untuned vs 4,096, 90 epochs, 3 seeds (issue 39)"),
    Result("baseline_b128_holdout",
           "issue 52, item 1: batch 128 tuned on 6,000 held-out images, 30 epochs (peak LR, warmup, "
           "label smoothing, the un-augmented tail, the BN refit), chosen by the worst of 3 seeds",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows b128_lr0.1 b128_lr0.2 "
           "b128_lr0.4 b128_lr0.8 b128_lr0.4_warmup b128_lr0.4_ls b128_lr0.4_tail b128_lr0.4_all "
           "--seeds 0 1 2 --finished-only --reuse docs/results/tuning/baseline_b128_30ep_holdout6000.json "
           "--runs runs/accuracy_study/tune-b128-30ep --out docs/results/tuning "
           "--name baseline_b128_30ep_holdout6000",
           "docs/results/tuning/baseline_b128_30ep_holdout6000.json", _study, rerun=False),
    Result("b8192_lr10_holdout",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 10, 6,000 held-out images, "
           "30 epochs, seed 0 (the first of its LR tuning)",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows chosen_b8192 --seeds 0 --runs "
           "runs/accuracy_study/tune-b8192-30ep-lr10 --out docs/results/tuning "
           "--name chosen_b8192_lr10_30ep_holdout6000 --extra optim.base_lr=10",
           "docs/results/tuning/chosen_b8192_lr10_30ep_holdout6000.json", _study, rerun=False),
    Result("b8192_lr5_holdout",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 5, 6,000 held-out images, "
           "30 epochs, seed 0 (the first of its LR tuning)",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows chosen_b8192 --seeds 0 --runs "
           "runs/accuracy_study/tune-b8192-30ep-lr5 --out docs/results/tuning "
           "--name chosen_b8192_lr5_30ep_holdout6000 --extra optim.base_lr=5",
           "docs/results/tuning/chosen_b8192_lr5_30ep_holdout6000.json", _study, rerun=False),
    Result("b8192_lr20_holdout",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 20, 6,000 held-out images, "
           "30 epochs, seed 0 (LR 5, 10 and 20 end within 0.3 pt: 180 steps, not the LR, limit it)",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows chosen_b8192 --seeds 0 --runs "
           "runs/accuracy_study/tune-b8192-30ep-lr20 --out docs/results/tuning "
           "--name chosen_b8192_lr20_30ep_holdout6000 --extra optim.base_lr=20",
           "docs/results/tuning/chosen_b8192_lr20_30ep_holdout6000.json", _study, rerun=False),
    Result("b8192_lr10_90ep_holdout",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 10, 6,000 held-out images, "
           "90 epochs, seed 0 (its LR tuning at the goal's length; LR 20 next)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 0 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr10 --out docs/results/tuning "
           "--name chosen_b8192_lr10_90ep_holdout6000 --extra optim.base_lr=10",
           "docs/results/tuning/chosen_b8192_lr10_90ep_holdout6000.json", _study, rerun=False),
    Result("b8192_lr20_90ep_holdout",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 20, 6,000 held-out images, "
           "90 epochs, seed 0 (its LR tuning at the goal's length, after LR 10)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 0 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr20 --out docs/results/tuning "
           "--name chosen_b8192_lr20_90ep_holdout6000 --extra optim.base_lr=20",
           "docs/results/tuning/chosen_b8192_lr20_90ep_holdout6000.json", _study, rerun=False),
    Result("b8192_lr20_90ep_holdout_s1_2",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 20, 6,000 held-out images, "
           "90 epochs, seeds 1 and 2 (with seed 0: the worst of 3 seeds chooses the LR)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 1 2 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr20 --out docs/results/tuning "
           "--name chosen_b8192_lr20_90ep_holdout6000_s1_2 --extra optim.base_lr=20",
           "docs/results/tuning/chosen_b8192_lr20_90ep_holdout6000_s1_2.json", _study, rerun=False),
    Result("b8192_lr40_90ep_holdout",
           "issue 52, item 2: the chosen row at batch 8,192, peak LR 40, 6,000 held-out images, "
           "90 epochs, seed 0 (its LR tuning at the goal's length, after LR 10 and 20)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 0 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr40 --out docs/results/tuning "
           "--name chosen_b8192_lr40_90ep_holdout6000_s0 --extra optim.base_lr=40",
           "docs/results/tuning/chosen_b8192_lr40_90ep_holdout6000_s0.json", _study, rerun=False),
    Result("b4096_lr10_90ep_holdout",
           "issue 52, item 2: the chosen row at batch 4,096, its recipe's peak LR 10, 6,000 held-out "
           "images, 90 epochs, seed 0 (its LR tuning at the goal's length; also item 4's chosen row)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 0 "
           "--runs runs/accuracy_study/ablation-90ep --out docs/results/tuning "
           "--name chosen_b4096_lr10_90ep_holdout6000",
           "docs/results/tuning/chosen_b4096_lr10_90ep_holdout6000.json", _study, rerun=False),
    *[Result(f"b4096_lr{lr}_90ep_holdout",
             f"issue 52, item 2: the chosen row at batch 4,096, peak LR {lr} ({than}), 6,000 "
             "held-out images, 90 epochs, seed 0 (its LR tuning at the goal's length)",
             R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 "
             f"--seeds 0 --extra optim.base_lr={lr} --runs runs/accuracy_study/tune-b4096-90ep-lr{lr} "
             f"--out docs/results/tuning --name chosen_b4096_lr{lr}_90ep_holdout6000",
             f"docs/results/tuning/chosen_b4096_lr{lr}_90ep_holdout6000.json", _study, rerun=False)
      for lr, than in B4096_LADDER_90EP],
    *[Result(f"b4096_lr{lr}_90ep_holdout_s1_2",
             f"issue 52, item 2: the chosen row at batch 4,096, peak LR {lr}, 6,000 held-out images, "
             "90 epochs, seeds 1 and 2 (with seed 0: the worst of 3 seeds chooses the LR)",
             R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 "
             f"--seeds 1 2{extra} --runs runs/accuracy_study/{runs} --out docs/results/tuning "
             f"--name chosen_b4096_lr{lr}_90ep_holdout6000_s1_2",
             f"docs/results/tuning/chosen_b4096_lr{lr}_90ep_holdout6000_s1_2.json", _study,
             rerun=False)
      for lr, extra, runs in (("5", " --extra optim.base_lr=5", "tune-b4096-90ep-lr5"),
                              ("10", "", "ablation-90ep"))],
    Result("b8192_warmup18_90ep_holdout",
           "issue 52, item 2: batch 8,192 at its chosen LR 20 with a 20% warmup (18 of 90 epochs, "
           "the decay still ending at epoch 88) instead of the recipe's 40%, 6,000 held-out "
           "images, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 0 --extra "
           "optim.base_lr=20 optim.warmup_epochs=18 optim.decay_epochs=70 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr20-warmup18 --out docs/results/tuning --name "
           "chosen_b8192_lr20_warmup18_90ep_holdout6000",
           "docs/results/tuning/chosen_b8192_lr20_warmup18_90ep_holdout6000.json", _study,
           rerun=False),
    Result("b8192_warmup27_90ep_holdout",
           "issue 52, item 2: batch 8,192 at its chosen LR 20 with a 30% warmup (27 of 90 epochs, "
           "the decay still ending at epoch 88) instead of the recipe's 40%, 6,000 held-out "
           "images, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 0 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "chosen_b8192_lr20_warmup27_90ep_holdout6000",
           "docs/results/tuning/chosen_b8192_lr20_warmup27_90ep_holdout6000.json", _study,
           rerun=False),
    Result("b8192_warmup27_90ep_holdout_s1",
           "issue 52, item 2: batch 8,192 at LR 20 with the 30% warmup, 6,000 held-out images, seed 1",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192 --seeds 1 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/tune-b8192-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "chosen_b8192_lr20_warmup27_90ep_holdout6000_s1",
           "docs/results/tuning/chosen_b8192_lr20_warmup27_90ep_holdout6000_s1.json", _study,
           rerun=False),
    Result("b4096_lr20_90ep_holdout_s1_2",
           "issue 52, item 2: the chosen row at batch 4,096, peak LR 20, 6,000 held-out images, "
           "90 epochs, seeds 1 and 2 (its seed 0 was above LR 10's worst of 3: still in the running)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 "
           "--seeds 1 2 --extra optim.base_lr=20 --runs runs/accuracy_study/tune-b4096-90ep-lr20 "
           "--out docs/results/tuning --name chosen_b4096_lr20_90ep_holdout6000_s1_2",
           "docs/results/tuning/chosen_b4096_lr20_90ep_holdout6000_s1_2.json", _study, rerun=False),
    Result("b8192_lamb_lr0.016_90ep_holdout",
           "issue 52, item 4: LAMB in place of LARS at batch 8,192 (the chosen recipe otherwise), "
           "peak LR 0.016 (the lowest of its ladder 0.016/0.032/0.064), 6,000 held-out images, "
           "90 epochs, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192_lamb --seeds 0 "
           "--extra optim.base_lr=0.016 --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr0.016 "
           "--out docs/results/tuning --name chosen_b8192_lamb_lr0.016_90ep_holdout6000",
           "docs/results/tuning/chosen_b8192_lamb_lr0.016_90ep_holdout6000.json", _study,
           rerun=False),
    Result("b4096_warmup18_90ep_holdout",
           "issue 52, item 2: batch 4,096 at its chosen LR 20 with a 20% warmup (18 of 90 epochs) "
           "instead of the recipe's 40%, 6,000 held-out images, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 0 "
           "--extra optim.base_lr=20 optim.warmup_epochs=18 optim.decay_epochs=70 --runs "
           "runs/accuracy_study/tune-b4096-90ep-lr20-warmup18 --out docs/results/tuning --name "
           "chosen_b4096_lr20_warmup18_90ep_holdout6000",
           "docs/results/tuning/chosen_b4096_lr20_warmup18_90ep_holdout6000.json", _study,
           rerun=False),
    Result("ablation_90ep_holdout_chosen",
           "issue 52, item 4: the ablation's chosen row, batch 4,096 at its chosen LR 20, 6,000 "
           "held-out images, 90 epochs, 3 seeds (read from the LR-20 tuning's reports), and the "
           "same runs before the BN refit (chosen_no_refit)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 0 1 "
           "2 --extra optim.base_lr=20 --runs runs/accuracy_study/tune-b4096-90ep-lr20 --reuse "
           "docs/results/tuning/chosen_b4096_lr20_90ep_holdout6000.json "
           "docs/results/tuning/chosen_b4096_lr20_90ep_holdout6000_s1_2.json --out "
           "docs/results/tuning --name ablation_90ep_holdout6000_fujitsu_span32_bn_lr0.1",
           "docs/results/tuning/ablation_90ep_holdout6000_fujitsu_span32_bn_lr0.1.json", _study,
           rerun=False),
    Result("b4096_warmup27_90ep_holdout",
           "issue 52, item 2: batch 4,096 at its chosen LR 20 with a 30% warmup (27 of 90 epochs) "
           "instead of the recipe's 40%, 6,000 held-out images, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 0 "
           "--extra optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/tune-b4096-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "chosen_b4096_lr20_warmup27_90ep_holdout6000",
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000.json", _study,
           rerun=False),
    Result("b8192_lamb_lr0.032_90ep_holdout",
           "issue 52, item 4: LAMB in place of LARS at batch 8,192, peak LR 0.032 (its ladder's "
           "second rung), 6,000 held-out images, 90 epochs, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192_lamb --seeds 0 "
           "--extra optim.base_lr=0.032 --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr0.032 "
           "--out docs/results/tuning --name chosen_b8192_lamb_lr0.032_90ep_holdout6000",
           "docs/results/tuning/chosen_b8192_lamb_lr0.032_90ep_holdout6000.json", _study,
           rerun=False),
    Result("b8192_lamb_lr0.064_90ep_holdout",
           "issue 52, item 4: LAMB in place of LARS at batch 8,192, peak LR 0.064 (its ladder's "
           "third rung), 6,000 held-out images, 90 epochs, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192_lamb --seeds 0 "
           "--extra optim.base_lr=0.064 --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr0.064 "
           "--out docs/results/tuning --name chosen_b8192_lamb_lr0.064_90ep_holdout6000",
           "docs/results/tuning/chosen_b8192_lamb_lr0.064_90ep_holdout6000.json", _study,
           rerun=False),
    Result("b4096_warmup27_90ep_holdout_s1",
           "issue 52, item 2: batch 4,096 at LR 20 with the 30% warmup, 6,000 held-out images, seed 1",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 1 "
           "--extra optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/tune-b4096-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "chosen_b4096_lr20_warmup27_90ep_holdout6000_s1",
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000_s1.json", _study,
           rerun=False),
    Result("b4096_warmup27_90ep_holdout_s2",
           "issue 52, item 2: batch 4,096 at LR 20 with the 30% warmup, 6,000 held-out images, seed 2",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 2 "
           "--extra optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/tune-b4096-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "chosen_b4096_lr20_warmup27_90ep_holdout6000_s2",
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000_s2.json", _study,
           rerun=False),
    Result("b8192_lamb_lr0.128_90ep_holdout",
           "issue 52, item 4: LAMB in place of LARS at batch 8,192, peak LR 0.128 (the rung above "
           "0.064, best of the first three), 6,000 held-out images, 90 epochs, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192_lamb --seeds 0 "
           "--extra optim.base_lr=0.128 --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr0.128 "
           "--out docs/results/tuning --name chosen_b8192_lamb_lr0.128_90ep_holdout6000",
           "docs/results/tuning/chosen_b8192_lamb_lr0.128_90ep_holdout6000.json", _study,
           rerun=False),
    Result("warmup_b4096_90ep_holdout",
           "issue 52, item 2: batch 4,096's warmup at its chosen LR 20, the recipe's 40% "
           "(chosen_b4096) against 30% (chosen_b4096_warmup27), 6,000 held-out images, 90 epochs, "
           "3 seeds each (read from the tuning's reports), chosen by the worst seed",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b4096 chosen_b4096_warmup27 "
           "--seeds 0 1 2 --finished-only --runs runs/accuracy_study/warmup-b4096-90ep --name "
           "warmup_b4096_90ep_holdout6000 --reuse "
           "docs/results/tuning/chosen_b4096_lr20_90ep_holdout6000.json "
           "docs/results/tuning/chosen_b4096_lr20_90ep_holdout6000_s1_2.json "
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000.json "
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000_s1.json "
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000_s2.json "
           "--out docs/results/tuning",
           "docs/results/tuning/warmup_b4096_90ep_holdout6000.json", _study, rerun=False),
    Result("ablation_90ep_holdout_chosen_warmup27",
           "issue 52, item 4: the ablation's chosen row once batch 4,096's warmup was chosen (LR 20, "
           "30% warmup), 6,000 held-out images, 90 epochs, 3 seeds (read from the warmup's "
           "reports), and the same runs before the BN refit (chosen_no_refit)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 --seeds 0 1 "
           "2 --extra optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/tune-b4096-90ep-lr20-warmup27 --reuse "
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000.json "
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000_s1.json "
           "docs/results/tuning/chosen_b4096_lr20_warmup27_90ep_holdout6000_s2.json --out "
           "docs/results/tuning --name ablation_90ep_holdout6000_fujitsu_span32_bn_lr0.1_warmup27",
           "docs/results/tuning/ablation_90ep_holdout6000_fujitsu_span32_bn_lr0.1_warmup27.json",
           _study, rerun=False),
    Result("b128_lr0.2_tail_90ep_holdout",
           "issue 52, item 1 at the goal's length: the tuned baseline's row at peak LR 0.2 (half "
           "its 30-epoch choice), 90 epochs, 6,000 held-out images, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows b128_lr0.2_tail --seeds 0 --runs "
           "runs/accuracy_study/target-90ep-holdout6000 --out docs/results/tuning --name "
           "b128_lr0.2_tail_90ep_holdout6000",
           "docs/results/tuning/b128_lr0.2_tail_90ep_holdout6000.json", _study, rerun=False),
    Result("ablation_90ep_holdout_no_ls_warmup27_s2",
           "issue 52, item 4: the ablation's row without label smoothing, one change from batch "
           "4,096's recipe as chosen (LR 20, 30% warmup), 6,000 held-out images, 90 epochs, seed 2",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_no_ls --seeds 2 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/ablation-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "ablation_90ep_holdout6000_chosen_no_ls_warmup27_s2",
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_ls_warmup27_s2.json", _study,
           rerun=False),
    Result("ablation_90ep_holdout_no_tail_warmup27_s2",
           "issue 52, item 4: the ablation's row without the un-augmented tail, one change from "
           "batch 4,096's recipe as chosen (LR 20, 30% warmup), 6,000 held-out images, 90 epochs, "
           "seed 2",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_no_tail --seeds 2 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/ablation-90ep-lr20-warmup27 --out docs/results/tuning --name "
           "ablation_90ep_holdout6000_chosen_no_tail_warmup27_s2",
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_tail_warmup27_s2.json", _study,
           rerun=False),
    Result("chosen_b8192_lamb_lr0.064_90ep_holdout_s1_2",
           "issue 52, item 4: LAMB in place of LARS at batch 8,192, at the LR its 90-epoch ladder "
           "chose (0.064), 6,000 held-out images, 90 epochs, seeds 1-2",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_b8192_lamb --seeds 1 2 --extra "
           "optim.base_lr=0.064 --runs runs/accuracy_study/tune-b8192-lamb-90ep-lr0.064 --name "
           "chosen_b8192_lamb_lr0.064_90ep_holdout6000_s1_2 --out docs/results/tuning",
           "docs/results/tuning/chosen_b8192_lamb_lr0.064_90ep_holdout6000_s1_2.json", _study,
           rerun=False),
    Result("ablation_90ep_holdout_no_ls_warmup27",
           "issue 52, item 4: the ablation's row without label smoothing, one change from batch "
           "4,096's recipe as chosen (LR 20, 30% warmup), 6,000 held-out images, 90 epochs, seeds 0-1",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_no_ls --seeds 0 1 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/ablation-90ep-lr20-warmup27 --name "
           "ablation_90ep_holdout6000_chosen_no_ls_warmup27 --out docs/results/tuning",
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_ls_warmup27.json", _study,
           rerun=False),
    Result("ablation_90ep_holdout_no_tail_warmup27",
           "issue 52, item 4: the ablation's row without the un-augmented tail, one change from batch "
           "4,096's recipe as chosen (LR 20, 30% warmup), 6,000 held-out images, 90 epochs, seeds 0-1",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_no_tail --seeds 0 1 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 --runs "
           "runs/accuracy_study/ablation-90ep-lr20-warmup27 --name "
           "ablation_90ep_holdout6000_chosen_no_tail_warmup27 --out docs/results/tuning",
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_tail_warmup27.json", _study,
           rerun=False),
    Result("ablation_90ep_holdout_ramp_warmup27",
           "issue 52, item 4: the ablation's row with the batch ramp (half the batch through the "
           "warmup), one change from batch 4,096's recipe as chosen (LR 20, 30% warmup), 6,000 "
           "held-out images, 90 epochs, seeds 0-1",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_ramp --seeds 0 1 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 'batch.ramp=[[27,4096]]' "
           "--runs runs/accuracy_study/ablation-90ep-lr20-warmup27 --name "
           "ablation_90ep_holdout6000_chosen_ramp_warmup27 --out docs/results/tuning",
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_ramp_warmup27.json", _study,
           rerun=False),
    Result("ablation_90ep_holdout_ramp_warmup27_s2",
           "issue 52, item 4: the ablation's row with the batch ramp (half the batch through the "
           "warmup), one change from batch 4,096's recipe as chosen (LR 20, 30% warmup), 6,000 "
           "held-out images, 90 epochs, seed 2",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows chosen_ramp --seeds 2 --extra "
           "optim.base_lr=20 optim.warmup_epochs=27 optim.decay_epochs=61 'batch.ramp=[[27,4096]]' "
           "--runs runs/accuracy_study/ablation-90ep-lr20-warmup27 --name "
           "ablation_90ep_holdout6000_chosen_ramp_warmup27_s2 --out docs/results/tuning",
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_ramp_warmup27_s2.json", _study,
           rerun=False),
    Result("target_b128_lr0.5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 128, peak LR "
           "0.5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b128 --extra optim.base_lr=0.5 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr0.5 --name "
           "target_b128_lr0.5_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b128_lr0.5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b128_lr1_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 128, peak LR "
           "1, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b128 --extra optim.base_lr=1 --runs runs/accuracy_study/target-90ep-holdout6000-lr1"
           " --name target_b128_lr1_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b128_lr1_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b128_lr2_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 128, peak LR "
           "2, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b128 --extra optim.base_lr=2 --runs runs/accuracy_study/target-90ep-holdout6000-lr2"
           " --name target_b128_lr2_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b128_lr2_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b512_lr1.25_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 512, peak LR "
           "1.25, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b512 --extra optim.base_lr=1.25 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr1.25 --name "
           "target_b512_lr1.25_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b512_lr1.25_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b512_lr2.5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 512, peak LR "
           "2.5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b512 --extra optim.base_lr=2.5 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr2.5 --name "
           "target_b512_lr2.5_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b512_lr2.5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b512_lr5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 512, peak LR "
           "5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b512 --extra optim.base_lr=5 --runs runs/accuracy_study/target-90ep-holdout6000-lr5"
           " --name target_b512_lr5_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b512_lr5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b1024_lr2.5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 1,024, peak "
           "LR 2.5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b1024 --extra optim.base_lr=2.5 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr2.5 --name "
           "target_b1024_lr2.5_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b1024_lr2.5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b1024_lr5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 1,024, peak "
           "LR 5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b1024 --extra optim.base_lr=5 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr5 --name target_b1024_lr5_90ep_holdout6000 "
           "--out docs/results/tuning",
           "docs/results/tuning/target_b1024_lr5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b1024_lr10_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 1,024, peak "
           "LR 10, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b1024 --extra optim.base_lr=10 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr10 --name target_b1024_lr10_90ep_holdout6000"
           " --out docs/results/tuning",
           "docs/results/tuning/target_b1024_lr10_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b2048_lr2.5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 2,048, peak "
           "LR 2.5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b2048 --extra optim.base_lr=2.5 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr2.5 --name "
           "target_b2048_lr2.5_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b2048_lr2.5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b2048_lr5_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 2,048, peak "
           "LR 5, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b2048 --extra optim.base_lr=5 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr5 --name target_b2048_lr5_90ep_holdout6000 "
           "--out docs/results/tuning",
           "docs/results/tuning/target_b2048_lr5_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b2048_lr10_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 2,048, peak "
           "LR 10, 90 epochs, 6,000 held-out images, seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b2048 --extra optim.base_lr=10 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr10 --name target_b2048_lr10_90ep_holdout6000"
           " --out docs/results/tuning",
           "docs/results/tuning/target_b2048_lr10_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b128_lr0.25_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 128, peak LR "
           "0.25 (the rung below its ladder's fastest), 90 epochs, 6,000 held-out images, seed 0: "
           "epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b128 --extra optim.base_lr=0.25 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr0.25 --name "
           "target_b128_lr0.25_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b128_lr0.25_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b512_lr0.625_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 512, peak LR "
           "0.625 (the rung below its ladder's fastest), 90 epochs, 6,000 held-out images, seed 0: "
           "epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b512 --extra optim.base_lr=0.625 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr0.625 --name "
           "target_b512_lr0.625_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b512_lr0.625_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b1024_lr1.25_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 1,024, peak "
           "LR 1.25 (the rung below its ladder's fastest), 90 epochs, 6,000 held-out images, seed 0: "
           "epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b1024 --extra optim.base_lr=1.25 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr1.25 --name "
           "target_b1024_lr1.25_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b1024_lr1.25_90ep_holdout6000.json", _target,
           rerun=False),
    Result("target_b2048_lr1.25_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 2,048, peak "
           "LR 1.25 (the rung below its ladder's fastest), 90 epochs, 6,000 held-out images, seed 0: "
           "epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b2048 --extra optim.base_lr=1.25 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr1.25 --name "
           "target_b2048_lr1.25_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b2048_lr1.25_90ep_holdout6000.json", _target,
           rerun=False),
    Result("epochs_to_target_90ep_holdout",
           "issue 52, item 3: epochs to target with each batch's peak LR tuned, batch 128 ... 8,192, "
           "90 epochs, 6,000 held-out images: every LR ladder of the chosen recipe (batch 128 ... "
           "2,048, seed 0; batch 4,096's and 8,192's LR and warmup tunings, their seeds) against the "
           "tuned baseline's held-out runs (LR 0.8, 3 seeds), to its final minus 0.3 pt and to 90%",
           R + f"epochs_tuned.py --reports {LARGE_BATCH_TUNINGS_90EP} {TARGET_LADDERS_90EP} "
           f"--reference {BASELINE_HOLDOUT_90EP} {EPOCHS_TUNED_90EP} "
           "--name epochs_to_target_90ep_holdout6000",
           "docs/results/tuning/epochs_to_target_90ep_holdout6000.json", _epochs_tuned,
           rerun=False,
           readme="epochs to target, each batch's LR tuned, 90 epochs, held-out (issue 52)"),
    Result("target_b1024_lr0.625_90ep_holdout",
           "issue 52, item 3: the chosen recipe (LARS, 40% warmup, tail, refit) at batch 1,024, peak "
           "LR 0.625 (the rung below its ladder's fastest, 1.25), 90 epochs, 6,000 held-out images, "
           "seed 0: epochs to 90%",
           R + "accuracy_study.py --epochs 90 --grid target --holdout 6000 --seeds 0 --target 0.9 --rows "
           "target_b1024 --extra optim.base_lr=0.625 --runs "
           "runs/accuracy_study/target-90ep-holdout6000-lr0.625 --name "
           "target_b1024_lr0.625_90ep_holdout6000 --out docs/results/tuning",
           "docs/results/tuning/target_b1024_lr0.625_90ep_holdout6000.json", _target,
           rerun=False),
    Result("b128_lr0.8_tail_90ep_holdout",
           "issue 52, item 1 at the goal's length: the tuned baseline's row at peak LR 0.8 (twice "
           "its 30-epoch choice), 90 epochs, 6,000 held-out images, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows b128_lr0.8_tail --seeds 0 --runs "
           "runs/accuracy_study/target-90ep-holdout6000 --out docs/results/tuning --name "
           "b128_lr0.8_tail_90ep_holdout6000",
           "docs/results/tuning/b128_lr0.8_tail_90ep_holdout6000.json", _study, rerun=False),
    Result("b128_lr1.6_tail_90ep_holdout",
           "issue 52, item 1 at the goal's length: the tuned baseline's row at peak LR 1.6 (the rung "
           "above 0.8, whose seed 0 came out best), 90 epochs, 6,000 held-out images, seed 0 (the "
           "0.8 row with optim.base_lr=1.6: 541f812 has no b128_lr1.6 row)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows b128_lr0.8_tail --seeds 0 --extra "
           "optim.base_lr=1.6 --runs runs/accuracy_study/target-90ep-holdout6000-lr1.6 --out "
           "docs/results/tuning --name b128_lr1.6_tail_90ep_holdout6000",
           "docs/results/tuning/b128_lr1.6_tail_90ep_holdout6000.json", _study, rerun=False),
    Result("b128_lr0.8_tail_90ep_holdout_s1_2",
           "issue 52, item 1 at the goal's length: the tuned baseline's row at peak LR 0.8, 90 "
           "epochs, 6,000 held-out images, seeds 1 and 2",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows b128_lr0.8_tail --seeds 1 2 --runs "
           "runs/accuracy_study/target-90ep-holdout6000 --out docs/results/tuning --name "
           "b128_lr0.8_tail_90ep_holdout6000_s1_2",
           "docs/results/tuning/b128_lr0.8_tail_90ep_holdout6000_s1_2.json", _study, rerun=False),
    Result("lr_b128_90ep_holdout",
           "issue 52, item 1 at the goal's length: batch 128's peak LR ladder (0.2, 0.4, 0.8, 1.6) "
           "at 90 epochs, 6,000 held-out images, read from its reports, chosen by the worst of 3 "
           "seeds (an LR whose seed 0 is below the leader's worst is out without seeds 1-2)",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows b128_lr0.2_tail b128_lr0.4_tail "
           "b128_lr0.8_tail b128_lr1.6_tail --seeds 0 1 2 --finished-only --runs "
           "runs/accuracy_study/lr-b128-90ep --name lr_b128_90ep_holdout6000 --reuse "
           "docs/results/tuning/b128_lr0.2_tail_90ep_holdout6000.json "
           "docs/results/tuning/b128_lr0.4_tail_90ep_holdout6000.json "
           "docs/results/tuning/b128_lr0.8_tail_90ep_holdout6000.json "
           "docs/results/tuning/b128_lr0.8_tail_90ep_holdout6000_s1_2.json "
           "docs/results/tuning/b128_lr1.6_tail_90ep_holdout6000.json --out docs/results/tuning",
           "docs/results/tuning/lr_b128_90ep_holdout6000.json", _study, rerun=False),
    Result("b128_tail_90ep_holdout",
           "issue 52, item 3's base: the tuned baseline (batch 128, SGD, LR 0.4, the un-augmented "
           "tail and the refit), 6,000 held-out images, 90 epochs, seed 0",
           R + "accuracy_study.py --epochs 90 --holdout 6000 --rows b128_lr0.4_tail --seeds 0 "
           "--runs runs/accuracy_study/target-90ep-holdout6000 --out docs/results/tuning "
           "--name b128_lr0.4_tail_90ep_holdout6000",
           "docs/results/tuning/b128_lr0.4_tail_90ep_holdout6000.json", _study, rerun=False),
    Result("epochs_to_target_b4096_b8192_90ep",
           "issue 52, item 3 so far, the goal's 90 epochs with each batch's peak LR (and warmup, "
           "where tried) tuned: batch 4,096's and 8,192's ladders against the tuned baseline's "
           "held-out runs (LR 0.8, the LR its 90-epoch ladder chose, 3 seeds), "
           "epochs to its final minus 0.3 pt and to 90%, 6,000 held-out images",
           R + f"epochs_tuned.py --reports {LARGE_BATCH_TUNINGS_90EP} "
           f"--reference {BASELINE_HOLDOUT_90EP} {EPOCHS_TUNED_90EP} "
           "--name epochs_to_target_b4096_b8192_90ep_holdout6000",
           "docs/results/tuning/epochs_to_target_b4096_b8192_90ep_holdout6000.json", _epochs_tuned,
           rerun=False),
    Result("ablation_90ep_holdout",
           "issue 52, item 4: what each technique of the seeds earns at the large batch, 90 epochs, "
           "6,000 held-out images, 3 seeds a row: each row one change from batch 4,096's recipe as "
           "chosen (LR 20, 30% warmup), and LAMB against LARS at 8,192, each at its held-out LR",
           "python bench/ablation.py --reports "
           "docs/results/tuning/ablation_90ep_holdout6000_fujitsu_span32_bn_lr0.1_warmup27.json "
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_ls_warmup27.json "
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_ls_warmup27_s2.json "
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_tail_warmup27.json "
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_no_tail_warmup27_s2.json "
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_ramp_warmup27.json "
           "docs/results/tuning/ablation_90ep_holdout6000_chosen_ramp_warmup27_s2.json "
           "docs/results/tuning/chosen_b8192_lr20_90ep_holdout6000.json "
           "docs/results/tuning/chosen_b8192_lr20_90ep_holdout6000_s1_2.json "
           "docs/results/tuning/chosen_b8192_lamb_lr0.064_90ep_holdout6000.json "
           "docs/results/tuning/chosen_b8192_lamb_lr0.064_90ep_holdout6000_s1_2.json "
           "--out docs/results/tuning --name ablation_90ep_holdout6000",
           "docs/results/tuning/ablation_90ep_holdout6000.json", _ablation, rerun=False,
           readme="what each technique earns at 4,096, LARS vs LAMB at 8,192, 3 seeds (issue 52)"),
    Result("epochs_to_target_b8192_length_tuned",
           "issue 52, item 3, with the schedule's length tuned too (as MLPerf's points tune the "
           "epochs): batch 8,192's LR ladders at 30 and 90 epochs against the tuned batch 128 at 30 "
           "epochs, 6,000 held-out images, epochs to 90%",
           "python bench/epochs_tuned.py "
           "--reports docs/results/tuning/chosen_b8192_lr5_30ep_holdout6000.json:chosen_b8192 "
           "docs/results/tuning/chosen_b8192_lr10_30ep_holdout6000.json:chosen_b8192 "
           "docs/results/tuning/chosen_b8192_lr20_30ep_holdout6000.json:chosen_b8192 "
           "docs/results/tuning/chosen_b8192_lr10_90ep_holdout6000.json:chosen_b8192 "
           "docs/results/tuning/chosen_b8192_lr20_90ep_holdout6000.json:chosen_b8192 "
           "docs/results/tuning/chosen_b8192_lr20_90ep_holdout6000_s1_2.json:chosen_b8192 "
           "docs/results/tuning/chosen_b8192_lr40_90ep_holdout6000_s0.json:chosen_b8192 --reference "
           "docs/results/tuning/baseline_b128_30ep_holdout6000.json:b128_lr0.4_tail --target 0.9 "
           "--tuned optim.base_lr epochs optim.warmup_epochs optim.decay_epochs "
           "polish.last_epochs_without_augmentation --out docs/results/tuning --name "
           "epochs_to_target_b8192_length_tuned_holdout6000",
           "docs/results/tuning/epochs_to_target_b8192_length_tuned_holdout6000.json", _epochs_tuned,
           rerun=False),
    Result("brakes_holdout",
           "issue 39, item 1: one brake at a time on the Fujitsu row, 6,000 held-out images, 30 "
           "epochs, chosen by the worst of 3 seeds (in progress: the report names the pending runs)",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows fujitsu_span32 "
           "fujitsu_span32_bn_lr0.1 fujitsu_span32_trust_clip1 fujitsu_span32_momentum_correction "
           "fujitsu_span32_warmup50 fujitsu_span32_lr5 --seeds 0 1 2 --finished-only --reuse "
           "docs/results/tuning/brakes_30ep_holdout6000.json --out docs/results/tuning "
           "--name brakes_30ep_holdout6000",
           "docs/results/tuning/brakes_30ep_holdout6000.json", _study, rerun=False),
    Result("differences_holdout",
           "issue 39, item 2: Fujitsu's differences one at a time on LARS in the records' regime, "
           "6,000 held-out images, 30 epochs, 2 seeds: the trust coefficient 0.0025 carries the lead",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows lars_records "
           "records_plus_eta0.0025 records_plus_m0.96 records_plus_trust_decay records_plus_warmup40 "
           "records_plus_decay52 records_plus_span32 --seeds 0 1 --jobs 2 --out "
           "docs/results/tuning --name differences_30ep_holdout6000 "
           "--reuse docs/results/tuning/differences_30ep_holdout6000.json",
           "docs/results/tuning/differences_30ep_holdout6000.json", _study, rerun=False),
    Result("eta_vs_chosen_holdout",
           "issue 39: the records-regime LARS with the trust coefficient 0.0025 against the chosen "
           "braked Fujitsu row, 6,000 held-out images, 30 epochs, by the worst of 3 seeds",
           R + "accuracy_study.py --epochs 30 --holdout 6000 --rows fujitsu_span32_bn_lr0.1 "
           "records_plus_eta0.0025 --seeds 0 1 2 --jobs 1 --out docs/results/tuning "
           "--name eta_vs_chosen_30ep_holdout6000 --reuse "
           "docs/results/tuning/brakes_30ep_holdout6000.json "
           "docs/results/tuning/differences_30ep_holdout6000.json",
           "docs/results/tuning/eta_vs_chosen_30ep_holdout6000.json", _study, rerun=False),
    Result("epochs_to_target_90ep",
           "issue 39, item 4: epochs to batch 128's final top-1 minus 0.3 pt, the chosen row at batch "
           "128 ... 8,192, 90 epochs, seed 0, test set (CPU), beside MLPerf's reference convergence "
           "points (batch 4,096's run read from accuracy_study_90ep.json)",
           R + "accuracy_study.py --grid target --epochs 90 --seeds 0 --jobs 2 --target-from "
           "docs/results/accuracy_study_90ep.json --extra-targets 0.9 --reuse "
           "docs/results/accuracy_study_90ep.json docs/results/epochs_to_target_90ep.json",
           "docs/results/epochs_to_target_90ep.json", _target, rerun=False,
           readme="epochs to target, batch 128 ... 8,192, 90 epochs, one LR each, test set (issue 39)"),
    Result("study_10ep", "earlier large-batch study (10 epochs, LRs tuned on the test set)",
           R + "accuracy_study.py --jobs 2", "docs/results/accuracy_study.json", _study,
           rerun=False),
    Result("throughput_cpu_dali",
           "the trainer fed by DALI vs synthetic data (CPU, resnet18, 64 px, fp32)",
           R + "throughput.py --model resnet18 --batch 32 --image-size 64 --images 640 --dali-images 640 "
           "--dali-threads 2 --bare-steps 20 --bare-warmup 5 --epochs 3 --loaders synthetic dali "
           "--channels-last off --compile off --precisions fp32 --out bench/results/throughput_cpu_2_cores_dali.json",
           "bench/results/throughput_cpu_2_cores_dali.json", _throughput),
    Result("throughput_cpu_fp32_bf16",
           "bf16 autocast vs fp32 on a CPU without AVX-512 BF16 (an earlier machine)",
           R + "throughput.py --model resnet18 --batch 16 --image-size 32 --images 64 --bare-steps 4 "
           "--bare-warmup 1 --epochs 2 --loaders synthetic --channels-last off --compile off --precisions "
           "fp32 bf16 --out bench/results/throughput_cpu_2_cores_fp32_bf16.json",
           "bench/results/throughput_cpu_2_cores_fp32_bf16.json", _throughput, rerun=False),
    Result("optimizer_step_layouts", "LAMB on NCHW vs channels_last parameters (15 rounds)",
           R + "optimizer_step.py --rounds 15 --out bench/results/optimizer_step_cpu_layouts.json",
           "bench/results/optimizer_step_cpu_layouts.json",
           "LAMB channels_last {median_step_ms.dstrain_lamb_channels_last / median_step_ms.dstrain_lamb"
           ":.3f}x the time of LAMB NCHW", code=OPTIMIZER_CODE),
    Result("overhead_1rank_95e4140",
           "trainer overhead at 95e4140 (the loop before issue 15), same machine as overhead_1rank",
           "git worktree add /tmp/base 95e4140 && cd /tmp/base && python bench/overhead.py",
           "bench/results/overhead_cpu_1rank_95e4140.json",
           "trainer step {overhead_ratio:.3f}x a bare DeepSpeed step (bare {median_step_ms.bare:.1f} ms)",
           code=(), rerun=False),
    Result("code_shape", "code shape of the package (files, lines, cycles, signatures)",
           T + "code_shape.py", "bench/results/code_shape.json", _code_shape, code=("dstrain",)),
    Result("code_shape_71a43a9", "code shape at 71a43a9 (before issue 32's second step)",
           T + "code_shape.py --package CHECKOUT_AT_71a43a9/dstrain --out bench/results/code_shape_71a43a9.json",
           "bench/results/code_shape_71a43a9.json", _code_shape, code=(), rerun=False),
    Result("code_shape_95e4140", "code shape at 95e4140 (before the redesign)",
           T + "code_shape.py --package /tmp/base/dstrain --out bench/results/code_shape_95e4140.json",
           "bench/results/code_shape_95e4140.json", _code_shape, code=(), rerun=False),
    Result("cpu_channels_last_crash",
           "oneDNN's channels_last backward crash on narrow convolutions (CPU)",
           R + "cpu_channels_last_crash.py", "bench/results/cpu_channels_last_crash.json", _crash,
           code=("bench/cpu_channels_last_crash.py",)),
    Result("recipe_fashion_mnist_c8827d4",
           "default recipe at c8827d4, with augmentation (its first result)",
           "python -m dstrain --config fashion_mnist data.augment=true",
           "bench/results/recipe_fashion_mnist.json",
           "{final_top1:.1%} top-1, {epochs} epochs, {train_wall_time_s:.0f} s training", code=(),
           rerun=False),
    Result("suite_cpu_quick", "the quick loop (`-m 'not slow'`)",
           "./run.sh test -q -m 'not slow' --junitxml=/tmp/dstrain-quick.xml; python tools/suite.py "
           "--junit /tmp/dstrain-quick.xml --ran \"./run.sh test -q -m 'not slow'\" "
           "--out bench/results/suite_cpu_2_cores_quick.json",
           "bench/results/suite_cpu_2_cores_quick.json", suite_headline,
           code=(*SUITE, "requirements.txt"), rerun=False,
           readme='the quick loop, `./run.sh test -m "not slow"`'),
    Result("accuracy_sweep",
           "one-seed LR / warmup / ramp sweep, batch 4,096, 10 epochs (LRs chosen on the test set)",
           "bench/accuracy_study.py at 4a0cead with uncommitted --jobs (the note in the file)",
           "docs/results/accuracy_sweep.json", _sweep, code=(), rerun=False),
    Result("probe_lars_lr_1.25",
           "`fashion_mnist_lars` at LR 1.25 diverging at the switch to batch 4,096 (a log)",
           "python -m dstrain --config fashion_mnist_lars optim.base_lr=1.25",
           "bench/results/probe_lars_base_lr_1.25.log",
           lambda d: d["text"].splitlines()[1].lstrip("# "), code=(), rerun=False),
    *[Result(f"recipe_lars_{e}ep", f"the `recipe_lars` row run for {e} epochs (seed 0)",
             R + f"accuracy_study.py --rows recipe_lars --seeds 0 --epochs {e} "
             f"--out docs/results/recipe_epochs/e{e}",
             f"docs/results/recipe_epochs/e{e}/accuracy_study.json", _study, rerun=False)
      for e in (20, 30)],
    Result("lars_tensors_fujitsu_seed2",
           "Fujitsu recipe, seed 2, 30-epoch row rerun with log.lars_tensors (the run of "
           "`accuracy_study.py --epochs 30 --rows fujitsu_span32 --seeds 2 --runs "
           "runs/accuracy_study/diag-30ep --extra log.tensorboard=true log.lars_tensors=true "
           "log.every_steps=1`), 30 epochs",
           R + "lars_tensors.py runs/accuracy_study/diag-30ep/fujitsu_span32-2 "
           "--name lars_tensors_fujitsu_span32_seed2_30ep",
           "docs/results/stability/lars_tensors_fujitsu_span32_seed2_30ep.json", _lars_tensors,
           code=(*TRAINER, "bench/accuracy_study.py", "bench/study", "bench/lars_tensors.py"), rerun=False),
    *[Result(f"tuning_fujitsu_lr{lr}", f"Fujitsu recipe, peak LR {lr}, on 6,000 held-out images",
             R + f"accuracy_study.py --epochs 10 --holdout 6000 --rows fujitsu_span32 --seeds 0 "
             f"--out docs/results/tuning --name fujitsu_lr{lr}_10ep_holdout6000 --extra optim.base_lr={lr}",
             f"docs/results/tuning/fujitsu_lr{lr}_10ep_holdout6000.json", _tuning, rerun=False)
      for lr in ("1.6", "4", "10")],
    *[Result(f"tuning_{stem}_lr{lr}_30ep", f"{what}, LR {lr}, 30 epochs, on 6,000 held-out images",
             R + f"accuracy_study.py --epochs 30 --holdout 6000 --rows {row} --seeds 0 "
             f"--runs runs/accuracy_study/tune-{stem}-30ep-lr{lr} --out docs/results/tuning "
             f"--name {stem}_lr{lr}_30ep_holdout6000 --extra optim.base_lr={lr}",
             f"docs/results/tuning/{stem}_lr{lr}_30ep_holdout6000.json", _tuning, rerun=False)
      for stem, row, what, lrs in TUNING_30EP for lr in lrs],
    Result("goyal_lr0.4_30ep",
           "Goyal SGD at the baseline's 0.4 per 256 images (6.4 at 4,096), 30 epochs, test set",
           R + "accuracy_study.py --epochs 30 --rows goyal_4096 --seeds 0 "
           "--runs runs/accuracy_study/goyal-lr0.4-30ep --name goyal_lr0.4_30ep --extra optim.base_lr=0.4",
           "docs/results/goyal_lr0.4_30ep.json", _study, rerun=False),
]
# fmt: on


def _gpu(d: dict) -> str:
    """A headline for any file of ``./run.sh gpu`` (tools/gpu_run.py), by what it holds."""
    if "counts" in d:
        return suite_headline(d)
    rows = d.get("rows")
    if isinstance(rows, dict):  # smoke: one run per shipped JSON
        ok = sum(1 for r in rows.values() if r.get("exit") == 0)
        return f"{ok} of {len(rows)} runs exited 0"
    ratios = [r["vs_bare"] for r in rows or [] if isinstance(r, dict) and r.get("vs_bare")]
    if ratios:
        return f"dstrain vs its bare twin {ratio(min(ratios))} to {ratio(max(ratios))} ({len(ratios)} rows)"
    if "median_step_ms" in d:
        return f"{len(d['median_step_ms'])} optimizer steps timed"
    if "runs" in d:
        return f"{len(d['runs'])} training runs"
    return f"{len(rows or [])} rows"


def gpu_results(registry: Path = REPO / GPU_IMPORTS) -> list[Result]:
    """One Result per GPU file ``./run.sh gpu-import`` brought in: registered by data, not code."""
    entries = json.loads(registry.read_text())["results"] if registry.is_file() else []
    return [
        Result(
            "gpu_" + Path(e["file"]).stem,
            f"GPU `{e['part']}` part" + ("" if e["complete"] else " (partial)"),
            f"./run.sh gpu {e['part']}",
            e["file"],
            _gpu,
            code=(*TRAINER, "bench/*.py", "tools/gpu_run.py"),
            rerun=False,
        )
        for e in entries
    ]


RESULTS += gpu_results()

# Numbers the docs write that no result file of ours holds: published figures and arithmetic. A doc
# names the one it quotes right after the number, <!-- published NAME --> or <!-- derived NAME -->:
# keyed by name and by the docs that may quote it, never by the printed text (issue 53: "6.8% of
# ImageNet" passed because "6.8%" was a key). A published figure must be written as registered; a
# derived one must print from its value (a share or a factor as a fraction, shown x 100 with %).
DOCS_GPU = ("docs/gpu.md", "docs/usage.md", "ds_configs/README.md", "docs/results/README.md")
PUBLISHED = {  # name -> (the figure as written, where it comes from, the docs that quote it)
    "fujitsu_v06_top1": (
        "75.98%",
        "Fujitsu's MLPerf v0.6 record (METHODS.md)",
        ("docs/large-batch.md", "docs/usage.md"),
    ),
    "mlperf_resnet_target": (
        "75.9%",
        "MLPerf's ResNet-50 target (MLCommons rcps_resnet.json)",
        ("docs/large-batch.md", "docs/mlperf.md", "docs/usage.md"),
    ),
    "h100_autocast_vs_bare_amp": (
        "0.96x",
        "issue 16: an H100 run of the code before it, bf16/autocast fp16 vs a bare AMP loop",
        DOCS_GPU,
    ),
    "h100_native_fp16_vs_bare_amp": (
        "0.52x",
        "issue 16: the same H100 run, DeepSpeed's native fp16 engine",
        (*DOCS_GPU, "docs/deepspeed-guards.md"),
    ),
}
SHARE_DOCS = ("docs/large-batch.md", "docs/usage.md", "docs/results/README.md")
DERIVED = {  # name -> (value, what it is, the docs that quote it)
    "fashion_share_b4096": (
        4096 / 60000,
        "the study's batch as a share of Fashion-MNIST's training set",
        SHARE_DOCS,
    ),
    "imagenet_share_b86016": (
        86016 / 1281167,
        "Fujitsu's batch as a share of ImageNet's training set",
        SHARE_DOCS,
    ),
    "fujitsu_end_lr_factor": (
        0.0025,
        "Fujitsu's end LR: 0.0025 of the peak (the recipe's poly decay)",
        ("docs/large-batch.md",),
    ),
}
