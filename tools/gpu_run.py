"""The GPU acceptance run: only what a GPU answers, in a 15-minute slot of jobs, part by part.

    ./run.sh gpu                        # one job: the parts in priority order, until its deadline
    ./run.sh gpu throughput dali        # some parts
    ./run.sh gpu --budget dali=300      # a part's own time budget, seconds
    ./run.sh gpu --receive              # a ferry job: keep the DALI part it brought (gpu_node.py)
    ./run.sh gpu --status               # what is done, what is left; nothing run

Made for a node with no network, 15 minutes of device time a slot (every job, start and idle wait
counted), jobs of at most 10 minutes, and files coming home only through ``$OUT`` (docs/gpu.md: the
slot plan ``./run.sh gpu-prepare`` prints). ``./run.sh gpu`` installs what the job brought
(tools/gpu_node.py), then runs this; each job continues where the last one stopped.

Parts, in priority order (``PARTS``, issue 50), each with a budget (``--budget PART=S``):

  throughput  dstrain against its bare PyTorch twin, bf16 channels_last compiled and eager, NCHW
              compiled, each pair 3 times, its order alternating, the same warm-up on both sides
              -> throughput_<gpu>.json (median, range)
  dali        once DALI's parts have all arrived: DaliLoader against the plain DALI pipeline
              (``mixed`` decode) from folders and shards -> loader_<gpu>.json, DALI-fed against
              synthetic training -> throughput_dali_<gpu>.json
  tests       the tests whose path differs on a GPU (``-m gpu``) on pytest-xdist workers, continued
              test by test across jobs -> suite_gpu_<gpu>.json; the rest of the suite is CI's
  micro       BN span's cost on ResNet-50 (cuDNN), the BN group layer's arithmetic on one GPU,
              the trainer's and the gradient noise scale's overhead on ResNet-50 (bf16, two micro
              batches a step), one optimizer step of SGD, LARS, LAMB, FusedLamb, timm's Lars, Muon,
              SOAP -> bn_span_<gpu>.json, bn_group_<gpu>.json, overhead_<gpu>.json,
              optimizer_step_<gpu>.json
  smoke       a short synthetic ResNet-50 run per shipped ImageNet JSON as a user runs it (fp16,
              fp16_native in NCHW, bf16, lamb_fp16, lars_bf16): a row whose training loss does not
              fall fails -> smoke_<gpu>.json
  fp16        the fp16 pairs (autocast, the native engine), repeated as the bf16 ones ->
              throughput_<gpu>.json; a host-bound pair (resnet18, batch 64, eager bf16: 1% of host
              overhead shows) -> throughput_host_<gpu>.json; CUDA graphs
              (``model.compile_mode=reduce-overhead``) against the bare loop compiled the same way
              -> throughput_cudagraphs_<gpu>.json (these two on a GPU only); a torch.profiler
              summary of dstrain's and the bare loop's steps -> profile_step_<gpu>.json

A job ends by itself: ``--deadline`` (default 560 s, counted from ``$DSTRAIN_GPU_JOB_START``, which
``./run.sh gpu`` sets before installing) gives each part the smaller of its budget and the time left;
a command still running then gets SIGTERM (a training run checkpoints) and SIGKILL 20 s later. A
SIGTERM to this job stops the running command's process group the same way and saves. Every
finished item is in the state folder (``runs/gpu``, ``--state``) before the next starts, and with
``$OUT`` set the state is packed into ``$OUT/gpu_state.tar.gz`` after each (tools/gpu_pack.py).
What failed is recorded and not retried (``--fresh`` reruns everything); items finished at another
commit are kept, each with its SHA. Heavy files (JPEGs, checkpoints, run folders) go to
``$DSTRAIN_GPU_HOME/work``, never into the pack.

``--tiny`` shrinks every part (resnet18 at 32 px, dstrain's small ResNet at 16 px for the smoke
runs, a few steps) so the orchestration runs on a CPU (tests/test_gpu_run.py,
tests/test_gpu_node_play.py); it is not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import gpu_pack  # noqa: E402
from tools.gpu_node import NEEDED, write_json  # noqa: E402
from tools.suite import headline, progress_outcomes, summarise_progress  # noqa: E402

PARTS = ("throughput", "dali", "tests", "micro", "smoke", "fp16")
BUDGET_S = {
    "throughput": 360,
    "dali": 180,
    "tests": 150,
    "micro": 120,
    "smoke": 200,
    "fp16": 450,  # 3 fp16 pairs x 3 repeats (~28 s a run on the H100), the host-bound pair, ...
}
DEADLINE_S = 560  # a job's own end, inside the node's 600-s limit
GRACE_S = 20  # after SIGTERM, before SIGKILL: a training run's checkpoint
PACK_S = 10  # kept for the last save and pack
# JSON, channels_last: the shipped ImageNet precisions and optimizers, in the layouts issue 29 names
SMOKE = (
    ("fp16.json", True),
    ("fp16_native.json", False),
    ("bf16.json", True),
    ("lamb_fp16.json", True),
    ("lars_bf16.json", True),
)
PRIORITY_ROWS = ("bf16:nhwc:on", "bf16:nhwc:off", "bf16:nchw:on")
REPEATS = (
    3  # each pair (bf16, fp16, the host-bound one), its order alternating: a median and a range
)
# both loops of a pair: 50 untimed steps (compilation and cuDNN autotuning in those; dstrain's first
# epoch of 50 x 256 images), then 50 timed ones (dstrain's second epoch)
GPU_TIMING = ("--warmup-steps", "50", "--epochs", "2")
FP16_ROWS = ("fp16:nhwc:on", "fp16:nhwc:off", "fp16_native:nhwc:off")
# a pair whose step is short enough that 1% of host overhead shows: resnet18 at batch 64, eager
# (no compiled graph hides the host's launches); 200 warm-up steps, 400 timed (2 epochs of 200:
# dstrain's per-epoch work counted twice, as in a real epoch it would be spread over thousands)
HOST_BOUND = ("--model", "resnet18", "--batch", "64", "--image-size", "224")
HOST_BOUND += ("--warmup-steps", "200", "--epochs", "3")
HOST_BOUND_ROWS = ("bf16:nhwc:off",)
CUDA_GRAPH_ROWS = ("bf16:nhwc:on",)
# the smoke's loss must fall from the first epoch's mean to the second's by this much (the H100 at
# 9a9aaeb: fp16.json 5.17 -> 4.08 in 2 x 20 steps; the native engine that did not learn, +0.0001)
SMOKE_LOSS_DROP = 0.05
GPU_TEST_WORKERS = 8  # pytest-xdist workers for the -m gpu tests on the node's 16 cores
DALI_SKIP = re.compile(r"dali", re.IGNORECASE)  # a skip reason a test gives without DALI


class Stopped(Exception):
    """This job got SIGTERM: the running command was stopped; save and end."""


def on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop; the saving is not interrupted
    raise Stopped(f"signal {signum}")


def gpu_slug(name: str | None) -> str:
    """``h100`` for "NVIDIA H100 80GB HBM3", ``cpu`` without a GPU: the result files' suffix."""
    if not name:
        return "cpu"
    words = re.sub(r"nvidia|geforce|tesla|rtx", " ", name.lower()).split()
    model = next((w for w in words if re.search(r"\d", w)), words[0] if words else "gpu")
    return re.sub(r"[^a-z0-9]+", "_", model).strip("_")


def environment() -> dict:
    import torch

    from dstrain.core.provenance import record

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


def dali_installed() -> bool:
    """DALI is importable: all of its parts arrived and were installed (tools/gpu_node.py)."""
    return importlib.util.find_spec("nvidia.dali") is not None


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


def parts_status(record: dict) -> str:
    """A line per part: not run, complete, or incomplete with why (the record's ``not_run``)."""
    lines = []
    for name in PARTS:
        part = record["parts"].get(name)
        state = "not run" if part is None else "complete" if part.get("complete") else "incomplete"
        why = (part or {}).get("not_run", "")
        lines.append(f"  {name:10s} {state}{': ' + why if why and state != 'complete' else ''}")
    return "\n".join(lines) + "\n"


def loss_stalled(losses: list[float], drop: float) -> str:
    """Why a smoke run failed to learn ('' if it learnt): its training loss must fall by ``drop``
    from the first epoch's mean to the last's. The native fp16 engine that did not learn on the
    H100 (9a9aaeb) ran to the end with exit 0 and a loss of 6.9231 -> 6.9232."""
    if len(losses) < 2 or losses[0] - losses[-1] >= drop and losses[-1] < losses[0]:
        return ""
    return (
        f"the training loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f} over "
        f"{len(losses)} epochs; a learning run falls by >= {drop:g}): it does not train"
    )


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _stop_group(proc: subprocess.Popen, grace: float) -> int:
    """SIGTERM to the command's process group, SIGKILL ``grace`` seconds later; its exit status."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def run_bounded(
    cmd: list[str],
    seconds: float,
    log: Path,
    env: dict | None = None,
    tick=None,
    grace: float = GRACE_S,
) -> dict:
    """Run ``cmd`` from the repository root for at most ``seconds``, output to ``log``; then SIGTERM
    to its process group (a training run saves a checkpoint), SIGKILL ``grace`` s later. The command
    gets its own process group in this job's session: the node ends it with the job, and a SIGTERM
    to this job (:class:`Stopped`) stops the group before it propagates. ``tick()`` runs every 30 s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            **group,
        )
        stopped, code = False, None
        try:
            while code is None:
                left = seconds - (time.monotonic() - t0)
                if left <= 0:
                    stopped = True
                    code = _stop_group(proc, grace)
                    break
                try:
                    code = proc.wait(timeout=min(left, 30))
                except subprocess.TimeoutExpired:
                    if tick:
                        tick()
        finally:
            if code is None:  # Stopped (or any error) while it ran: stop it before going on
                _stop_group(proc, 5)
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
    """One job of the acceptance run: its deadline, the state an earlier job left, where files go."""

    def __init__(self, args: argparse.Namespace, env: dict):
        self.args, self.env = args, env
        self.slug = args.slug or gpu_slug(env["device"] if env["gpus"] else None)
        self.state = Path(args.state).resolve()
        self.results = self.state / "results"
        self.logs = self.state / "logs"
        work = os.environ.get("DSTRAIN_GPU_HOME") or "/tmp/dstrain-gpu"
        self.work = Path(args.work or Path(work) / "work").resolve()
        self.record_path = self.state / f"gpu_run_{self.slug}.json"
        self.results.mkdir(parents=True, exist_ok=True)  # the benches write into it, not all mkdir
        old = None if args.fresh else read_json(self.record_path)
        if old and old.get("environment", {}).get("git_sha") != env["git_sha"]:
            print(
                f"[gpu] {self.record_path.name}: items finished at {old['environment']['git_sha']} "
                f"are kept, each with its SHA (this is {env['git_sha']}; --fresh reruns them)",
                flush=True,
            )
        self.record = old or {"parts": {}, "jobs": 0}
        # parts imported complete for this GPU in an earlier slot, whose state did not travel
        self.imported = set() if args.fresh else gpu_pack.imported_complete(self.slug)
        self.record["environment"] = env
        self.record["jobs"] = self.record.get("jobs", 0) + 1
        self.cuda = env["gpus"] > 0
        start = float(os.environ.get("DSTRAIN_GPU_JOB_START") or time.time())
        self.deadline = start + args.deadline
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None

    def left(self) -> float:
        """Seconds this job may still give a command (its grace and the last pack kept apart)."""
        return self.deadline - time.time() - GRACE_S - PACK_S

    def budget(self, part_budget: float) -> Budget:
        return Budget(max(0.0, min(part_budget, self.left())))

    def path(self, name: str) -> Path:
        return self.results / f"{name}_{self.slug}.json"

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.state))

    def save(self, status: str = "") -> None:
        """The record, then the pack in ``$OUT``: after every finished item."""
        write_json(self.record_path, self.record)
        if self.out:
            gpu_pack.pack(self.state, self.out, status or self.status())

    def status(self) -> str:
        head = f"{self.env['device']}, git {self.env['git_sha']}, job {self.record['jobs']}"
        return head + "\n" + parts_status(self.record)

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def bounded(self, cmd: list[str], budget: Budget, log: str, **kw) -> dict:
        row = run_bounded(cmd, budget.left(), self.logs / log, tick=self.save, **kw)
        budget.took(row["seconds"])
        return row

    # ------------------------------------------------------------ parts

    def smoke(self, budget: Budget) -> dict:
        out = self.path("smoke")
        result = (None if self.args.fresh else read_json(out)) or {"rows": {}}
        result.update(environment=self.env, not_run={})
        tiny = self.args.tiny
        batch, steps = (8, 4) if tiny else (256, 20)
        for json_name, channels_last in SMOKE:
            key = f"{json_name} channels_last={str(channels_last).lower()}"
            if key in result["rows"]:
                continue  # finished or failed in an earlier job: recorded, not retried
            if json_name == "fp16_native.json" and not self.cuda:
                result["not_run"][key] = "needs a GPU: DeepSpeed's native fp16 engine is CUDA-only"
                continue
            if not budget.fits(5 if tiny else 60):
                result["not_run"][key] = f"did not fit the budget ({budget.left():.0f} s left)"
                continue
            name = key.replace(".json", "").replace(" channels_last=", "_cl_")
            run_dir = self.work / "smoke" / name
            shutil.rmtree(run_dir, ignore_errors=True)
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
                    # the orchestration: dstrain's small ResNet at 16 px (a CPU runs resnet18's
                    # fp16 autocast at ~7 img/s there, the whole smoke ~45 s; this one in seconds)
                    ["model.name=resnet_small", "model.width=8"]
                    + ["data.image_size=16", "data.val_resize=16"]
                    if tiny
                    else []
                ),
            )
            row = self.bounded(cmd, budget, f"smoke/{name}.log")
            row.update(git_sha=self.env["git_sha"], job=self.record["jobs"])
            summary = run_dir / "summary.json"
            if row["exit"] == 0 and summary.is_file():
                s = json.loads(summary.read_text())
                timed = s["history"][-1]
                row["images_per_s"] = (
                    timed["steps_per_epoch"] * timed["global_batch"] / timed["train_s"]
                )
                row["final_top1"] = s.get("final_top1")
                row["train_loss"] = [h["train_loss"] for h in s["history"]]
                stalled = loss_stalled(row["train_loss"], 0.0 if tiny else SMOKE_LOSS_DROP)
                if stalled:
                    row["errors"] = [*row.get("errors", []), stalled]
                    row["loss_stalled"] = True
            result["rows"][key] = row
            write_json(out, result)
            self.save()
            print(
                f"[gpu] smoke {key}: exit {row['exit']}"
                + (f", {row['images_per_s']:.0f} img/s" if "images_per_s" in row else "")
                + (f"; FAILED: {row['errors'][-1]}" if row.get("loss_stalled") else ""),
                flush=True,
            )
        write_json(out, result)
        return {
            "files": [self.rel(out)],
            "complete": not any("budget" in why for why in result["not_run"].values()),
            "failed": [
                k for k, r in result["rows"].items() if r.get("exit") != 0 or r.get("loss_stalled")
            ],
            "not_run": "; ".join(f"{k}: {v}" for k, v in result["not_run"].items()),
        }

    def _throughput_cmd(
        self, out: Path, budget: Budget, *select: str, sizes: tuple[str, ...] = GPU_TIMING
    ) -> list[str]:
        """bench/throughput.py over the ``select``ed rows at ``sizes`` (model, batch, warm-up and
        timed steps; --tiny's instead on a CPU)."""
        return self.python(
            "bench/throughput.py",
            *select,
            "--loaders",
            "synthetic",
            *(self._tiny_throughput() or sizes),
            *([] if self.args.fresh else ["--resume"]),
            "--budget-s",
            str(max(budget.left() - GRACE_S, 1)),
            "--out",
            str(out),
        )

    def _repeats(self) -> tuple[str, str]:
        """Every pair of the plan REPEATS times, its order alternating (--tiny: twice)."""
        return ("--repeats", "2" if self.args.tiny else str(REPEATS))

    def throughput(self, budget: Budget) -> dict:
        """The priority pairs, each REPEATS times, order alternating: bf16 channels_last compiled and
        eager, NCHW compiled."""
        out = self.path("throughput")
        rows = PRIORITY_ROWS if self.cuda else ("fp32:nhwc:off",)  # a CPU: the orchestration
        cmd = self._throughput_cmd(out, budget, "--rows", *rows, *self._repeats())
        return self._bench_file(cmd, budget, out, "throughput")

    def fp16(self, budget: Budget) -> dict:
        """The fp16 pairs into the throughput file and the host-bound pair, repeated as the bf16
        ones; CUDA graphs against the bare loop compiled the same way, and the profile of both
        loops' steps: each item once, recorded."""
        # on a CPU (--tiny): the orchestration only, eager (inductor would take minutes there)
        fp16_rows = FP16_ROWS if self.cuda else ("fp32:nchw:off",)  # CPU fp16: ~20x slower
        profile = (
            ("--model", "resnet18", "--batch", "8", "--image-size", "32")
            + ("--steps", "3", "--warmup", "1", "--precision", "fp32", "--compile", "off")
            if self.args.tiny or not self.cuda
            # eager: the host's share of a step shows whole (20 steps a loop, ~2 min on an H100)
            else ("--precision", "bf16", "--channels-last", "on", "--compile", "off")
            + ("--steps", "20", "--warmup", "5", "--log-every", "10")
        )
        # --tiny: each pair once (on a CPU fp32 rows; the throughput part's repeats show the
        # alternation)
        repeats = ("--repeats", "1") if self.args.tiny else self._repeats()
        graphs = ("--rows", *CUDA_GRAPH_ROWS, "--compile-mode", "reduce-overhead")
        pairs = ("--rows", *fp16_rows, *repeats)
        host = ("--rows", *HOST_BOUND_ROWS, *repeats)
        items = {
            "throughput": lambda out, b: self._bench_file(
                self._throughput_cmd(out, b, *pairs), b, out, "throughput"
            ),
            "throughput_host": lambda out, b: self._bench_file(
                self._throughput_cmd(out, b, *host, sizes=HOST_BOUND), b, out, "throughput_host"
            ),
            "throughput_cudagraphs": lambda out, b: self._bench_file(
                self._throughput_cmd(out, b, *graphs), b, out, "throughput_cudagraphs"
            ),
            "profile_step": lambda out, b: self.bounded(
                self.python("bench/profile_step.py", *profile, "--out", str(out)),
                b,
                "profile_step.log",
            ),
        }
        if not self.cuda:
            # the host-bound pair and CUDA graphs measure a GPU's kernel launches; on a CPU (--tiny)
            # each timed the throughput item's eager pair once more, which the play does not need
            del items["throughput_host"], items["throughput_cudagraphs"]
        return self._each_once("fp16", items, budget, minimum=60)

    def _each_once(self, part_name: str, items: dict, budget: Budget, minimum: float) -> dict:
        """A part made of items (name -> ``run(result file, budget)`` giving the row), each run once
        in order and recorded, finished or failed, with its SHA and job. An item the budget stopped
        (or whose bench left rows for later) runs once more in the next job, then is given up."""
        part = self.record["parts"].get(part_name, {})
        part.setdefault("items", {})
        cuts = part.setdefault("cuts", {})
        for name, run in items.items():
            if name in part["items"]:
                continue  # finished or failed in an earlier job
            if not budget.fits(10 if self.args.tiny else minimum):
                part["not_run"] = f"{name}: did not fit the budget ({budget.left():.0f} s left)"
                break
            row = run(self.path(name), budget)
            stopped = row["stopped_at_budget"] or row.get("complete") is False
            if stopped and cuts.get(name, 0) < 1:
                cuts[name] = cuts.get(name, 0) + 1  # once more in the next job, then given up
                part["not_run"] = f"{name}: stopped at the budget; the next job continues"
                break
            part["items"][name] = {
                **row,
                "git_sha": self.env["git_sha"],
                "job": self.record["jobs"],
            }
            self.record["parts"][part_name] = part
            self.save()
        else:
            part.pop("not_run", None)
        part["files"] = [self.rel(self.path(n)) for n in items if self.path(n).is_file()]
        part["complete"] = all(n in part["items"] for n in items)
        part["failed"] = [n for n, r in part["items"].items() if r["exit"] != 0 or r.get("failed")]
        return part

    def _tiny_throughput(self) -> list[str]:
        if not self.args.tiny:
            return []
        return [
            *("--model", "resnet18", "--batch", "4", "--image-size", "32", "--warmup-steps", "2"),
            *("--dali-images", "16", "--epochs", "2"),
        ]

    def _bench_file(self, cmd: list[str], budget: Budget, out: Path, name: str) -> dict:
        row = self.bounded(cmd, budget, f"{name}.log")
        data = read_json(out) or {}
        return {
            **row,
            "files": [self.rel(out)] if out.is_file() else [],
            "complete": bool(data.get("complete")),
            "failed": [f["row"] for f in data.get("failed", [])],
        }

    def micro(self, budget: Budget) -> dict:
        """BN span's cost (ResNet-50, cuDNN), the BN group layer's arithmetic on one GPU, the
        trainer's and the noise scale's overhead (ResNet-50), and one optimizer step (SGD, LARS,
        LAMB, FusedLamb, timm's Lars, Muon, SOAP). BN span first: the 9a9aaeb pass
        measured the optimizer step, and BN span never got its 60 s; it now runs 3 rounds of 5
        steps at batch 128 (~30 s on an H100)."""
        device = "cuda" if self.cuda else "cpu"
        items = {
            "bn_span": [
                "bench/bn_span.py",
                *("--device", device),
                *(
                    ("--steps", "1", "--rounds", "1", "--batch", "64")
                    if self.args.tiny
                    else ("--model", "resnet50", "--image-size", "224", "--batch", "128")
                    + ("--steps", "5", "--rounds", "3")
                ),
            ],
            # one GPU: the BN group layer's own arithmetic against cuDNN's BN (a group of one
            # rank); the collectives need a node with 2 GPUs or more (--ranks N)
            "bn_group": [
                "bench/bn_group.py",
                *("--ranks", "1", "--device", device),
                *(
                    ("--steps", "1", "--rounds", "1", "--batch", "4", "--width", "4")
                    if self.args.tiny
                    else ("--model", "resnet50", "--image-size", "224", "--batch", "64")
                    + ("--steps", "5", "--rounds", "3")
                ),
            ],
            # the trainer's step against a bare DeepSpeed step, and the gradient noise scale's
            # cost (issue 73: <= 1% of a step), on ResNet-50 accumulating two micro batches
            "overhead": [
                "bench/overhead.py",
                "--config",
                "imagenet_resnet50",
                *(
                    ("--steps", "2", "--pairs", "2", "--batch", "8")
                    + ("model.name=resnet_small", "model.width=4", "data.image_size=16")
                    + ("data.val_resize=16", "batch.micro_per_rank=4")
                    if self.args.tiny
                    else ("--deepspeed_config", "ds_configs/bf16.json", "--batch", "256")
                    + ("--steps", "10", "--pairs", "5", "batch.micro_per_rank=128")
                ),
                "data.loader=synthetic",
            ],
            "optimizer_step": [
                "bench/optimizer_step.py",
                *("--device", device, "--rounds", "1" if self.args.tiny else "30"),
                *(("--model", "resnet18") if self.args.tiny else ()),
            ],
        }
        runs = {
            name: lambda out, b, name=name, cmd=cmd: self.bounded(
                self.python(*cmd, "--out", str(out)), b, f"{name}.log"
            )
            for name, cmd in items.items()
        }
        return self._each_once("micro", runs, budget, minimum=40)

    def dali(self, budget: Budget) -> dict:
        earlier = self.record["parts"].get("dali", {})
        if not dali_installed():
            why = os.environ.get("DSTRAIN_GPU_DALI") or "nvidia.dali is not installed"
            return {**earlier, "complete": False, "not_run": why, "waiting": True}
        from bench.loader import make_folder_parallel

        tiny = self.args.tiny
        n = 64 if tiny else 6400
        jpegs = Path(self.args.jpegs or self.work / "jpegs")
        have = len(list((jpegs / "train").rglob("*.JPEG"))) if (jpegs / "train").is_dir() else 0
        t0 = time.monotonic()
        if have < n:
            if not budget.fits(10 if tiny else 120):  # making them is not bounded: start in time
                return {
                    **earlier,
                    "complete": False,
                    "not_run": "no time for the JPEGs in this job",
                }
            make_folder_parallel(jpegs, n, classes=16 if tiny else 100, start=have)
        part = self.record["parts"].get("dali", {})
        part.update(jpegs=str(jpegs), jpegs_s=round(time.monotonic() - t0, 1))
        loader_out = self.path("loader")
        if "loader" not in part or self.args.fresh:
            small = ["--batch", "4", "--batches-per-epoch", "2", "--threads", "1", "--epochs", "1"]
            cmd = self.python(
                "bench/loader.py",
                *("--root", str(jpegs), "--devices", "cuda" if self.cuda else "cpu"),
                *(small if tiny else ["--batches-per-epoch", "25", "100"]),
                # the folder, and the same files as WebDataset / RecordIO shards (data.format)
                *("--loaders", "plain", "dali", "dali@wds", "dali@recordio"),
                *("--out", str(loader_out)),
            )
            part["loader"] = self.bounded(cmd, budget, "loader.log")
            self.record["parts"]["dali"] = part
            self.save()
        fed_out = self.path("throughput_dali")
        if budget.fits(10 if tiny else 120):
            cmd = self.python(
                "bench/throughput.py",
                *("--loaders", "synthetic", "dali", "--dali-root", str(jpegs)),
                *("--precisions", "bf16" if self.cuda else "fp32"),
                *("--channels-last", "on", "--compile", "off"),
                *self._tiny_throughput(),
                *([] if self.args.fresh else ["--resume"]),
                *("--budget-s", str(max(budget.left() - GRACE_S, 1)), "--out", str(fed_out)),
            )
            part["fed"] = self._bench_file(cmd, budget, fed_out, "throughput_dali")
        part.pop("not_run", None)
        part.pop("waiting", None)
        part["files"] = [self.rel(p) for p in (loader_out, fed_out) if p.is_file()]
        part["complete"] = (
            "loader" in part
            and not part["loader"]["stopped_at_budget"]
            and part.get("fed", {}).get("complete", False)
        )
        part["failed"] = [
            k for k in ("loader", "fed") if part.get(k, {}).get("exit") not in (0, None)
        ]
        return part

    def tests(self, budget: Budget) -> dict:
        """The tests whose path differs on a GPU (``-m gpu``: CUDA, NCCL, cuDNN, DALI ``mixed``) on
        pytest-xdist workers, continued test by test across jobs; the rest of the suite is CI's,
        on the CPU. DALI's tests skipped before its parts arrived run again once it has."""
        part = self.record["parts"].get("tests", {})
        tests_dir = self.state / "tests"
        tests_dir.mkdir(parents=True, exist_ok=True)
        dali_here = dali_installed()
        progress = tests_dir / "gpu.jsonl"
        targets = self.args.test_files or ["tests"]
        item = part.setdefault("gpu", {"cut": {}, "given_up": [], "runs": 0})
        if self.args.fresh and not item.get("fresh_done"):
            progress.unlink(missing_ok=True)
            item.update(cut={}, given_up=[], runs=0, fresh_done=True)
        finished, _ = progress_outcomes([progress])
        last_sha = item.get("last", {}).get("git_sha")
        if last_sha and last_sha != self.env["git_sha"]:
            # new code: the tests that failed, or were given up, at the last commit run again
            again = [t for t, o in finished.items() if o["outcome"] in ("failed", "error")]
            again += [t for t in item["given_up"] if t not in again]
            if again:
                print(
                    f"[gpu] tests: new code since {last_sha[:7]}: {len(again)} tests "
                    "that failed or were given up run again",
                    flush=True,
                )
                _drop_tests(progress, again)
                item.update(cut={}, given_up=[])
                finished, _ = progress_outcomes([progress])
        if dali_here and not item.get("ran_with_dali") and item["runs"]:
            # DALI arrived after these ran: its skipped tests run once more
            rerun = [
                t
                for t, o in finished.items()
                if o["outcome"] == "skipped" and DALI_SKIP.search(o["message"])
            ]
            if rerun:
                print(f"[gpu] tests: DALI is here now: {len(rerun)} DALI tests again", flush=True)
                _drop_tests(progress, rerun)
                finished, _ = progress_outcomes([progress])
            item["ran_with_dali"] = True
        skip = sorted(set(finished) | set(item["given_up"]))
        out = self.path("suite_gpu")
        if not budget.fits(10 if self.args.tiny else 30):
            part["not_run"] = f"did not fit the budget ({budget.left():.0f} s left)"
        elif not item["runs"] or self._left_to_run(targets, skip):
            workers = min(GPU_TEST_WORKERS, max(1, (os.cpu_count() or 2) // 2))
            # pytest-xdist travels with the small wheels; without it, one process
            xdist = ("-n", str(workers), "--dist", "loadgroup")
            xdist = xdist if importlib.util.find_spec("xdist") else ()
            cmd = self.python(
                "-m",
                "pytest",
                *targets,
                *("-m", "gpu", "-q", "-p", "no:cacheprovider", "-p", "tools.pytest_progress"),
                *xdist,
                "--continue-on-collection-errors",  # a file that cannot import is counted, not a stop
                *[a for t in skip for a in ("--deselect", t)],
            )
            env = {"DSTRAIN_PYTEST_PROGRESS": str(progress), "PYTHONPATH": str(REPO)}
            row = self.bounded(cmd, budget, "tests/gpu.log", env=env)
            item["runs"] += 1
            item["ran_with_dali"] = item.get("ran_with_dali") or dali_here
            item["last"] = {**row, "git_sha": self.env["git_sha"]}
            _, running = progress_outcomes([progress])
            if row["stopped_at_budget"]:
                # a test the part's whole budget stopped runs once more, then is given up; one the
                # job's end stopped early (the part had less than its budget) just runs again: the
                # H100 pass at 7332174 gave up two long tests cut at 50 s and 104 s
                whole = budget.seconds >= self.args.budgets["tests"] - 1
                for test in running:
                    if not whole:
                        print(
                            f"[gpu] tests: {test} stopped by the job's end: runs again", flush=True
                        )
                        continue
                    item["cut"][test] = item["cut"].get(test, 0) + 1
                    if item["cut"][test] >= 2:
                        item["given_up"].append(test)
                        print(f"[gpu] tests: {test} was cut twice: given up", flush=True)
                part["not_run"] = "stopped at the budget; the next job continues"
            else:
                part.pop("not_run", None)
            self._summarise(progress, item, out, targets)
        else:
            part.pop("not_run", None)
        part["gpu"] = item
        skipped_for_dali = [
            test
            for test, o in progress_outcomes([progress])[0].items()
            if o["outcome"] == "skipped" and DALI_SKIP.search(o["message"])
        ]
        # tests skipped for want of DALI run again once its parts have all arrived
        part["dali_pending"] = bool(skipped_for_dali) and not dali_here
        part["files"] = [self.rel(out)] if out.is_file() else []
        part["complete"] = "not_run" not in part and item["runs"] > 0
        summary = read_json(out) or {}
        part["failed"] = list(summary.get("failed", []))
        return part

    def _left_to_run(self, targets: list[str], skip: list[str]) -> bool:
        """Whether pytest would still collect a test of ``targets`` outside ``skip``."""
        cmd = self.python(
            "-m", "pytest", *targets, "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"
        )
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        collected = [line for line in proc.stdout.splitlines() if "::" in line]
        return bool(set(collected) - set(skip))

    def _summarise(self, progress: Path, item: dict, out: Path, targets: list[str]) -> None:
        from dstrain.core.provenance import record as provenance_record

        summary = {
            **provenance_record(
                f"./run.sh gpu tests (pytest -m gpu {' '.join(targets[:3])}"
                f"{' ...' if len(targets) > 3 else ''})"
            ),
            "environment": self.env,
            "ran": f"python -m pytest -m gpu -n N -p tools.pytest_progress, in {item['runs']} "
            "job(s), continued test by test (tools/gpu_run.py)",
            **summarise_progress([progress], item["given_up"]),
        }
        write_json(out, summary)
        print(f"[gpu] tests: {headline(summary)} -> {out.name}", flush=True)


def _drop_tests(progress: Path, tests: list[str]) -> None:
    """Remove ``tests``' lines from a progress file, so that the next pytest run runs them again."""
    keep = [
        line
        for line in progress.read_text().splitlines()
        if not any(f'"nodeid": {json.dumps(t)}' in line for t in tests)
    ]
    progress.write_text("".join(line + "\n" for line in keep))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument(
        "--deadline",
        type=float,
        default=float(os.environ.get("DSTRAIN_GPU_DEADLINE_S") or DEADLINE_S),
        help=f"seconds after the job's start ($DSTRAIN_GPU_JOB_START) by which it ends (default "
        f"{DEADLINE_S}, or $DSTRAIN_GPU_DEADLINE_S)",
    )
    p.add_argument("--state", default=str(REPO / "runs/gpu"), help="the state folder (runs/gpu)")
    p.add_argument(
        "--work", help="heavy files: JPEGs, run folders (default $DSTRAIN_GPU_HOME/work)"
    )
    p.add_argument("--slug", help="result files' suffix (default: from the GPU's name, e.g. h100)")
    p.add_argument("--jpegs", help="dali: an ImageNet-like JPEG folder to use (and complete)")
    p.add_argument("--test-files", nargs="+", help="tests: these files instead of tests/")
    p.add_argument(
        "--fresh", action="store_true", help="rerun what an earlier job finished or failed"
    )
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
    args.budgets = dict(BUDGET_S)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not re.fullmatch(r"\d+(\.\d+)?", seconds):
            p.error(f"--budget {item}: expected PART=SECONDS with PART one of {', '.join(PARTS)}")
        args.budgets[name] = float(seconds)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_packages()
    if missing:
        print(
            f"[gpu] missing Python packages: {', '.join(missing)}. Without network: run "
            "./run.sh gpu-prepare where there is one and bring .gpu/wheels with the job; "
            "./run.sh gpu installs them with pip --no-index (docs/gpu.md)",
            file=sys.stderr,
        )
        return 2
    env = environment()
    if args.status:
        state = Path(args.state)
        slug = args.slug or gpu_slug(env["device"] if env["gpus"] else None)
        record = read_json(state / f"gpu_run_{slug}.json") or {"parts": {}}
        print(f"[gpu] {state}/gpu_run_{slug}.json, job {record.get('jobs', 0)}")
        print(parts_status(record), end="")
        return 0
    run = Run(args, env)
    signal.signal(signal.SIGTERM, on_sigterm)
    print(
        f"[gpu] job {run.record['jobs']}: {env['device']}, torch {env['torch']} (CUDA "
        f"{env['cuda_runtime']}), DeepSpeed {env['deepspeed']}, DALI {env['dali']}, git "
        f"{env['git_sha']}; {run.left():.0f} s to spend -> {run.state}",
        flush=True,
    )
    if not run.cuda and not args.tiny:
        print(
            "[gpu] no CUDA device here: the parts run on the CPU, which measures nothing a GPU "
            "question needs (use --tiny to test the orchestration)",
            flush=True,
        )
    code = 0
    try:
        for name in args.parts or PARTS:
            code = max(code, run_part(run, name))
    except Stopped as stop:
        print(
            f"[gpu] stopped by {stop}: the running command was stopped, the state saved", flush=True
        )
        run.save()
        return 143
    run.save()
    print(run.status(), end="", flush=True)
    return code


def run_part(run: Run, name: str) -> int:
    """One part, its record saved before the next starts; 0 complete, 1 not (yet)."""
    args = run.args
    previous = run.record["parts"].get(name, {})
    dali_arrived = previous.get("dali_pending") and dali_installed()
    if previous.get("complete") and not args.fresh and not dali_arrived:
        print(
            f"[gpu] {name}: complete in an earlier job ({run.record_path.name}); --fresh redoes it"
        )
        return 0
    if name in run.imported and not previous:
        print(
            f"[gpu] {name}: imported complete for this GPU in an earlier slot "
            f"(results/bench/{gpu_pack.REGISTRY.name}); --fresh redoes it"
        )
        return 0
    budget = run.budget(args.budgets[name])
    if budget.seconds < 5:
        previous["not_run"] = "no time left in this job: the next job continues"
        run.record["parts"][name] = previous
        print(f"[gpu] {name}: no time left in this job", flush=True)
        return 1
    print(f"[gpu] {name}: {budget.seconds:.0f} s", flush=True)
    t0 = time.monotonic()
    try:
        part = getattr(run, name)(budget)
    except Stopped:
        run.record["parts"][name] = {**previous, "complete": False, "not_run": "stopped by SIGTERM"}
        raise
    except Exception as err:  # one part's crash must not cost the others their time
        part = {**previous, "complete": False, "error": f"{type(err).__name__}: {err}"}
    part["seconds"] = round(previous.get("seconds", 0) + time.monotonic() - t0, 1)
    part["git_sha"] = run.env["git_sha"]
    run.record["parts"][name] = part
    run.save()
    state = "complete" if part.get("complete") else "incomplete (the next job continues)"
    print(f"[gpu] {name}: {state} in {time.monotonic() - t0:.0f} s", flush=True)
    return 0 if part.get("complete") else 1


if __name__ == "__main__":
    sys.exit(main())
