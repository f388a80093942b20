"""The GPU acceptance run: every question only a GPU answers, in one offline pass, part by part.

    ./run.sh gpu                          # every part, in priority order
    ./run.sh gpu smoke throughput         # some parts (a 10-minute slot: one part a call)
    ./run.sh gpu --budget dali=300 dali   # a part's time budget, seconds
    ./run.sh gpu --status                 # what is done, what is left, nothing run

Parts, in priority order (``PARTS``), each with its own time budget (``--budget PART=S``):

  smoke       a short synthetic ResNet-50 run per shipped ImageNet JSON as a user runs it (fp16,
              fp16_native in NCHW, bf16, lamb_fp16 and lars_bf16 in channels_last): exit status,
              images/s of the second epoch, the error line when one fails -> smoke_<gpu>.json
  throughput  dstrain against its bare PyTorch twin, bf16/fp16/fp16_native x channels_last x
              torch.compile, each pair as it finishes (bench/throughput.py --resume)
              -> throughput_<gpu>.json
  dali        ImageNet-like JPEGs made in parallel (or ``--jpegs DIR``, kept between calls), DaliLoader
              against the plain DALI pipeline with ``mixed`` decode (bench/loader.py)
              -> loader_<gpu>.json, and DALI-fed against synthetic training -> throughput_dali_<gpu>.json
  tests       the GPU-only tests (tests/test_gpu.py) -> suite_gpu_only_<gpu>.json, then the whole
              suite one test file at a time (junit XML kept per file) -> suite_<gpu>.json
  accuracy    the 90-epoch large-batch grid (3 seeds) and the epochs-to-target grid
              (bench/accuracy_study.py; its runs resume from their checkpoints)

Nothing is wasted: an item starts only if the part's budget still holds the slowest item seen so far
(else it is listed as not run, with why), a command still running at the end of the budget is
stopped (SIGTERM: a training run checkpoints) and recorded, and every item ends in a file before the
next starts. Calling again continues: finished items are read, not rerun (``--fresh`` reruns).
What was run, with exit statuses, durations and log files, is kept in gpu_run_<gpu>.json; logs in
gpu_run_<gpu>/. Every file records the device, torch/CUDA/cuDNN/DeepSpeed/DALI versions and the git
SHA (``DSTRAIN_GIT_SHA`` where the tree was copied without .git).

Offline: it uses this interpreter and the packages present. What is missing is named with where the
wheels go (``.whl/``: ``./run.sh gpu`` installs them with ``pip --no-index``; docs/gpu.md).
``--tiny`` shrinks every part (resnet18, 32 px, a few steps) so the orchestration itself is tested on
a CPU (tests/test_gpu_run.py); it is not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PARTS = ("smoke", "throughput", "dali", "tests", "accuracy")
BUDGET_S = {"smoke": 480, "throughput": 540, "dali": 540, "tests": 540, "accuracy": 540}
NEEDED = ("torch", "torchvision", "deepspeed", "omegaconf", "tensorboard")
# JSON, channels_last: the shipped ImageNet precisions and optimizers, in the layouts issue 29 names
SMOKE = (
    ("fp16.json", True),
    ("fp16_native.json", False),
    ("bf16.json", True),
    ("lamb_fp16.json", True),
    ("lars_bf16.json", True),
)
GRACE_S = 60  # after SIGTERM, before SIGKILL: a run's checkpoint on preemption


def gpu_slug(name: str | None) -> str:
    """``h100`` for "NVIDIA H100 80GB HBM3", ``cpu`` without a GPU: the result files' suffix."""
    if not name:
        return "cpu"
    words = re.sub(r"nvidia|geforce|tesla|rtx", " ", name.lower()).split()
    model = next((w for w in words if re.search(r"\d", w)), words[0] if words else "gpu")
    return re.sub(r"[^a-z0-9]+", "_", model).strip("_")


def environment() -> dict:
    import torch

    from dstrain.provenance import record

    def version(module: str) -> str | None:
        try:
            return __import__(module, fromlist=["__version__"]).__version__
        except ImportError:
            return None

    cuda = torch.cuda.is_available()
    return {
        **{k: v for k, v in record("").items() if k != "command"},  # git SHA, date, versions
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "torchvision": version("torchvision"),
        "dali": version("nvidia.dali"),
    }


def missing_packages() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


@dataclass
class Budget:
    seconds: float
    start: float = field(default_factory=time.monotonic)
    slowest: float = 0.0

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def fits(self, minimum: float) -> bool:
        """Room for one more item: the slowest so far (at least ``minimum``) still fits."""
        return self.left() >= max(self.slowest, minimum)

    def took(self, seconds: float) -> None:
        self.slowest = max(self.slowest, seconds)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a call cut off mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def run_bounded(cmd: list[str], seconds: float, log: Path, env: dict | None = None) -> dict:
    """Run ``cmd`` from the repository root for at most ``seconds``, output to ``log``; at the limit
    SIGTERM to its process group (a training run saves a checkpoint), SIGKILL ``GRACE_S`` later."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        stopped = False
        try:
            code = proc.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    text = log.read_text(errors="replace")
    errors = [  # what a reader of the record needs: the error lines, not the progress
        line
        for line in text.splitlines()
        if re.match(
            r"^(dstrain(\[rank \d+\])?(\.\w+)?: (error|stopped)|FAILED|E   |\w+Error: )", line
        )
    ]
    return {
        "command": " ".join(cmd),
        "exit": code,
        "seconds": round(time.monotonic() - t0, 1),
        "stopped_at_budget": stopped,
        "log": str(log.relative_to(REPO) if log.is_relative_to(REPO) else log),
        "errors": errors[-5:],
    }


class Run:
    """One call of the acceptance run: where results go, what an earlier call finished."""

    def __init__(self, args: argparse.Namespace, env: dict):
        self.args, self.env = args, env
        self.slug = args.slug or gpu_slug(env["device"] if env["gpus"] else None)
        self.results = Path(args.results)
        self.logs = self.results / f"gpu_run_{self.slug}"
        self.record_path = self.results / f"gpu_run_{self.slug}.json"
        self.record = self._load(self.record_path) or {"parts": {}}
        self.record["environment"] = env
        self.cuda = env["gpus"] > 0

    def _load(self, path: Path) -> dict | None:
        """An earlier call's file, unless ``--fresh`` or it ran other code (then it is started over)."""
        if self.args.fresh or not path.is_file():
            return None
        old = json.loads(path.read_text())
        sha = old.get("environment", {}).get("git_sha")
        if sha != self.env["git_sha"]:
            print(
                f"[gpu] {path.name}: from git {sha}, this is {self.env['git_sha']}: starting over"
            )
            return None
        return old

    def path(self, name: str) -> Path:
        return self.results / f"{name}_{self.slug}.json"

    def save(self) -> None:
        write_json(self.record_path, self.record)

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    # ------------------------------------------------------------ parts

    def smoke(self, budget: Budget) -> dict:
        out = self.path("smoke")
        result = self._load(out) or {"environment": self.env, "rows": {}}
        result.update(environment=self.env, not_run={})
        tiny = self.args.tiny
        batch, steps = (8, 4) if tiny else (256, 20)
        for json_name, channels_last in SMOKE:
            key = f"{json_name} channels_last={str(channels_last).lower()}"
            if result["rows"].get(key, {}).get("exit") == 0:
                continue
            if json_name == "fp16_native.json" and not self.cuda:
                result["not_run"][key] = "needs a GPU: DeepSpeed's native fp16 engine is CUDA-only"
                continue
            if not budget.fits(5 if tiny else 60):
                result["not_run"][key] = f"did not fit the budget ({budget.left():.0f} s left)"
                continue
            run_dir = (
                self.logs / "smoke" / key.replace(".json", "").replace(" channels_last=", "_cl_")
            )
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            cmd = self.python(
                "-m",
                "dstrain",
                "--config",
                "imagenet_resnet50",
                "--deepspeed_config",
                f"ds_configs/{json_name}",
                "data.loader=synthetic",
                f"data.synthetic_train_size={batch * steps}",
                f"data.synthetic_val_size={batch}",
                f"batch.global_size={batch}",
                f"batch.micro_per_rank={batch}",
                f"batch.eval_per_rank={batch}",
                f"model.channels_last={str(channels_last).lower()}",
                "epochs=2",
                "optim.warmup_epochs=0",
                "eval_every_epochs=2",
                "checkpoint.every_epochs=0",
                "log.tensorboard=false",
                f"run_dir={run_dir}",
                *(
                    ["model.name=resnet18", "data.image_size=32", "data.val_resize=32"]
                    if tiny
                    else []
                ),
            )
            row = run_bounded(cmd, budget.left(), run_dir.parent / (run_dir.name + ".log"))
            budget.took(row["seconds"])
            summary = run_dir / "summary.json"
            if row["exit"] == 0 and summary.is_file():
                s = json.loads(summary.read_text())
                timed = s["history"][-1]
                row["images_per_s"] = (
                    timed["steps_per_epoch"] * timed["global_batch"] / timed["train_s"]
                )
                row["final_top1"] = s.get("final_top1")
            result["rows"][key] = row
            write_json(out, result)
            print(
                f"[gpu] smoke {key}: exit {row['exit']}"
                + (f", {row['images_per_s']:.0f} img/s" if "images_per_s" in row else ""),
                flush=True,
            )
        write_json(out, result)
        done = all(r.get("exit") == 0 for r in result["rows"].values()) and not any(
            "budget" in why for why in result["not_run"].values()
        )
        return {
            "file": str(out),
            "complete": done,
            "failed": [k for k, r in result["rows"].items() if r.get("exit") != 0],
            "not_run": result["not_run"],
        }

    def throughput(self, budget: Budget) -> dict:
        out = self.path("throughput")
        grid = (
            ["--precisions", "bf16", "fp16", "fp16_native"]
            if self.cuda
            else ["--precisions", "fp32"]
        )
        cmd = self.python(
            "bench/throughput.py",
            *grid,
            "--loaders",
            "synthetic",
            "--channels-last",
            "on",
            "off",
            "--compile",
            *(["off"] if self.args.tiny else ["on", "off"]),
            *self._tiny_throughput(),
            "--resume",
            "--budget-s",
            str(max(budget.left() - GRACE_S, 1)),
            "--out",
            str(out),
        )
        return self._bench_file(cmd, budget, out, "throughput")

    def _tiny_throughput(self) -> list[str]:
        if not self.args.tiny:
            return []
        return [
            "--model",
            "resnet18",
            "--batch",
            "4",
            "--image-size",
            "32",
            "--images",
            "16",
            "--dali-images",
            "16",
            "--bare-steps",
            "2",
            "--bare-warmup",
            "1",
            "--epochs",
            "2",
        ]

    def _bench_file(self, cmd: list[str], budget: Budget, out: Path, name: str) -> dict:
        row = run_bounded(cmd, budget.left(), self.logs / f"{name}.log")
        budget.took(row["seconds"])
        complete = out.is_file() and json.loads(out.read_text()).get("complete", False)
        return {**row, "file": str(out), "complete": bool(complete and row["exit"] == 0)}

    def dali(self, budget: Budget) -> dict:
        if importlib.util.find_spec("nvidia.dali") is None:
            return {
                "complete": False,
                "not_run": "nvidia.dali is not installed: put its wheel "
                "(and nvidia-nvimgcodec, nvidia-libnvcomp, nvidia-nvjpeg) in .whl/",
            }
        from bench.loader import make_folder_parallel

        tiny = self.args.tiny
        n = 64 if tiny else 6400
        jpegs = Path(self.args.jpegs or self.results / f"gpu_run_{self.slug}" / "jpegs")
        have = len(list((jpegs / "train").rglob("*.JPEG"))) if (jpegs / "train").is_dir() else 0
        t0 = time.monotonic()
        if have < n:
            make_folder_parallel(jpegs, n, classes=16 if tiny else 100, start=have)
        part = {
            "jpegs": str(jpegs),
            "jpegs_made": n - min(have, n),
            "jpegs_s": round(time.monotonic() - t0, 1),
        }
        loader_out = self.path("loader")
        if not (loader_out.is_file() and not self.args.fresh and self._same_sha(loader_out)):
            small = ["--batch", "4", "--batches-per-epoch", "2", "--threads", "1", "--epochs", "1"]
            cmd = self.python(
                "bench/loader.py",
                "--root",
                str(jpegs),
                "--devices",
                "cuda" if self.cuda else "cpu",
                *(small if tiny else ["--batches-per-epoch", "25", "100"]),
                "--out",
                str(loader_out),
            )
            part["loader"] = run_bounded(cmd, budget.left(), self.logs / "loader.log")
            budget.took(part["loader"]["seconds"])
        fed_out = self.path("throughput_dali")
        if budget.fits(10 if tiny else 120):
            cmd = self.python(
                "bench/throughput.py",
                "--loaders",
                "synthetic",
                "dali",
                "--dali-root",
                str(jpegs),
                "--precisions",
                "bf16" if self.cuda else "fp32",
                "--channels-last",
                "on",
                "--compile",
                "off",
                *self._tiny_throughput(),
                "--resume",
                "--budget-s",
                str(max(budget.left() - GRACE_S, 1)),
                "--out",
                str(fed_out),
            )
            part["fed"] = self._bench_file(cmd, budget, fed_out, "throughput_dali")
        part["complete"] = (
            loader_out.is_file()
            and part.get("loader", {}).get("exit", 0) == 0
            and part.get("fed", {}).get("complete", False)
        )
        return part

    def _same_sha(self, path: Path) -> bool:
        d = json.loads(path.read_text())
        return (d.get("git_sha") or d.get("environment", {}).get("git_sha")) == self.env["git_sha"]

    def tests(self, budget: Budget) -> dict:
        part: dict = {}
        gpu_only = self.path("suite_gpu_only")
        if not (gpu_only.is_file() and self._same_sha(gpu_only)) or self.args.fresh:
            cmd = self.python(
                "tools/suite.py", "--out", str(gpu_only), "--", "tests/test_gpu.py", "-q"
            )
            part["gpu_only"] = run_bounded(cmd, budget.left(), self.logs / "suite_gpu_only.log")
            budget.took(part["gpu_only"]["seconds"])
        junits = self.logs / "junit"
        files = self.args.test_files or sorted(
            str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
        )
        part["files"] = {}
        for f in files:
            xml = junits / (Path(f).stem + ".xml")
            if xml.is_file() and not self.args.fresh:
                part["files"][f] = "done (an earlier call)"
                continue
            if not budget.fits(30):
                part["files"][f] = f"not run: {budget.left():.0f} s left in the budget"
                continue
            tmp = xml.with_suffix(".partial.xml")
            cmd = self.python(
                "-m", "pytest", f, "-q", "-p", "no:cacheprovider", f"--junitxml={tmp}"
            )
            row = run_bounded(cmd, budget.left(), self.logs / "tests" / (Path(f).stem + ".log"))
            if row["stopped_at_budget"] or not tmp.is_file():
                part["files"][f] = f"stopped at the budget after {row['seconds']:.0f} s: rerun"
                tmp.unlink(missing_ok=True)
            else:
                tmp.replace(xml)
                part["files"][f] = f"exit {row['exit']} in {row['seconds']:.0f} s"
                budget.took(row["seconds"])
        done = sorted(junits.glob("*.xml")) if junits.is_dir() else []
        done = [x for x in done if not x.name.endswith(".partial.xml")]
        if done:
            cmd = self.python(
                "tools/suite.py",
                "--junit",
                *map(str, done),
                "--ran",
                "./run.sh gpu tests (one pytest per test file)",
                "--out",
                str(self.path("suite")),
            )
            part["summary"] = run_bounded(cmd, 120, self.logs / "suite_summary.log")
        part["complete"] = len(done) == len(files) and part.get("gpu_only", {}).get("exit", 0) == 0
        return part

    def accuracy(self, budget: Budget) -> dict:
        common = ["--precision", "bf16", "--jobs", "6", "--epochs", "90"]
        grids = {  # result file stem: the study's arguments
            f"accuracy_study_90ep_{self.slug}": common,
            f"epochs_to_target_90ep_{self.slug}": [
                *common,
                *("--grid", "target", "--seeds", "0", "--target-from"),
                str(self.path("accuracy_study_90ep")),  # its baseline's top-1 minus 0.3 pt
            ],
        }
        if self.args.tiny:
            tiny = ["--epochs", "2", "--seeds", "0", "--rows", "baseline", "--jobs", "1"]
            grids = {f"accuracy_study_2ep_{self.slug}": tiny}
        from dstrain.data.fashion_mnist import IDX_FILES, find_idx

        root = Path(self.args.fmnist)
        lacking = [f for pair in IDX_FILES.values() for f in pair if find_idx(root, f) is None]
        if lacking:
            return {
                "complete": False,
                "not_run": f"Fashion-MNIST not found in {root} (no "
                f"{', '.join(lacking)}): copy its idx files there or pass --fmnist DIR",
            }
        part: dict = {"grids": []}
        for name, grid in grids.items():
            if not budget.fits(10 if self.args.tiny else 120):
                part["grids"].append({"name": name, "not_run": "did not fit the budget"})
                continue
            cmd = self.python(
                "bench/accuracy_study.py",
                *grid,
                "--name",
                name,
                "--out",
                str(self.results),
                "--runs",
                str(self.logs / f"runs_{name}"),  # kept: the next call resumes them
                "--extra",
                f"data.root={root}",
            )
            row = run_bounded(cmd, budget.left(), self.logs / f"{name}.log")
            budget.took(row["seconds"])
            part["grids"].append(row)
        part["complete"] = all(g.get("exit") == 0 for g in part["grids"])
        return part


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "parts",
        nargs="*",
        metavar="PART",
        help=f"parts to run, in this order: {' '.join(PARTS)} (default: all)",
    )
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="PART=S",
        help=f"a part's time budget in seconds (defaults: {BUDGET_S})",
    )
    p.add_argument("--results", default=str(REPO / "bench/results"), help="where result files go")
    p.add_argument("--slug", help="result files' suffix (default: from the GPU's name, e.g. h100)")
    p.add_argument("--jpegs", help="dali: an ImageNet-like JPEG folder to use (and complete)")
    p.add_argument(
        "--fmnist",
        default="/usr/share/datasets/fashion-mnist",
        help="accuracy: the Fashion-MNIST idx files (a compute node has no download)",
    )
    p.add_argument("--test-files", nargs="+", help="tests: these files instead of tests/test_*.py")
    p.add_argument("--fresh", action="store_true", help="rerun what an earlier call finished")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="resnet18, 32 px, a few steps: tests the orchestration on a CPU",
    )
    p.add_argument("--status", action="store_true", help="print what is done and left; run nothing")
    args = p.parse_args(argv)
    for name in args.parts:
        if name not in PARTS:
            p.error(f"unknown part {name!r}: choose from {' '.join(PARTS)}")
    budgets = dict(BUDGET_S)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not re.fullmatch(r"\d+(\.\d+)?", seconds):
            p.error(f"--budget {item}: expected PART=SECONDS with PART one of {', '.join(PARTS)}")
        budgets[name] = float(seconds)
    missing = missing_packages()
    if missing:
        print(
            f"[gpu] missing Python packages: {', '.join(missing)}. Without network, download "
            "their wheels on a machine with network for this Python "
            f"({sys.version_info.major}.{sys.version_info.minor}) into .whl/ (docs/gpu.md: 'Wheels "
            "for an offline node') and rerun ./run.sh gpu: it installs .whl/*.whl with pip --no-index",
            file=sys.stderr,
        )
        return 2
    run = Run(args, environment())
    env = run.env
    print(
        f"[gpu] {env['device']}, torch {env['torch']} (CUDA {env['cuda_runtime']}), DeepSpeed "
        f"{env['deepspeed']}, DALI {env['dali']}, git {env['git_sha']} -> {run.results}/*_{run.slug}.json",
        flush=True,
    )
    if args.status:
        for name in PARTS:
            part = run.record["parts"].get(name)
            print(
                f"  {name:10s} "
                + (
                    "not run"
                    if part is None
                    else "complete"
                    if part.get("complete")
                    else "incomplete: rerun to continue"
                )
            )
        return 0
    if not run.cuda and not args.tiny:
        print(
            "[gpu] no CUDA device here: the parts run on the CPU, which measures nothing a GPU "
            "question needs (use --tiny to test the orchestration)",
            flush=True,
        )
    code = 0
    for name in args.parts or PARTS:
        previous = run.record["parts"].get(name, {})
        if previous.get("complete") and not args.fresh:
            print(
                f"[gpu] {name}: complete in an earlier call ({run.record_path.name}); --fresh redoes it"
            )
            continue
        print(f"[gpu] {name}: budget {budgets[name]:.0f} s", flush=True)
        t0 = time.monotonic()
        budget = Budget(budgets[name])
        try:
            part = (
                getattr(run, name)(budget)
                if budgets[name] > 0
                else {"complete": False, "not_run": "budget 0"}
            )
        except Exception as err:  # one part's crash must not cost the others their slot
            part = {"complete": False, "error": f"{type(err).__name__}: {err}"}
            code = 1
        part["seconds"] = round(time.monotonic() - t0, 1)
        part["budget_s"] = budgets[name]
        run.record["parts"][name] = part
        run.save()  # before the next part starts
        state = (
            "complete" if part.get("complete") else "incomplete (rerun ./run.sh gpu to continue)"
        )
        print(f"[gpu] {name}: {state} in {part['seconds']:.0f} s", flush=True)
        if not part.get("complete"):
            code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
