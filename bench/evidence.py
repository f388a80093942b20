"""Every result README and docs/results quote: its command, its file, its numbers and whether it is current.

    python bench/evidence.py index            # write the table in docs/results/README.md from the result files
    python bench/evidence.py check            # exit 1 when that table or a number README quotes differs
                                              # from its result file (tests/test_evidence.py runs this check)
    python bench/evidence.py run [KEY ...]    # rerun every CPU result's command (all but the long studies
    ./run.sh results                          #   and the test suite), one after the other, then the index
    ./run.sh results suite_cpu suite_cpu_oldest   # the test suite's outcome (CI's two steps), its own step

A result is *current* when none of the code it measures (``Result.code``) differs between the commit
it ran at and the working tree; otherwise the index names what changed (``git diff --name-only SHA``,
so a change made and reverted does not count, and uncommitted changes do). A result run on an
uncommitted tree (SHA ``...-dirty``) says so.

README's numbers are checked the other way round as well: every percentage and every ratio written
``0.97x`` in README.md and docs/results/README.md must be one of the strings a result renders from
its file (``Result.quotes``), or a published number listed in ``PUBLISHED`` with its source. A number
typed by hand, or left behind when its file was regenerated, fails the check.
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

TRAINER = ("dstrain", "ds_configs")  # the code a training run measures: the package and its JSONs
# what a run of the test suite depends on: the code, the tests, the scripts they run, the pins
SUITE = (*TRAINER, "tests", "bench/*.py", "launch.sh", "run.sh", "hostfiles", "pyproject.toml")

if str(REPO) not in sys.path:  # run as a script: bench/ is on the path, the repository is not
    sys.path.insert(0, str(REPO))
from bench.suite import headline as suite_headline  # noqa: E402


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
        "README.md": [
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


def _throughput(d: dict) -> str:
    rs = _throughput_ratios(d)
    return f"dstrain {min(rs):.2f}x-{max(rs):.2f}x its bare PyTorch twin ({len(rs)} pairs)"


def _study(d: dict) -> str:
    by_row: dict[str, list[float]] = {}
    for r in d["runs"]:
        by_row.setdefault(r["row"], []).append(r["final_top1"])
    n = max(len(v) for v in by_row.values())
    shown = [k for k in by_row if not k.endswith("_no_refit")][:6]
    body = ", ".join(f"{k} {100 * statistics.mean(by_row[k]):.2f}%" for k in shown)
    return f"{d['epochs']} epochs, {n} seed(s): {body}"


def _tuning(d: dict) -> str:
    (run,) = [r for r in d["runs"] if not r["row"].endswith("_no_refit")]
    lr = re.search(r"optim\.base_lr=(\S+)", d["command"]).group(1)
    return f"LR {lr}, {d['epochs']} epochs: {pct(run['final_top1'], 2)} held-out top-1"


def _faults(d: dict) -> str:
    rows = [line for line in d["text"].splitlines() if line.startswith("| ") and "---" not in line]
    return f"{len(rows) - 1} bad inputs and faults, each with its exit status and message"


def _study_quotes(d: dict) -> dict[str, list[str]]:
    """README's table of the 30-epoch study: the rows it shows, and their distance to batch 128."""
    top1 = {r["row"]: 100 * r["final_top1"] for r in d["runs"] if r["seed"] == 0}
    shown = ["baseline", "naive_4096", "lars", "lars_span32"]
    rows = [f"| {top1[k]:.2f}" for k in shown if k in top1]
    rows += [f"| {top1[k] - top1['baseline']:+.2f} |" for k in shown[1:] if k in top1]
    best = max(top1[k] for k in top1 if k != "baseline" and not k.endswith("_no_refit"))
    rows.append(f"missed by {top1['baseline'] - best:.1f} pt")  # the report's distance
    return {"README.md": rows}


def _mean_sd(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.2f} +- {100 * statistics.stdev(values):.2f}%"


def _study10_quotes(d: dict) -> dict[str, list[str]]:
    by_row: dict[str, list[float]] = {}
    for r in d["runs"]:
        by_row.setdefault(r["row"], []).append(r["final_top1"])
    return {"README.md": [_mean_sd(by_row[k]) for k in ("baseline", "recipe_lars", "recipe_lamb")]}


def _throughput_quotes(d: dict) -> dict[str, list[str]]:
    rs = _throughput_ratios(d)
    return {"README.md": [f"{min(rs):.2f}x-{max(rs):.2f}x"]}


R = "python bench/"
RESULTS = [
    Result(
        "default_recipe",
        "default recipe (`fashion_mnist`)",
        R + "default_recipe.py",
        "bench/results/default_recipe.json",
        (*TRAINER, "bench/default_recipe.py"),
        _default_recipe,
        lambda d: {
            "README.md": [
                f"**{pct(d['final_top1'])} test top-1 after {d['epochs']} epochs",
                f"({d['train_wall_time_s']:.0f} s of training, {d['command_wall_time_s']:.0f} s",
                f"| {pct(d['final_top1'])} test top-1, {d['train_wall_time_s']:.0f} s training",
            ]
        },
    ),
    Result(
        "recipe_fashion_mnist_lars",
        "shipped `fashion_mnist_lars` recipe",
        R + "default_recipe.py --config fashion_mnist_lars",
        "bench/results/recipe_fashion_mnist_lars.json",
        (*TRAINER, "bench/default_recipe.py"),
        _default_recipe,
        lambda d: {
            "README.md": [f"| {pct(d['final_top1'])} test top-1, {d['train_wall_time_s']:.0f} s"]
        },
    ),
    Result(
        "overhead_1rank",
        "trainer overhead, 1 rank",
        R + "overhead.py",
        "bench/results/overhead_cpu_1rank.json",
        (*TRAINER, "bench/overhead.py"),
        _overhead,
        lambda d: {"README.md": [f"| {ratio(d['overhead_ratio'], 3)} (1 rank)"]},
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
        lambda d: {"README.md": [f", {ratio(d['overhead_ratio'], 3)} (2 ranks)"]},
    ),
    Result(
        "scaling",
        "multi-rank CPU scaling (`./launch.sh`)",
        R + "scaling.py",
        "bench/results/scaling_cpu.json",
        (*TRAINER, "launch.sh", "bench/scaling.py"),
        _scaling,
        lambda d: {
            "README.md": [
                f"{d['images_per_s']['1x1']:,.0f} -> {d['images_per_s']['2x1']:,.0f} img/s: "
                f"{ratio(d['speedup'])}, {pct(d['scaling_efficiency'], 0)} efficiency"
            ]
        },
    ),
    Result(
        "single_rank_allreduce",
        "DeepSpeed's single-rank all-reduce (now skipped)",
        R + "single_rank_allreduce.py",
        "bench/results/single_rank_allreduce_cpu.json",
        ("dstrain/trainer.py", "dstrain/compat.py", "bench/single_rank_allreduce.py"),
        lambda d: f"a step {ratio(d['speedup_without_allreduce'])} faster without it",
        lambda d: {"README.md": [f"a step {ratio(d['speedup_without_allreduce'])} faster"]},
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
            "README.md": [
                f"takes {ratio(d['ratio_vs_sgd_foreach']['dstrain_lars'])} the time",
                "within its {} target".format(re.search(r"within (\S+) of", d["targets"])[1]),
            ]
        },
    ),
    Result(
        "loader",
        "DALI loader vs a plain DALI pipeline (the ceiling)",
        R + "loader.py --batch 64 --batches-per-epoch 25 100 --threads 2 --prefetch 2 --epochs 3",
        "bench/results/loader_cpu.json",
        ("dstrain/data", "bench/loader.py"),
        _loader,
        lambda d: {
            "README.md": [
                f"**{ratio(d['rows'][0]['ratio_dali_over_plain'])}** the ceiling at "
                f"{d['rows'][0]['batches_per_epoch']} batches an epoch, "
                f"**{ratio(d['rows'][1]['ratio_dali_over_plain'])}** at"
            ]
        },
    ),
    Result(
        "polish",
        "Final Polishing (BN refit, last K epochs)",
        R + "polish.py",
        "bench/results/polish.json",
        (*TRAINER, "bench/polish.py"),
        _polish,
        _polish_quotes,
    ),
    Result(
        "comm_accuracy",
        "gradient communication, accuracy and bytes (2 ranks)",
        R + "comm_accuracy.py --epochs 2",
        "bench/results/comm_accuracy.json",
        (*TRAINER, "bench/comm_accuracy.py"),
        _comm,
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
        R + "commit_ab.py --base c8827d4 --rounds 2 epochs=2",
        "bench/results/commit_ab_c8827d4.json",
        (*TRAINER, "bench/commit_ab.py"),
        lambda d: (
            f"training time now {ratio(d['head_over_base'])} that at c8827d4 "
            f"({d['median_wall_time_s']['head']:.1f} vs {d['median_wall_time_s']['base']:.1f} s)"
        ),
        lambda d: {"README.md": [f"within {ratio(d['head_over_base'])} of each other"]},
    ),
    Result(
        "suite_cpu",
        "the test suite on this CPU (CI's first step)",
        "./run.sh test -q --junitxml=/tmp/dstrain-suite.xml; python bench/suite.py "
        "--junit /tmp/dstrain-suite.xml --ran './run.sh test -q'",
        "bench/results/suite_cpu_2_cores.json",
        (*SUITE, "requirements.txt"),
        suite_headline,
        lambda d: {"README.md": [suite_headline(d)]},
        rerun=False,
    ),
    Result(
        "suite_cpu_oldest",
        "the `oldest` tests on the oldest torch declared (CI's second step)",
        "./run.sh test-oldest -q --junitxml=/tmp/dstrain-oldest.xml; .venv-oldest/bin/python "
        "bench/suite.py --junit /tmp/dstrain-oldest.xml --ran './run.sh test-oldest -q' "
        "--out bench/results/suite_cpu_2_cores_oldest.json",
        "bench/results/suite_cpu_2_cores_oldest.json",
        (*SUITE, "requirements-oldest.txt"),
        lambda d: f"torch {d['torch']}: {suite_headline(d)}",
        lambda d: {"README.md": [f"torch {d['torch'].split('+')[0]}: {suite_headline(d)}"]},
        rerun=False,
    ),
    Result(
        "study_30ep",
        "large-batch study at the records' step budget (CPU: 30 epochs)",
        R + "accuracy_study.py --epochs 30 --rows baseline naive_4096 lars lars_span32 --seeds 0",
        "docs/results/accuracy_study_30ep.json",
        (*TRAINER, "bench/accuracy_study.py"),
        _study,
        _study_quotes,
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
]

# Numbers README and the index quote that no result file of ours holds: published results and the
# arithmetic of the recipes. Each with where it comes from.
PUBLISHED = {
    "75.98%": "Fujitsu's MLPerf v0.6 record (METHODS.md)",
    "75.9%": "MLPerf's ResNet-50 target (MLCommons rcps_resnet.json)",
    "76.3%": "the usual ResNet-50 top-1 at small batch (METHODS.md)",
    "6.8%": "4,096 / 60,000 and 86,016 / 1,281,167: the batch as a share of the data",
    "0.25%": "Fujitsu's end LR: 0.0025 of the peak (the recipe's poly decay)",
    "0.96x": "issue 16: an H100 run of the code before it, bf16/autocast fp16 vs a bare AMP loop",
    "0.52x": "issue 16: the same H100 run, DeepSpeed's native fp16 engine",
}
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:%|x(?![\w]))")


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


def index_table(results: list[Result]) -> str:
    lines = [
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
        link = (
            Path(r.file).relative_to("docs/results") if r.file.startswith("docs/results/") else None
        )
        target = str(link) if link else f"../../{r.file}"
        sha_text = ", ".join(sorted({s.removesuffix("-dirty")[:7] for s in shas})) or "-"
        lines.append(
            f"| {r.what} | `{r.command}` | [{Path(r.file).name}]({target}) | {sha_text} | "
            f"{r.headline(d)} | {staleness(shas, r.code)} |"
        )
    return "\n".join(lines)


def render_index(text: str, results: list[Result] | None = None) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{INDEX}: markers {BEGIN!r} ... {END!r} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{index_table(RESULTS if results is None else results)}\n{END}{tail}"


def unquoted_numbers(name: str, text: str, quotes: list[str]) -> list[str]:
    """Percentages and ratios in ``text`` (the doc ``name``) that are neither in a quote nor published."""
    covered = [False] * len(text)
    if BEGIN in text and END in text:  # the generated table is checked by regenerating it
        a, b = text.index(BEGIN), text.index(END)
        covered[a:b] = [True] * (b - a)
    for q in quotes:
        for m in re.finditer(re.escape(q), text):
            covered[m.start() : m.end()] = [True] * (m.end() - m.start())
    problems = []
    for m in NUMBER.finditer(text):
        if not covered[m.start()] and m.group() not in PUBLISHED:
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{name}:{line}: {m.group()} is quoted from no result file")
    return problems


def check(texts: dict[str, str] | None = None, results: list[Result] | None = None) -> list[str]:
    """Every way the docs disagree with the result files (``texts``: doc -> text, default the files)."""
    results = RESULTS if results is None else results
    docs = [str(p.relative_to(REPO)) for p in (README, INDEX)]
    texts = {doc: (REPO / doc).read_text() for doc in docs} | (texts or {})
    index = str(INDEX.relative_to(REPO))
    problems = []
    if render_index(texts[index], results) != texts[index]:
        problems.append(
            f"{index}: the table differs from the result files; run python bench/evidence.py index"
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
    for doc in docs:
        problems += unquoted_numbers(doc, texts[doc], quotes.get(doc, []))
    return problems


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
    INDEX.write_text(render_index(INDEX.read_text()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("index", help="write docs/results/README.md's table")
    sub.add_parser("check", help="exit 1 when the index or README's numbers differ from the files")
    r = sub.add_parser("run", help="rerun the CPU results (all but the studies), then index")
    r.add_argument("keys", nargs="*", help=f"only these: {', '.join(x.key for x in RESULTS)}")
    args = p.parse_args()
    if args.what == "index":
        INDEX.write_text(render_index(INDEX.read_text()))
        print(f"wrote {INDEX.relative_to(REPO)}")
    elif args.what == "run":
        run(args.keys)
    else:
        problems = check()
        print("\n".join(problems) or "evidence: every quoted number matches its result file")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
