"""Every result README and the docs quote: its command, its file, its numbers and whether it is current.

    python tools/evidence.py index            # write the tables (docs/results/README.md, README.md's
    ./run.sh results --index                  #   results) from the result files, staleness included
    python tools/evidence.py check            # exit 1 when a table or a number the docs quote differs
                                              # from its result file (tests/test_evidence.py runs this)
    python tools/evidence.py stale            # which results the code changed since they ran (exit 0:
    ./run.sh results --stale                  #   a report, not a gate)
    python tools/evidence.py run [KEY ...]    # rerun every CPU result's command (all but the long studies
    ./run.sh results                          #   and the test suite), one after the other, then the index
    ./run.sh results suite_cpu suite_cpu_oldest   # the test suite's outcome (CI's two steps), its own step

A result is *current* when none of the code it measures (``Result.code``) differs between the commit
it ran at and the working tree; otherwise ``stale`` names what changed (``git diff --name-only SHA``,
so a change made and reverted does not count, and uncommitted changes do). A result run on an
uncommitted tree (SHA ``...-dirty``) says so. The index records staleness as of its writing; the check
ignores that column, so a code commit does not fail the tests until the index is rewritten.

The docs' numbers are checked against the files in two ways. (1) In README.md and
docs/results/README.md every percentage and every ratio written ``0.97x`` must be one of the strings a
result renders from its file (``Result.quotes``), or a published number listed in ``PUBLISHED``.
(2) In README.md and docs/*.md, a paragraph or table row that links a result file cites it: every
number with a unit there (``%``, ``x``, ``pt``, ``img/s``, ``ms``, ``s``, ``min``) must be a value of a
cited file at the precision written (a JSON leaf, as a fraction or in percent; or a number in a
text/markdown result), a quote, or in ``PUBLISHED``/``STATED``; and every file linked must be
registered here. A number typed by hand, or left behind when its file was regenerated, fails.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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
# what a run of the test suite depends on: the code, the tests, the scripts they run, the pins
SUITE = (
    *TRAINER,
    "tests",
    "bench/*.py",
    "tools/*.py",
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
    code: tuple[str, ...]  # what it measures: a change here makes the result stale
    headline: Callable[[dict], str]
    quotes: Callable[[dict], dict[str, list[str]]] = field(default=lambda d: {})
    # part of `run`; False: the long accuracy studies and the test suite, each its own step
    rerun: bool = True
    readme: str = ""  # a row of README's results table, with this label (empty: the index only)
    # numbers derived from the file (ratios of two rows, ...) that the docs may cite besides its leaves
    values: Callable[[dict], list[float]] = field(default=lambda d: [])

    def exists(self) -> bool:
        return (REPO / self.file).is_file()

    def load(self) -> dict:
        path = REPO / self.file
        if path.suffix == ".json":
            return json.loads(path.read_text())
        text = path.read_text()  # faults.md: "git <sha>" in its header
        m = re.search(r"\bgit ([0-9a-f]{40}(?:-dirty)?)", text)
        return {"git_sha": m.group(1) if m else None, "text": text}

    def shas(self, d: dict) -> list[str]:
        shas = d.get("run_git_shas") or [
            d.get("git_sha") or d.get("environment", {}).get("git_sha")
        ]
        return [s for s in shas if s]


# ------------------------------------------------------------------- headlines and README quotes


def _default_recipe(d: dict) -> str:
    return f"{pct(d['final_top1'])} top-1, {d['epochs']} epochs, {d['train_wall_time_s']:.0f} s training"


def _overhead(d: dict) -> str:
    ms = d["median_step_ms"]
    return f"trainer step {ratio(d['overhead_ratio'], 3)} a bare DeepSpeed step (bare {ms['bare']:.1f} ms)"


def _scaling(d: dict) -> str:
    ips = d["images_per_s"]
    return (
        f"1 -> 2 ranks (1 thread each): {ips['1x1']:,.0f} -> {ips['2x1']:,.0f} img/s, "
        f"{ratio(d['speedup'])}, {pct(d['scaling_efficiency'], 0)} efficiency"
    )


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


def _polish(d: dict) -> str:
    s = d["summary"]
    return (
        f"{len(s['none']['values'])} seeds, batch 4,096: none {100 * s['none']['mean']:.2f}, refit "
        f"{100 * s['refit']['mean']:.2f}, last K {100 * s['k_epochs']['mean']:.2f}, both "
        f"{100 * s['both']['mean']:.2f}; refit {pct(s['refit_fraction']['mean'])} of training time"
    )


def _polish_quotes(d: dict) -> dict[str, list[str]]:
    s = d["summary"]
    m = {k: f"{100 * s[k]['mean']:.2f}" for k in ("none", "refit", "k_epochs", "both")}
    return {
        "docs/usage.md": [
            f"({m['none']} -> {m['refit']} refit, {m['k_epochs']} K=1, {m['both']} both",
            f"for {pct(s['refit_fraction']['mean'])} extra time",
        ]
    }


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


def _row_ratios(d: dict) -> list[float]:
    """images/s of every row over every other row of one throughput run (twins, DALI vs synthetic,
    bf16 vs fp32, ...)."""
    ips = [r["images_per_s"] for r in d["rows"]]
    return [a / b for a in ips for b in ips if b]


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


def _tuning(d: dict) -> str:
    (run,) = [r for r in d["runs"] if not r["row"].endswith("_no_refit")]
    lr = re.search(r"optim\.base_lr=(\S+)", d["command"]).group(1)
    return f"LR {lr}, {d['epochs']} epochs: {pct(run['final_top1'], 2)} held-out top-1"


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


def _records_quotes(d: dict) -> dict[str, list[str]]:
    """docs/results/README.md's table of issue 33's rows: test and train top-1, distance to batch 128."""
    runs = {r["row"]: r for r in d["runs"] if r["seed"] == 0}
    base = 100 * runs["baseline"]["final_top1"]
    rows = []
    for k in RECORDS_ROWS:
        top1, train = 100 * runs[k]["final_top1"], 100 * runs[k]["final_train_top1"]
        gap = "" if k == "baseline" else f" {top1 - base:+.2f} |"
        rows.append(f"| {top1:.2f} | {train:.2f} |{gap}")
    return {"docs/results/README.md": rows}


def _seeds_quotes(d: dict) -> dict[str, list[str]]:
    by_row = _by_row(d)
    return {"docs/results/README.md": [_mean_sd(by_row[k]) for k in ("baseline", "fujitsu_span32")]}


def _mean_sd(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.2f} +- {100 * statistics.stdev(values):.2f}%"


def _study10_quotes(d: dict) -> dict[str, list[str]]:
    by_row = _by_row(d)
    return {
        "docs/results/README.md": [
            _mean_sd(by_row[k]) for k in ("baseline", "recipe_lars", "recipe_lamb")
        ]
    }


def _throughput_quotes(d: dict) -> dict[str, list[str]]:
    rs = _throughput_ratios(d)
    return {"docs/results/README.md": [f"{min(rs):.2f}x-{max(rs):.2f}x"]}


def _layouts(d: dict) -> list[float]:
    ms = d["median_step_ms"]
    return [ms["dstrain_lamb_channels_last"] / ms["dstrain_lamb"]]


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
R = "python bench/"  # a benchmark
T = "python tools/"  # project tooling
RESULTS = [
    Result(
        "default_recipe",
        "default recipe (`fashion_mnist`)",
        R + "default_recipe.py",
        "bench/results/default_recipe.json",
        (*TRAINER, "bench/default_recipe.py"),
        _default_recipe,
        lambda d: {
            "docs/usage.md": [
                f"| {pct(d['final_top1'])} test top-1, {d['train_wall_time_s']:.0f} s training",
            ]
        },
        readme="default recipe (`./run.sh train`), 2 CPU cores",
    ),
    Result(
        "recipe_fashion_mnist_lars",
        "shipped `fashion_mnist_lars` recipe",
        R + "default_recipe.py --config fashion_mnist_lars",
        "bench/results/recipe_fashion_mnist_lars.json",
        (*TRAINER, "bench/default_recipe.py"),
        _default_recipe,
        lambda d: {
            "docs/usage.md": [
                f"| {pct(d['final_top1'])} test top-1, {d['train_wall_time_s']:.0f} s"
            ]
        },
        readme="the `fashion_mnist_lars` recipe (batch ramp to 4,096, LARS)",
    ),
    Result(
        "overhead_1rank",
        "trainer overhead, 1 rank",
        R + "overhead.py",
        "bench/results/overhead_cpu_1rank.json",
        (*TRAINER, "bench/overhead.py"),
        _overhead,
        lambda d: {"docs/results/README.md": [f"| {ratio(d['overhead_ratio'], 3)} (1 rank)"]},
        readme="trainer step vs a bare DeepSpeed loop, 1 rank",
    ),
    Result(
        "overhead_1rank_1thread",
        "trainer overhead, 1 rank, 1 thread",
        "OMP_NUM_THREADS=1 "
        + R
        + "overhead.py --out bench/results/overhead_cpu_1rank_1thread.json",
        "bench/results/overhead_cpu_1rank_1thread.json",
        (*TRAINER, "bench/overhead.py"),
        _overhead,
    ),
    Result(
        "overhead_2rank",
        "trainer overhead, 2 ranks",
        "OMP_NUM_THREADS=1 deepspeed --num_gpus 2 bench/overhead.py",
        "bench/results/overhead_cpu_2rank.json",
        (*TRAINER, "bench/overhead.py"),
        _overhead,
        lambda d: {"docs/results/README.md": [f", {ratio(d['overhead_ratio'], 3)} (2 ranks)"]},
        readme="the same, 2 ranks",
    ),
    Result(
        "scaling",
        "multi-rank CPU scaling (`./launch.sh`)",
        R + "scaling.py",
        "bench/results/scaling_cpu.json",
        (*TRAINER, "launch.sh", "bench/scaling.py"),
        _scaling,
        lambda d: {
            "docs/results/README.md": [
                f"{d['images_per_s']['1x1']:,.0f} -> {d['images_per_s']['2x1']:,.0f} img/s: "
                f"{ratio(d['speedup'])}, {pct(d['scaling_efficiency'], 0)} efficiency"
            ]
        },
        readme="1 -> 2 CPU ranks under `./launch.sh`",
    ),
    Result(
        "single_rank_allreduce",
        "DeepSpeed's single-rank all-reduce (now skipped)",
        R + "single_rank_allreduce.py",
        "bench/results/single_rank_allreduce_cpu.json",
        ("dstrain/trainer.py", "dstrain/compat.py", "bench/single_rank_allreduce.py"),
        lambda d: f"a step {ratio(d['speedup_without_allreduce'])} faster without it",
        lambda d: {
            "docs/results/README.md": [f"a step {ratio(d['speedup_without_allreduce'])} faster"]
        },
    ),
    Result(
        "bn_span",
        "BN span 32 cost, channels_last",
        R + "bn_span.py",
        "bench/results/bn_span_cpu.json",
        ("dstrain/bn_span.py", "bench/bn_span.py"),
        lambda d: f"{ratio(d['span_over_plain'])} the plain-BN step",
    ),
    Result(
        "bn_span_nchw",
        "BN span 32 cost, NCHW",
        R + "bn_span.py --channels-last off --out bench/results/bn_span_cpu_nchw.json",
        "bench/results/bn_span_cpu_nchw.json",
        ("dstrain/bn_span.py", "bench/bn_span.py"),
        lambda d: f"{ratio(d['span_over_plain'])} the plain-BN step",
    ),
    Result(
        "optimizer_step",
        "LARS/LAMB step on ResNet-50's parameters",
        R + "optimizer_step.py",
        "bench/results/optimizer_step_cpu.json",
        ("dstrain/lars.py", "dstrain/lamb.py", "dstrain/multitensor.py", "bench/optimizer_step.py"),
        lambda d: (
            f"LARS {ratio(d['ratio_vs_sgd_foreach']['dstrain_lars'])}, LAMB "
            f"{ratio(d['ratio_vs_sgd_foreach']['dstrain_lamb'])} the time of SGD(foreach)"
        ),
        lambda d: {
            "docs/usage.md": [
                f"takes {ratio(d['ratio_vs_sgd_foreach']['dstrain_lars'])} the time",
                "its {} CPU target is {}".format(
                    re.search(r"within (\S+) of", d["targets"])[1],
                    "met" if d["ratio_vs_sgd_foreach"]["dstrain_lars"] <= 1.15 else "missed",
                ),
            ]
        },
        readme="LARS/LAMB step on ResNet-50 parameters vs SGD",
    ),
    Result(
        "loader",
        "DALI loader vs a plain DALI pipeline (the ceiling)",
        R + "loader.py --batch 64 --batches-per-epoch 25 100 --threads 2 --prefetch 2 --epochs 3",
        "bench/results/loader_cpu.json",
        ("dstrain/data", "bench/loader.py"),
        _loader,
        lambda d: {
            "docs/usage.md": [
                f"**{ratio(d['rows'][0]['ratio_dali_over_plain'])}** the ceiling at "
                f"{d['rows'][0]['batches_per_epoch']} batches an epoch, "
                f"**{ratio(d['rows'][1]['ratio_dali_over_plain'])}** at"
            ]
        },
        readme="DALI loader vs a plain DALI pipeline (CPU decode)",
    ),
    Result(
        "loader_formats",
        "the same loader over shards (WebDataset, RecordIO) vs the folder, same files",
        R + "loader.py --batch 64 --batches-per-epoch 25 --threads 2 --prefetch 2 --epochs 3 "
        "--devices cpu --loaders dali dali@wds dali@recordio torchvision torchvision@wds "
        "torchvision@recordio --out bench/results/loader_cpu_formats.json",
        "bench/results/loader_cpu_formats.json",
        ("dstrain/data", "bench/loader.py"),
        _loader_formats,
    ),
    Result(
        "polish",
        "Final Polishing (BN refit, last K epochs)",
        R + "polish.py",
        "bench/results/polish.json",
        (*TRAINER, "bench/polish.py"),
        _polish,
        _polish_quotes,
        readme="Final Polishing at batch 4,096, 3 seeds (top-1 %)",
    ),
    Result(
        "comm_accuracy",
        "gradient communication, accuracy and bytes (2 ranks)",
        R + "comm_accuracy.py --epochs 2",
        "bench/results/comm_accuracy.json",
        (*TRAINER, "bench/comm_accuracy.py"),
        _comm,
        readme="2D-Torus and 1-bit compression vs all-reduce, 2 ranks",
    ),
    Result(
        "throughput_cpu",
        "the GPU throughput bench on CPU (resnet18, 64 px, fp32; synthetic and DALI data)",
        R
        + "throughput.py --model resnet18 --batch 32 --image-size 64 --images 1280 --bare-steps 40 "
        "--bare-warmup 5 --epochs 3 --dali-images 1280 --dali-threads 2",
        "bench/results/throughput_cpu_2_cores.json",
        (*TRAINER, "bench/throughput.py"),
        _throughput,
        _throughput_quotes,
        values=_row_ratios,
        readme="throughput bench on CPU (resnet18, 64 px)",
    ),
    Result(
        "throughput_cpu_compile",
        "the same, synthetic data only, channels_last and torch.compile on/off (a second run)",
        R
        + "throughput.py --model resnet18 --batch 32 --image-size 64 --images 640 --bare-steps 20 "
        "--bare-warmup 5 --epochs 3 --loaders synthetic --channels-last on off --compile off on "
        "--out bench/results/throughput_cpu_2_cores_compile.json",
        "bench/results/throughput_cpu_2_cores_compile.json",
        (*TRAINER, "bench/throughput.py"),
        _throughput,
        _throughput_quotes,
        values=_row_ratios,
    ),
    Result(
        "loader_settings",
        "DALI loader threads / prefetch",
        R + "loader.py --batch 64 --batches-per-epoch 25 --threads 1 2 --prefetch 1 2 3 --epochs 3 "
        "--out bench/results/loader_cpu_settings.json",
        "bench/results/loader_cpu_settings.json",
        ("dstrain/data", "bench/loader.py"),
        lambda d: f"{len(d['rows'])} settings: "
        + _loader(d).split(",")[0]
        + " (first); see docs/data.md",
    ),
    Result(
        "comm_model",
        "all-reduce cost model (ring, hierarchical, 2D-Torus; modelled, not measured)",
        R + "comm_model.py",
        "bench/results/comm_model.json",
        ("bench/comm_model.py",),
        lambda d: f"{len(d['rows'])} cluster sizes, {d['rows'][0]['gpus']} to {d['rows'][-1]['gpus']} GPUs",
    ),
    Result(
        "faults",
        "bad inputs and faults, what the user sees",
        "./run.sh evidence",
        "docs/results/faults.md",
        (*TRAINER, "launch.sh", "run.sh"),
        _faults,
    ),
    Result(
        "commit_ab_default",
        "the default recipe at c8827d4 (its first result) and now, alternating on one machine",
        T + "commit_ab.py --base c8827d4 --rounds 2 epochs=2",
        "bench/results/commit_ab_c8827d4.json",
        (*TRAINER, "tools/commit_ab.py"),
        lambda d: (
            f"training time now {ratio(d['head_over_base'])} that at c8827d4 "
            f"({d['median_wall_time_s']['head']:.1f} vs {d['median_wall_time_s']['base']:.1f} s)"
        ),
    ),
    Result(
        "suite_cpu",
        "the test suite on this CPU (CI's first step)",
        "./run.sh test -q --junitxml=/tmp/dstrain-suite.xml; python tools/suite.py "
        "--junit /tmp/dstrain-suite.xml --ran './run.sh test -q'",
        "bench/results/suite_cpu_2_cores.json",
        (*SUITE, "requirements.txt"),
        suite_headline,
        lambda d: {"docs/testing.md": [suite_headline(d)]},
        rerun=False,
        readme="the test suite (CI step 1)",
    ),
    Result(
        "suite_cpu_oldest",
        "the `oldest` tests on the oldest torch declared (CI's second step)",
        "./run.sh test-oldest -q --junitxml=/tmp/dstrain-oldest.xml; .venv-oldest/bin/python "
        "tools/suite.py --junit /tmp/dstrain-oldest.xml --ran './run.sh test-oldest -q' "
        "--out bench/results/suite_cpu_2_cores_oldest.json",
        "bench/results/suite_cpu_2_cores_oldest.json",
        (*SUITE, "requirements-oldest.txt"),
        lambda d: f"torch {d['torch']}: {suite_headline(d)}",
        lambda d: {"docs/testing.md": [f"torch {d['torch'].split('+')[0]}: {suite_headline(d)}"]},
        rerun=False,
        readme="the `oldest` tests on torch 2.11 (CI step 2)",
    ),
    Result(
        "study_30ep",
        "large-batch study at the records' step budget (CPU: 30 epochs)",
        R + "accuracy_study.py --epochs 30 --rows baseline naive_4096 lars lars_span32 --seeds 0",
        "docs/results/accuracy_study_30ep.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        rerun=False,
    ),
    Result(
        "study_30ep_records",
        "large-batch study, issue 33's rows: Goyal SGD, LARS in the records' regime, Fujitsu recipe",
        R + "accuracy_study.py --epochs 30 --rows " + " ".join(RECORDS_ROWS) + " --seeds 0 "
        "--name accuracy_study_30ep_records",
        "docs/results/accuracy_study_30ep_records.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        _records_quotes,
        rerun=False,
        readme="large-batch study, 30 epochs, seed 0 (test top-1)",
    ),
    Result(
        "study_30ep_seeds",
        "large-batch study, 30 epochs, 3 seeds: batch 128 vs the best batch-4,096 row",
        R + "accuracy_study.py --epochs 30 --rows baseline fujitsu_span32 --seeds 0 1 2 "
        "--name accuracy_study_30ep_seeds",
        "docs/results/accuracy_study_30ep_seeds.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        _seeds_quotes,
        rerun=False,
        readme="batch 128 vs 4,096 (Fujitsu recipe), 30 epochs, 3 seeds",
    ),
    Result(
        "study_90ep_baseline",
        "the goal's measurement, batch 128 half: 90 epochs, 3 seeds, test set (CPU)",
        R + "accuracy_study.py --epochs 90 --rows baseline --seeds 0 1 2 "
        "--name accuracy_study_90ep_baseline",
        "docs/results/accuracy_study_90ep_baseline.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        rerun=False,
        readme="batch 128, 90 epochs, 3 seeds (the goal's reference)",
    ),
    Result(
        "brakes_holdout",
        "issue 39, item 1: one brake at a time on the Fujitsu row, 6,000 held-out images, 30 "
        "epochs, chosen by the worst of 3 seeds (in progress: the report names the pending runs)",
        R + "accuracy_study.py --epochs 30 --holdout 6000 --rows fujitsu_span32 "
        "fujitsu_span32_bn_lr0.1 fujitsu_span32_trust_clip1 fujitsu_span32_momentum_correction "
        "fujitsu_span32_warmup50 fujitsu_span32_lr5 --seeds 0 1 2 --finished-only "
        "--out docs/results/tuning --name brakes_30ep_holdout6000",
        "docs/results/tuning/brakes_30ep_holdout6000.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        rerun=False,
    ),
    Result(
        "study_10ep",
        "earlier large-batch study (10 epochs, LRs tuned on the test set)",
        R + "accuracy_study.py --jobs 2",
        "docs/results/accuracy_study.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        _study10_quotes,
        rerun=False,
    ),
    Result(
        "throughput_cpu_dali",
        "the trainer fed by DALI vs synthetic data (CPU, resnet18, 64 px, fp32)",
        R
        + "throughput.py --model resnet18 --batch 32 --image-size 64 --images 640 --dali-images 640 "
        "--dali-threads 2 --bare-steps 20 --bare-warmup 5 --epochs 3 --loaders synthetic dali "
        "--channels-last off --compile off --precisions fp32 --out bench/results/throughput_cpu_2_cores_dali.json",
        "bench/results/throughput_cpu_2_cores_dali.json",
        (*TRAINER, "bench/throughput.py"),
        _throughput,
        values=_row_ratios,
    ),
    Result(
        "throughput_cpu_fp32_bf16",
        "bf16 autocast vs fp32 on a CPU without AVX-512 BF16 (an earlier machine)",
        R + "throughput.py --model resnet18 --batch 16 --image-size 32 --images 64 --bare-steps 4 "
        "--bare-warmup 1 --epochs 2 --loaders synthetic --channels-last off --compile off --precisions "
        "fp32 bf16 --out bench/results/throughput_cpu_2_cores_fp32_bf16.json",
        "bench/results/throughput_cpu_2_cores_fp32_bf16.json",
        (*TRAINER, "bench/throughput.py"),
        _throughput,
        values=_row_ratios,
        rerun=False,  # its point is the other machine's CPU
    ),
    Result(
        "optimizer_step_layouts",
        "LAMB on NCHW vs channels_last parameters (15 rounds)",
        R + "optimizer_step.py --rounds 15 --out bench/results/optimizer_step_cpu_layouts.json",
        "bench/results/optimizer_step_cpu_layouts.json",
        ("dstrain/lars.py", "dstrain/lamb.py", "dstrain/multitensor.py", "bench/optimizer_step.py"),
        lambda d: f"LAMB channels_last {ratio(_layouts(d)[0], 3)} the time of LAMB NCHW",
        values=_layouts,
    ),
    Result(
        "overhead_1rank_95e4140",
        "trainer overhead at 95e4140 (the loop before issue 15), same machine as overhead_1rank",
        "git worktree add /tmp/base 95e4140 && cd /tmp/base && python bench/overhead.py",
        "bench/results/overhead_cpu_1rank_95e4140.json",
        (),
        _overhead,
        rerun=False,  # a measurement of an old commit
    ),
    Result(
        "code_shape",
        "code shape of the package (files, lines, cycles, signatures)",
        T + "code_shape.py",
        "bench/results/code_shape.json",
        ("dstrain",),
        _code_shape,
    ),
    Result(
        "code_shape_71a43a9",
        "code shape at 71a43a9 (before issue 32's second step)",
        T
        + "code_shape.py --package CHECKOUT_AT_71a43a9/dstrain --out bench/results/code_shape_71a43a9.json",
        "bench/results/code_shape_71a43a9.json",
        (),
        _code_shape,
        rerun=False,
    ),
    Result(
        "code_shape_95e4140",
        "code shape at 95e4140 (before the redesign)",
        T + "code_shape.py --package /tmp/base/dstrain --out bench/results/code_shape_95e4140.json",
        "bench/results/code_shape_95e4140.json",
        (),
        _code_shape,
        rerun=False,
    ),
    Result(
        "cpu_channels_last_crash",
        "oneDNN's channels_last backward crash on narrow convolutions (CPU)",
        R + "cpu_channels_last_crash.py",
        "bench/results/cpu_channels_last_crash.json",
        ("bench/cpu_channels_last_crash.py",),
        _crash,
    ),
    Result(
        "recipe_fashion_mnist_c8827d4",
        "default recipe at c8827d4, with augmentation (its first result)",
        "python -m dstrain --config fashion_mnist data.augment=true",
        "bench/results/recipe_fashion_mnist.json",
        (),
        _default_recipe,
        rerun=False,
    ),
    Result(
        "suite_cpu_quick",
        "the quick loop (`-m 'not slow'`)",
        T + "suite.py --out bench/results/suite_cpu_2_cores_quick.json -- -q -m 'not slow'",
        "bench/results/suite_cpu_2_cores_quick.json",
        (*SUITE, "requirements.txt"),
        suite_headline,
        rerun=False,
        readme='the quick loop, `./run.sh test -m "not slow"`',
    ),
    Result(
        "accuracy_sweep",
        "one-seed LR / warmup / ramp sweep, batch 4,096, 10 epochs (LRs chosen on the test set)",
        "bench/accuracy_study.py at 4a0cead with uncommitted --jobs (the note in the file)",
        "docs/results/accuracy_sweep.json",
        (),
        _sweep,
        rerun=False,
    ),
    Result(
        "probe_lars_lr_1.25",
        "`fashion_mnist_lars` at LR 1.25 diverging at the switch to batch 4,096 (a log)",
        "python -m dstrain --config fashion_mnist_lars optim.base_lr=1.25",
        "bench/results/probe_lars_base_lr_1.25.log",
        (),
        lambda d: d["text"].splitlines()[1].lstrip("# "),
        rerun=False,
    ),
    *[
        Result(
            f"recipe_lars_{e}ep",
            f"the `recipe_lars` row run for {e} epochs (seed 0)",
            R + f"accuracy_study.py --rows recipe_lars --seeds 0 --epochs {e} "
            f"--out docs/results/recipe_epochs/e{e}",
            f"docs/results/recipe_epochs/e{e}/accuracy_study.json",
            (*TRAINER, "bench/accuracy_study.py"),
            _study,
            rerun=False,
        )
        for e in (20, 30)
    ],
    Result(
        "lars_tensors_fujitsu_seed2",
        "Fujitsu recipe, seed 2, 30-epoch row rerun with log.lars_tensors (the run of "
        "`accuracy_study.py --epochs 30 --rows fujitsu_span32 --seeds 2 --runs "
        "runs/accuracy_study/diag-30ep --extra log.tensorboard=true log.lars_tensors=true "
        "log.every_steps=1`), 30 epochs",
        R + "lars_tensors.py runs/accuracy_study/diag-30ep/fujitsu_span32-2 "
        "--name lars_tensors_fujitsu_span32_seed2_30ep",
        "docs/results/stability/lars_tensors_fujitsu_span32_seed2_30ep.json",
        (*TRAINER, "bench/accuracy_study.py", "bench/lars_tensors.py"),
        _lars_tensors,
        rerun=False,
    ),
    *[
        Result(
            f"tuning_fujitsu_lr{lr}",
            f"Fujitsu recipe, peak LR {lr}, on 6,000 held-out images",
            R + f"accuracy_study.py --epochs 10 --holdout 6000 --rows fujitsu_span32 --seeds 0 "
            f"--out docs/results/tuning --name fujitsu_lr{lr}_10ep_holdout6000 --extra optim.base_lr={lr}",
            f"docs/results/tuning/fujitsu_lr{lr}_10ep_holdout6000.json",
            (*TRAINER, "bench/accuracy_study.py"),
            _tuning,
            rerun=False,
        )
        for lr in ("1.6", "4", "10")
    ],
    *[
        Result(
            f"tuning_{stem}_lr{lr}_30ep",
            f"{what}, LR {lr}, 30 epochs, on 6,000 held-out images",
            R + f"accuracy_study.py --epochs 30 --holdout 6000 --rows {row} --seeds 0 "
            f"--runs runs/accuracy_study/tune-{stem}-30ep-lr{lr} --out docs/results/tuning "
            f"--name {stem}_lr{lr}_30ep_holdout6000 --extra optim.base_lr={lr}",
            f"docs/results/tuning/{stem}_lr{lr}_30ep_holdout6000.json",
            (*TRAINER, "bench/accuracy_study.py"),
            _tuning,
            rerun=False,
        )
        for stem, row, what, lrs in TUNING_30EP
        for lr in lrs
    ],
    Result(
        "goyal_lr0.4_30ep",
        "Goyal SGD at the baseline's 0.4 per 256 images (6.4 at 4,096), 30 epochs, test set",
        R + "accuracy_study.py --epochs 30 --rows goyal_4096 --seeds 0 "
        "--runs runs/accuracy_study/goyal-lr0.4-30ep --name goyal_lr0.4_30ep --extra optim.base_lr=0.4",
        "docs/results/goyal_lr0.4_30ep.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        rerun=False,
    ),
]


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
            (*TRAINER, "bench/*.py", "tools/gpu_run.py"),
            _gpu,
            rerun=False,
        )
        for e in entries
    ]


RESULTS += gpu_results()

# Numbers README and the index quote that no result file of ours holds: published results and the
# arithmetic of the recipes. Each with where it comes from.
PUBLISHED = {
    "75.98%": "Fujitsu's MLPerf v0.6 record (METHODS.md)",
    "75.9%": "MLPerf's ResNet-50 target (MLCommons rcps_resnet.json)",
    "76.3%": "the usual ResNet-50 top-1 at small batch (METHODS.md)",
    "6.8%": "4,096 / 60,000: the study's batch as a share of Fashion-MNIST",
    "6.7%": "86,016 / 1,281,167: Fujitsu's batch as a share of ImageNet",
    "0.25%": "Fujitsu's end LR: 0.0025 of the peak (the recipe's poly decay)",
    "0.96x": "issue 16: an H100 run of the code before it, bf16/autocast fp16 vs a bare AMP loop",
    "0.52x": "issue 16: the same H100 run, DeepSpeed's native fp16 engine",
}
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:%|x(?![\w]))")
# Numbers with a unit that stand in a passage citing a result but are not measured by it: settings,
# thresholds and arithmetic, each with what it is (doc -> number as written -> why).
STATED: dict[str, dict[str, str]] = {
    "docs/testing.md": {"15 min": "pytest-timeout's limit per test (pyproject.toml)"},
    "docs/large-batch.md": {
        "1.15x": "the CPU target for a LARS step (issue 12)",
        "1.3x": "the GPU target for a LARS step (issue 12)",
        "1.14x": "optimizer_step_cpu.json before its 40-round rerun: git show 067825a:bench/results/...",
        "27.6 ms": "the same earlier file: SGD(foreach=True)",
        "31.4 ms": "the same earlier file: dstrain LARS",
        "84.9%": "the recipe's first version: recipe_fashion_mnist_lars.json at e829e24 (git history)",
        "4x": "arithmetic: the probe's LR over the recipe's, and the LR jump at a 1,024 -> 4,096 switch",
    },
}


# ------------------------------------------------------------------- staleness


def _git(*args: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def staleness(shas: list[str], code: tuple[str, ...], repo: Path = REPO) -> str:
    """'current', or what changed in the measured code since the result's commit."""
    if not shas:
        return "no commit recorded"
    notes, changed = [], set()
    for sha in shas:
        base = sha.removesuffix("-dirty")
        if _git("cat-file", "-e", f"{base}^{{commit}}", repo=repo).returncode != 0:
            return f"commit {base[:7]} not in this history"
        if sha.endswith("-dirty"):
            notes.append(f"ran on an uncommitted tree at {base[:7]}")
        # against the working tree: later commits and uncommitted edits count; docs measure nothing
        diff = _git("diff", "--name-only", base, "--", *code, ":(exclude)*.md", repo=repo)
        changed |= set(diff.stdout.split())
    if changed:
        names = sorted(changed)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        notes.append("stale: " + ", ".join(names[:3]) + more + " changed since")
    return "; ".join(sorted(set(notes), key=notes.index)) or "current"


# ------------------------------------------------------------------- the index and the check


STALE_AS_OF = "_current? as of commit "


def _link(r: Result, base: str) -> str:
    """A markdown link to the result's file from a doc in ``base`` ('' = the repository root)."""
    target = Path(r.file).relative_to(base) if base and r.file.startswith(base + "/") else None
    up = "../" * len(Path(base).parts)
    return f"[{Path(r.file).name}]({target or up + r.file})"


def index_table(results: list[Result], stale: bool = True) -> str:
    """The index; ``stale=False`` leaves the current? column out (what the check compares)."""
    head = _git("rev-parse", "--short=7", "HEAD").stdout.strip() or "?"
    lines = [
        f"{STALE_AS_OF}{head} (when this table was written); `./run.sh results --stale` tells "
        "it for the tree you have._",
        "",
        "| what | command | result file | commit | headline | current? |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.exists():  # registered, never run here: said, not hidden
            lines.append(
                f"| {r.what} | `{r.command}` | {r.file} | - | no result file yet | not run |"
            )
            continue
        d = r.load()
        shas = r.shas(d)
        sha_text = ", ".join(sorted({s.removesuffix("-dirty")[:7] for s in shas})) or "-"
        now = staleness(shas, r.code) if stale else "-"
        lines.append(
            f"| {r.what} | `{r.command}` | {_link(r, 'docs/results')} | {sha_text} | "
            f"{r.headline(d)} | {now} |"
        )
    return "\n".join(lines)


def readme_table(results: list[Result]) -> str:
    """README's results: one line per result marked ``readme``, linking its file."""
    lines = ["| result | measured | file |", "|---|---|---|"]
    for r in results:
        if not r.readme:
            continue
        if r.exists():
            lines.append(f"| {r.readme} | {r.headline(r.load())} | {_link(r, '')} |")
        else:  # no link to a file that is not there yet
            lines.append(f"| {r.readme} | not run yet | `{r.file}` |")
    return "\n".join(lines)


def _replace_block(text: str, begin: str, end: str, body: str, name: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{name}: markers {begin!r} ... {end!r} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_index(text: str, results: list[Result] | None = None, stale: bool = True) -> str:
    body = index_table(RESULTS if results is None else results, stale)
    return _replace_block(text, BEGIN, END, body, str(INDEX))


def render_readme(text: str, results: list[Result] | None = None) -> str:
    body = readme_table(RESULTS if results is None else results)
    return _replace_block(text, README_BEGIN, README_END, body, str(README))


def without_staleness(text: str) -> str:
    """The index with its as-of line and current? cells blanked: what a code commit changes."""
    out = []
    for line in text.splitlines():
        if line.startswith(STALE_AS_OF):
            continue
        if line.startswith("| ") and line.endswith(" |"):
            line = line[: line.rstrip(" |").rindex("|")] + "| - |"
        out.append(line)
    return "\n".join(out)


def _masked(text: str, begin: str, end: str) -> list[bool]:
    covered = [False] * len(text)
    if begin in text and end in text:  # a generated table is checked by regenerating it
        a, b = text.index(begin), text.index(end)
        covered[a:b] = [True] * (b - a)
    return covered


def unquoted_numbers(name: str, text: str, quotes: list[str]) -> list[str]:
    """Percentages and ratios in ``text`` (the doc ``name``) that are neither in a quote nor published."""
    covered = [
        a or b for a, b in zip(_masked(text, BEGIN, END), _masked(text, README_BEGIN, README_END))
    ]
    for q in quotes:
        for m in re.finditer(re.escape(q), text):
            covered[m.start() : m.end()] = [True] * (m.end() - m.start())
    problems = []
    for m in NUMBER.finditer(text):
        if not covered[m.start()] and m.group() not in PUBLISHED:
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{name}:{line}: {m.group()} is quoted from no result file")
    return problems


# ------------------------------------------------------------------- numbers that cite a file

UNIT_NUMBER = re.compile(
    r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:\s?(%|pt\b|points?\b|img/s|ms\b|min\b|s\b(?!/))|(x)(?!\w))"
)
LINK = re.compile(r"\]\(([^)\s#]+)")


def blocks(text: str):
    """(first line number, text) of each paragraph; a table is one block with the paragraph that
    introduces it (the rows cite what the table or that paragraph links)."""
    line, before = 1, None
    for para in re.split(r"(\n\s*\n)", text):
        if para.strip() and not para.startswith("\n"):
            if para.lstrip().startswith("|"):
                if before is not None:
                    yield before[0], before[1] + "\n\n" + para
                    before = None
                else:
                    yield line, para
            else:
                if before is not None:
                    yield before
                before = (line, para)
        line += para.count("\n")
    if before is not None:
        yield before


def cited(doc: str, block: str) -> list[str]:
    """Repository paths of the result files a block links (README.md pages are indexes, not results)."""
    out = []
    for target in LINK.findall(block):
        if "://" in target:
            continue
        path = (REPO / doc).parent / target
        try:
            rel = str(path.resolve().relative_to(REPO))
        except ValueError:
            continue
        if rel.startswith(RESULT_DIRS) and Path(rel).name != "README.md" and rel not in NOT_RESULTS:
            out.append(rel)
    return out


def registered_file(rel: str, results: list[Result]) -> Result | None:
    """The result a file belongs to: its own, or that of the .json beside it (a report, a plot)."""
    stem = str(Path(rel).with_suffix(""))
    for r in results:
        if r.file == rel or str(Path(r.file).with_suffix("")) == stem:
            return r
    return None


def file_values(rel: str) -> list[float]:
    """Every number a result file holds: JSON leaves, or the numbers of a text report."""
    path = REPO / rel
    if not path.is_file() or path.suffix in (".png", ".csv"):
        return []
    if path.suffix == ".json":
        out: list[float] = []

        def walk(x):
            if isinstance(x, bool):
                return
            if isinstance(x, int | float):
                out.append(float(x))
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        walk(json.loads(path.read_text()))
        return out
    return [float(m.replace(",", "")) for m in re.findall(r"\d[\d,]*(?:\.\d+)?", path.read_text())]


def written_as(number: str, unit: str, values: list[float]) -> bool:
    """Whether one of ``values`` (a fraction or already in percent for %/pt) prints as ``number``."""
    plain = number.replace(",", "")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    if unit in ("%", "pt", "point", "points"):
        values = [*values, *(100 * v for v in values)]
    elif unit == "min":  # minutes, or the minutes of "M min S s"
        values = [*values, *(v / 60 for v in values), *(v // 60 for v in values)]
    elif unit == "s":  # seconds, or the seconds of "M min S s"
        values = [*values, *(v % 60 for v in values)]
    return any(f"{v:.{decimals}f}" in (plain, "-" + plain) for v in values)


def cited_numbers(doc: str, text: str, results: list[Result], quotes: list[str]) -> list[str]:
    """Numbers with a unit in blocks that link a result file, not found in what they cite."""
    problems = []
    stated = STATED.get(doc, {})
    for begin, end in ((BEGIN, END), (README_BEGIN, README_END)):  # generated: checked as a whole
        if begin in text and end in text:
            a, b = text.index(begin), text.index(end)
            text = text[:a] + "\n" * text.count("\n", a, b) + text[b:]
    for line, block in blocks(text):
        files = cited(doc, block)
        if not files:
            continue
        values: list[float] = []
        for rel in files:
            r = registered_file(rel, results)
            if r is None:
                problems.append(
                    f"{doc}:{line}: links {rel}, which no Result in tools/evidence.py registers"
                )
                continue
            values += file_values(rel) + file_values(r.file) + r.values(r.load())
        covered = [False] * len(block)
        for q in quotes:
            for m in re.finditer(re.escape(q), block):
                covered[m.start() : m.end()] = [True] * (m.end() - m.start())
        for m in UNIT_NUMBER.finditer(block):
            number, unit = m.group(1), m.group(2) or m.group(3)
            shown = m.group(0)
            if covered[m.start()] or shown in PUBLISHED or shown in stated:
                continue
            if not written_as(number, unit, values):
                at = line + block.count("\n", 0, m.start())
                problems.append(
                    f"{doc}:{at}: {shown} is in none of the files this passage links ({', '.join(files)})"
                )
    return problems


def check(texts: dict[str, str] | None = None, results: list[Result] | None = None) -> list[str]:
    """Every way the docs disagree with the result files (``texts``: doc -> text, default the files)."""
    results = RESULTS if results is None else results
    pages = [README, INDEX, *sorted((REPO / "docs").glob("*.md"))]
    texts = {str(p.relative_to(REPO)): p.read_text() for p in pages} | (texts or {})
    index, readme = str(INDEX.relative_to(REPO)), str(README.relative_to(REPO))
    problems = []
    if without_staleness(render_index(texts[index], results, stale=False)) != without_staleness(
        texts[index]
    ):
        problems.append(
            f"{index}: the table differs from the result files; run python tools/evidence.py index"
        )
    if render_readme(texts[readme], results) != texts[readme]:
        problems.append(
            f"{readme}: the results table differs from the result files; run python tools/evidence.py index"
        )
    quotes: dict[str, list[str]] = {}
    for r in filter(Result.exists, results):  # without a file, its quotes are unchecked numbers
        for doc, wanted in r.quotes(r.load()).items():
            problems += [
                f"{doc}: expected {q!r} from {r.file} ({r.key}), not found"
                for q in wanted
                if q not in texts[doc]
            ]
            quotes.setdefault(doc, []).extend(wanted)
    for doc in (readme, index):
        problems += unquoted_numbers(doc, texts[doc], quotes.get(doc, []))
    for doc in texts:
        problems += cited_numbers(doc, texts[doc], results, quotes.get(doc, []))
    for rel in unregistered(results):
        problems.append(f"{rel}: a result file no Result in tools/evidence.py registers")
    return problems


def unregistered(results: list[Result]) -> list[str]:
    files = {r.file for r in results}
    return sorted(
        str(p.relative_to(REPO))
        for d in RESULT_DIRS
        for p in (REPO / d).rglob("*.json")
        if str(p.relative_to(REPO)) not in files and str(p.relative_to(REPO)) not in NOT_RESULTS
    )


def stale_report(results: list[Result]) -> str:
    lines = []
    for r in results:
        state = staleness(r.shas(r.load()), r.code) if r.exists() else "not run"
        lines.append(f"{r.key:28s} {state}")
    n = sum(1 for line in lines if " stale:" in line)
    return "\n".join([*lines, f"{n} of {len(results)} results stale for this tree"])


def run(keys: list[str]) -> None:
    todo = [r for r in RESULTS if (r.key in keys if keys else r.rerun)]
    unknown = set(keys) - {r.key for r in RESULTS}
    if unknown:
        raise SystemExit(f"unknown result(s) {sorted(unknown)}; known: {[r.key for r in RESULTS]}")
    venv_bin = Path(sys.executable).parent
    for n, r in enumerate(todo, 1):
        cmd = re.sub(r"(^|\s)python(?=\s)", rf"\1{sys.executable}", r.command)
        cmd = re.sub(r"(^|\s)deepspeed(?=\s)", rf"\1{venv_bin / 'deepspeed'}", cmd)
        print(f"[evidence {n}/{len(todo)}] {r.key}: {r.command}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, shell=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{r.key} failed ({proc.returncode}): {shlex.quote(r.command)}")
        print(f"[evidence] {r.key}: {time.perf_counter() - t0:.0f} s -> {r.file}", flush=True)
    write_tables()


def write_tables() -> None:
    INDEX.write_text(render_index(INDEX.read_text()))
    README.write_text(render_readme(README.read_text()))
    print(f"wrote {INDEX.relative_to(REPO)} and the results table of {README.relative_to(REPO)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("index", help="write docs/results/README.md's table and README's results table")
    sub.add_parser(
        "check", help="exit 1 when the tables or the docs' numbers differ from the files"
    )
    sub.add_parser("stale", help="which results the code changed since they ran (exit 0)")
    r = sub.add_parser("run", help="rerun the CPU results (all but the studies), then index")
    r.add_argument("keys", nargs="*", help=f"only these: {', '.join(x.key for x in RESULTS)}")
    args = p.parse_args()
    if args.what == "index":
        write_tables()
    elif args.what == "stale":
        print(stale_report(RESULTS))
    elif args.what == "run":
        run(args.keys)
    else:
        problems = check()
        print("\n".join(problems) or "evidence: every quoted number matches its result file")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
