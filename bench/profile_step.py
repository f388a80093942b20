"""Where a dstrain training step spends its time next to its bare PyTorch twin: torch.profiler.

    .venv/bin/python bench/profile_step.py --compile off --out $OUT/profile_step_h100_eager.json \\
        --trace $OUT/traces          # a GPU node: ResNet-50, batch 256, 224 px, bf16, channels_last
    .venv/bin/python bench/profile_step.py --model resnet18 --batch 8 --image-size 32 --steps 3 \\
        --warmup 1 --precision fp32 --compile off --out /tmp/profile.json    # CPU smoke (seconds)

Two loops, one after the other in this process, on the same device, model, batch, image size,
precision, layout and torch.compile setting:
  bare     bench/throughput.py's bare_loop: a torchvision model, torch.autocast (fp16 with a
           GradScaler, bf16; none for fp32), torch.optim.SGD (momentum 0.9), one fixed device batch
  dstrain  the real Trainer, built in this process as ``python -m dstrain --config
           imagenet_resnet50 data.loader=synthetic`` builds it (dstrain.run.plan.prepare,
           dstrain.run.startup.check, dstrain.run.train.build_trainer) with ds_configs/<precision>.json,
           driven through its own step path: set_lr, train_micro_batch, after_step, and the log
           window (the progress line, the loss read, the loss-scale read) every --log-every steps
Each loop runs --warmup steps unprofiled (compilation, cuDNN autotuning), one step under the
profiler's own warm-up (discarded: CUPTI starts there), then --steps profiled steps, each inside a
``record_function`` label. Labels also wrap the parts of a step (LABELS below: the twin's forward,
backward and optimizer; DeepSpeed's forward, backward, hooks and step; dstrain's metrics, checks,
log window, progress line and loss-scale read) and ``torch.Tensor.backward`` in both loops, so a
part's host time, kernels and host synchronisations are read per step from the trace.

The summary (--out, ~30 KB) holds per loop: host ms per step (median), device kernel time and
kernels per step, host synchronisations per step (CUDA: the synchronize calls of SYNC_CALLS and
synchronous cudaMemcpy; CPU: aten::_local_scalar_dense, which is what a tensor read on the host
becomes), where each one happened, the labelled parts, the top operators by self CPU and self
device time; and dstrain minus bare for each, with the operators whose calls per step differ.
--trace DIR writes each loop's Chrome trace, gzipped and cut to --trace-steps steps around the
first log window (the summary reads all --steps).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gc
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.throughput import PRECISIONS, environment, twin_overrides  # noqa: E402
from bench.throughput import bare_twin as throughput_twin  # noqa: E402

# the labels a step is cut into: record_function names, each with what it holds. A label's time is
# inclusive (nested labels are inside their parent's time); ``Optimizer.step#`` and
# ``Optimizer.zero_grad#`` are torch's own labels (any optimizer class), summed under one name.
LABELS = {
    "bare.step": "one step of the bare twin",
    "bare.forward": "the twin's model(x) under autocast",
    "bare.loss": "the twin's cross-entropy",
    "bare.zero_grad": "the twin's optimizer.zero_grad(set_to_none=True)",
    "bare.backward": "the twin's scaler.scale(loss).backward()",
    "bare.optimizer": "the twin's scaler.step(optimizer) and scaler.update()",
    "dstrain.step": "one step of dstrain's Trainer (set_lr .. log window)",
    "dstrain.set_lr": "Trainer.set_lr: the LR schedule applied to the param groups",
    "dstrain.train_micro_batch": "Trainer.train_micro_batch: forward, loss, backward, step, meter",
    "dstrain.nonfinite_watch": "NonFiniteWatch.observe: the on-device NaN/inf flag",
    "dstrain.metrics": "StepMeter.add_micro_batch: on-device loss and top-1/top-5 sums",
    "dstrain.after_step": "Trainer.after_step: the FP16 skip counter and the stop-signal check",
    "dstrain.skip_counter": "SkipCounter.update",
    "dstrain.log_window": "Trainer.log_window, every --log-every steps",
    "dstrain.check_finite": "StepChecks.check_finite: the NaN/inf flag read (log window)",
    "dstrain.take_window": "StepMeter.take_window: the window's loss read (log window)",
    "dstrain.loss_scale_read": "loss_scale_of(engine): the loss scale, read on the host",
    "dstrain.progress_line": "Monitor.step: formatting and writing the progress line",
    "deepspeed.forward": "DeepSpeedEngine.forward: autocast, the model, the output hooks",
    "deepspeed.backward": "DeepSpeedEngine.backward: loss scaling, autograd, the epilogue",
    "deepspeed.backward_prologue": "DeepSpeed's once-per-backward hook (_backward_prologue)",
    "deepspeed.backward_hook_per_tensor": "DeepSpeed's per-output-tensor gradient hook",
    "deepspeed.backward_epilogue": "DeepSpeedEngine._backward_epilogue (timers, all-reduce)",
    "deepspeed.step": "DeepSpeedEngine.step: boundary, _take_model_step, timers, counters",
    "deepspeed.take_model_step": "DeepSpeedEngine._take_model_step: scaler/optimizer, zero_grad",
    "autograd.backward": "torch.Tensor.backward, in both loops",
    "torch.optimizer.step": "Optimizer.step#<class>.step: torch's label of the optimizer's step",
    "torch.optimizer.zero_grad": "Optimizer.zero_grad#<class>.zero_grad",
}
TORCH_LABELS = {
    "Optimizer.step#": "torch.optimizer.step",
    "Optimizer.zero_grad#": "torch.optimizer.zero_grad",
}
# dstrain minus bare, group by group: what the twin does in one label, dstrain in the other
COMPARED = {
    "step": ("bare.step", "dstrain.step"),
    "forward": ("bare.forward", "deepspeed.forward"),
    "backward": ("bare.backward", "deepspeed.backward"),
    "autograd backward": ("autograd.backward", "autograd.backward"),
    "optimizer step (torch)": ("torch.optimizer.step", "torch.optimizer.step"),
    "optimizer incl. scaler and zero_grad": ("bare.optimizer+bare.zero_grad", "deepspeed.step"),
}
# host calls that wait for the device (runtime and driver API); a synchronous cudaMemcpy waits too.
# A .item() is one cudaMemcpyAsync device-to-host and one cudaStreamSynchronize (counted once)
SYNC_CALLS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuEventSynchronize",
)
LAUNCHED = ("kernel", "gpu_memcpy", "gpu_memset")  # device work a host call started
DEVICE_CATS = (*LAUNCHED, "gpu_user_annotation")  # and a label's span on the device
HOST_READ = "aten::_local_scalar_dense"  # .item(), bool(t), float(t)... of a tensor
CHOICES = {"fp32", "fp16", "bf16"}


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line and exit status 2, for argparse's checks and ours."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args() -> argparse.Namespace:
    p = Parser(prog="bench/profile_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="torchvision model name")
    p.add_argument("--batch", type=int, default=256, help="images per step")
    p.add_argument("--image-size", type=int, default=224, help="pixels")
    p.add_argument("--precision", default="bf16", help="fp32, fp16 (autocast + GradScaler) or bf16")
    p.add_argument("--channels-last", default="on", choices=("on", "off"))
    p.add_argument(
        "--compile", default="off", choices=("on", "off"), help="torch.compile both loops"
    )
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    p.add_argument("--steps", type=int, default=20, help="profiled steps per loop")
    p.add_argument("--warmup", type=int, default=5, help="unprofiled steps first (compilation)")
    p.add_argument(
        "--log-every", type=int, default=10, help="dstrain's log window (log.every_steps)"
    )
    p.add_argument("--out", default="", help="default results/bench/profile_step_<device>.json")
    p.add_argument(
        "--trace", default="", metavar="DIR", help="write the Chrome traces here, gzipped"
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=4,
        help="profiled steps a --trace file keeps, ending with the first log-window step (the "
        "summary reads all --steps; a step of eager ResNet-50 is some 0.05-0.1 MiB gzipped)",
    )
    args = p.parse_args()
    if args.precision == "fp16_native":
        p.error(
            "--precision fp16_native: DeepSpeed's native fp16 engine has no bare twin here (the "
            "twin is an autocast loop); profile fp16 (autocast + GradScaler), bf16 or fp32"
        )
    if args.precision not in CHOICES:
        p.error(f"--precision {args.precision}: choose fp32, fp16 or bf16")
    for name in ("batch", "image_size", "steps", "log_every", "trace_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    if args.compile == "on" and args.compile_mode == "reduce-overhead":
        p.error("--compile-mode reduce-overhead: CUDA graphs hide the kernels from the trace")
    import torchvision

    if args.model not in torchvision.models.list_models(module=torchvision.models):
        p.error(f"--model {args.model}: not a torchvision classification model")
    if args.trace and Path(args.trace).is_file():
        p.error(f"--trace {args.trace}: a file; give a directory")
    return args


# ---------------------------------------------------------------- the two loops
def bare_twin(args, device):
    """bench/throughput.py's bare loop (its set-up, bare_twin there), one step per call, with labels."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import record_function

    compile_mode = args.compile_mode if args.compile == "on" else None
    twin = throughput_twin(
        args.model,
        PRECISIONS[args.precision][2],
        args.channels_last == "on",
        args.batch,
        args.image_size,
        device,
        compile_mode,
    )
    model, opt, scaler, dtype, x, y = twin.model, twin.opt, twin.scaler, twin.dtype, twin.x, twin.y

    def step(index: int) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            with record_function("bare.forward"):
                logits = model(x)
            with record_function("bare.loss"):
                loss = F.cross_entropy(logits, y)
        with record_function("bare.zero_grad"):
            opt.zero_grad(set_to_none=True)
        with record_function("bare.backward"):
            scaler.scale(loss).backward()
        with record_function("bare.optimizer"):
            scaler.step(opt)
            scaler.update()

    return step, contextlib.nullcontext()


def dstrain_overrides(args, run_dir: Path, total_steps: int) -> list[str]:
    """bench/throughput.py's dstrain row (imagenet_resnet50, synthetic data), one epoch of
    ``total_steps`` steps, the log window every --log-every steps."""
    return [
        "epochs=1",
        "eval_every_epochs=1",
        *twin_overrides(
            args.model,
            args.channels_last == "on",
            args.compile == "on",
            args.compile_mode,
            args.image_size,
            args.batch,
        ),
        "data.loader=synthetic",
        f"data.synthetic_train_size={args.batch * total_steps}",
        f"data.synthetic_val_size={args.batch}",
        "fault.check_disk=false",
        f"log.every_steps={args.log_every}",
        f"run_dir={run_dir}",
    ]


def dstrain_trainer(args, device, run_dir: Path, total_steps: int):
    """The Trainer ``python -m dstrain`` builds, built here (one step per call), and the labels on
    its parts for the profiled steps."""
    from torch.profiler import record_function

    import dstrain.loop.trainer
    from dstrain.loop import fault
    from dstrain.loop.monitor import Progress, StepMeter
    from dstrain.run import startup, train
    from dstrain.run.plan import prepare
    from dstrain.settings.config import load_config

    cfg = load_config("imagenet_resnet50", dstrain_overrides(args, run_dir, total_steps))
    plan = prepare(cfg, str(REPO / "ds_configs" / PRECISIONS[args.precision][1]))
    start = startup.check(plan, device)  # the run's start-up checks, as it makes them
    trainer = train.build_trainer(plan, start, fault.StopSignals())
    stage, state = trainer.stages[0], trainer.state
    trainer.start_loader(0, stage, 0)
    batches = iter(trainer.data.train)
    meter = StepMeter(trainer.device, cfg.log.every_steps, None)

    def step(index: int) -> None:
        """Trainer.train_epoch's body for step ``index`` (0-based) of the epoch."""
        x, y = next(batches)
        with record_function("dstrain.set_lr"):
            lr = trainer.set_lr((index + 1) / total_steps, stage.global_size)
        with record_function("dstrain.train_micro_batch"):
            trainer.train_micro_batch(x, y, True, meter, 1)
        state.step += 1
        with record_function("dstrain.after_step"):
            trainer.after_step()
        if meter.end_step():
            with record_function("dstrain.log_window"):
                progress = Progress(0, 1, index + 1, total_steps)
                trainer.log_window(meter, progress, lr, stage)

    engine, checks = trainer.engine, trainer.checks
    wrapped = [
        (engine, "forward", "deepspeed.forward"),
        (engine, "backward", "deepspeed.backward"),
        (engine, "_backward_prologue", "deepspeed.backward_prologue"),
        (engine, "_backward_prologue_per_tensor", "deepspeed.backward_hook_per_tensor"),
        (engine, "_backward_epilogue", "deepspeed.backward_epilogue"),
        (engine, "step", "deepspeed.step"),
        (engine, "_take_model_step", "deepspeed.take_model_step"),
        (checks.nonfinite, "observe", "dstrain.nonfinite_watch"),
        (checks.skips, "update", "dstrain.skip_counter"),
        (checks, "check_finite", "dstrain.check_finite"),
        (meter, "add_micro_batch", "dstrain.metrics"),
        (meter, "take_window", "dstrain.take_window"),
        (trainer.monitor, "step", "dstrain.progress_line"),
        (dstrain.loop.trainer, "loss_scale_of", "dstrain.loss_scale_read"),
    ]

    @contextlib.contextmanager
    def labels():
        with contextlib.ExitStack() as stack:
            for owner, name, label in wrapped:
                stack.enter_context(labelled(owner, name, label))
            yield

    return step, labels()  # entered for the profiled steps only


@contextlib.contextmanager
def labelled(owner, name: str, label: str):
    """``owner.name`` (an object's method, a module's function) runs inside
    ``record_function(label)`` for the block, then is as it was."""
    from torch.profiler import record_function

    original, own = getattr(owner, name), name in vars(owner)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # the instance attribute: the class's method shows again


# ---------------------------------------------------------------- profiling
def profile_loop(name: str, step, labels, args, device, trace_path: Path) -> dict:
    """--warmup steps, one under the profiler's warm-up, --steps profiled; the Chrome trace is
    written to ``trace_path``. Returns the timed wall and the profiler's operator table."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for index in range(args.warmup):
        step(index)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    plan = schedule(wait=0, warmup=1, active=args.steps, repeat=1)
    with (
        labels,
        labelled(torch.Tensor, "backward", "autograd.backward"),
        profile(activities=activities, schedule=plan, record_shapes=False) as prof,
    ):
        for i in range(1 + args.steps):
            if i == 1:
                t0 = time.perf_counter()
            with record_function(f"{name}.step"):
                step(args.warmup + i)
            if i == args.steps:
                sync()  # the last kernels end inside the trace
                seconds = time.perf_counter() - t0  # before the profiler stops and collects
            prof.step()
    prof.export_chrome_trace(str(trace_path))
    return {
        "wall_ms_per_step": 1000 * seconds / args.steps,
        "operators": operators(prof, args.steps),
    }


def operators(prof, steps: int) -> dict[str, dict]:
    """Every operator and kernel the profiled steps ran, per step: calls, self CPU ms, self device
    ms (our labels and the profiler's step marks left out)."""
    from torch.autograd import DeviceType

    table = {}
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False) or label_of(e.key) or "ProfilerStep#" in e.key:
            continue
        row = table.setdefault(  # a long kernel name is cut: two may share a row
            e.key[:160],
            {
                "kernel": e.device_type != DeviceType.CPU,  # a kernel, copy or memset
                "calls_per_step": 0.0,
                "self_cpu_ms_per_step": 0.0,
                "self_device_ms_per_step": 0.0,
            },
        )
        row["calls_per_step"] += e.count / steps
        row["self_cpu_ms_per_step"] += e.self_cpu_time_total / 1000 / steps
        row["self_device_ms_per_step"] += e.self_device_time_total / 1000 / steps
    return table


def top_operators(table: dict[str, dict], n: int = 15) -> dict[str, list]:
    """The ``n`` operators with the most self CPU time, and with the most self device time (the
    kernels they launched themselves), and the ``n`` longest kernels; per step."""

    def top(rows, key):
        ranked = sorted(((k, v) for k, v in rows if v[key] > 0), key=lambda kv: -kv[1][key])
        return [
            {"name": k, **{f: v for f, v in row.items() if f != "kernel"}} for k, row in ranked[:n]
        ]

    ops = [(k, v) for k, v in table.items() if not v["kernel"]]
    kernels = [(k, v) for k, v in table.items() if v["kernel"]]
    return {
        "by_self_cpu": top(ops, "self_cpu_ms_per_step"),
        "by_self_device": top(ops, "self_device_ms_per_step"),
        "kernels": top(kernels, "self_device_ms_per_step"),
    }


def call_differences(bare: dict, ours: dict, n: int = 25) -> list[dict]:
    """The operators and kernels whose calls per step differ most between the loops (dstrain minus
    bare): where dstrain's extra launches come from."""
    rows = []
    for name in set(bare) | set(ours):
        mine, twin = ours.get(name), bare.get(name)
        calls = (mine["calls_per_step"] if mine else 0) - (twin["calls_per_step"] if twin else 0)
        if abs(calls) > 1e-9:
            cpu = (mine["self_cpu_ms_per_step"] if mine else 0) - (
                twin["self_cpu_ms_per_step"] if twin else 0
            )
            rows.append({"name": name, "calls_per_step": calls, "self_cpu_ms_per_step": cpu})
    return sorted(rows, key=lambda r: (-abs(r["calls_per_step"]), r["name"]))[:n]


def log_window_steps(args) -> list[int]:
    """The profiled steps (0-based) that end with dstrain's log window: the epoch's step i
    (0-based, warm-up included) logs when (i + 1) % --log-every == 0."""
    first = args.warmup + 1  # the profiler's warm-up step comes before the profiled ones
    return [k for k in range(args.steps) if (first + k + 1) % args.log_every == 0]


def trace_window(args) -> range:
    """The profiled steps a --trace file keeps: --trace-steps of them, ending with the first
    step that has a log window (the first ones when none has)."""
    windows = log_window_steps(args)
    count = min(args.trace_steps, args.steps)
    last = max(windows[0], count - 1) if windows else count - 1
    return range(last - count + 1, last + 1)


# ---------------------------------------------------------------- reading the trace
class Timeline:
    """A Chrome trace's complete events, indexed for per-step and per-label questions.

    A kernel or copy belongs to the host call that launched it (CUPTI's correlation id), and that
    call to the step and the labels whose time it falls in, on any thread: on a GPU, autograd's
    device thread launches the backward while the main thread waits inside ``backward()``."""

    def __init__(self, events: list[dict], step_label: str):
        self.step_label = step_label
        events = sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=start_of)
        self.device = {}  # correlation -> kernel / memcpy / memset
        for e in events:
            if e.get("cat") in LAUNCHED and "correlation" in e.get("args", {}):
                self.device[e["args"]["correlation"]] = e
        self.steps = [
            e for e in events if e.get("cat") == "user_annotation" and e["name"] == step_label
        ]
        self.step_starts = [e["ts"] for e in self.steps]
        self.labels = [
            e for e in events if e.get("cat") == "user_annotation" and label_of(e["name"])
        ]
        # host calls into CUDA (runtime and driver: inductor's kernels go through cuLaunchKernel)
        # and host reads of a tensor, by start
        self.calls = [
            e
            for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver")
            or (e.get("cat") == "cpu_op" and e["name"] == HOST_READ)
        ]
        self.call_starts = [e["ts"] for e in self.calls]
        self.ops = defaultdict(list)  # (pid, tid) -> its operators by start
        for e in events:
            if e.get("cat") == "cpu_op":
                self.ops[(e["pid"], e["tid"])].append(e)

    def step_of(self, e: dict) -> int | None:
        i = bisect.bisect_right(self.step_starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= self.steps[i]["ts"] + self.steps[i]["dur"]:
            return i
        return None

    def inside(self, e: dict) -> list[dict]:
        """The host calls and reads that start within ``e``'s time, on any thread."""
        lo = bisect.bisect_left(self.call_starts, e["ts"])
        hi = bisect.bisect_right(self.call_starts, e["ts"] + e["dur"])
        return self.calls[lo:hi]

    def launched(self, e: dict) -> dict | None:
        """The kernel, copy or memset a host call started, or None."""
        return self.device.get(e.get("args", {}).get("correlation"))

    def kernel_ms(self, e: dict) -> float | None:
        """The duration of the kernel a host call launched; None for any other call."""
        work = self.launched(e)
        return work["dur"] / 1000 if work is not None and work.get("cat") == "kernel" else None

    @staticmethod
    def is_read(e: dict) -> bool:
        return e.get("cat") == "cpu_op"

    def is_sync(self, e: dict) -> bool:
        """A CUDA call that waits for the device: a synchronize, or a synchronous cudaMemcpy."""
        name = e["name"]
        if self.is_read(e):
            return False
        if name.startswith(("cudaMemcpy", "cuMemcpy")):
            return "Async" not in name
        return name.startswith(SYNC_CALLS)

    def is_dtoh(self, e: dict) -> bool:
        copy = self.launched(e)
        return copy is not None and copy.get("cat") == "gpu_memcpy" and "DtoH" in copy["name"]

    def site(self, e: dict) -> str:
        """Where a host call or read happened: our labels around it, outermost first (any
        thread), the innermost operator around it (its thread), and its name."""
        end = e["ts"] + e["dur"]
        labels = [
            label_of(o["name"])
            for o in self.labels
            if o["name"] != self.step_label and o["ts"] <= e["ts"] and end <= o["ts"] + o["dur"]
        ]
        ops = self.ops[(e["pid"], e["tid"])]
        step_start = self.steps[self.step_of(e)]["ts"]
        inner = []
        for o in reversed(ops[: bisect.bisect_right(ops, e["ts"], key=start_of)]):
            if o["ts"] < step_start:
                break
            if o is not e and end <= o["ts"] + o["dur"]:
                inner = [o["name"]]  # the latest-starting operator around it: the innermost
                break
        return " > ".join(labels + inner + [e["name"]])

    def per_step(self) -> list[dict]:
        keys = ("kernels", "kernel_ms", "host_syncs", "dtoh_copies", "host_reads")
        rows = [
            {"host_ms": s["dur"] / 1000, **dict.fromkeys(keys, 0), "log_window": False}
            for s in self.steps
        ]
        spans = [[] for _ in rows]  # (start, end) of each step's kernels
        for i, row in enumerate(rows[:-1]):
            row["period_ms"] = (self.step_starts[i + 1] - self.step_starts[i]) / 1000
        for e in self.calls:
            if (i := self.step_of(e)) is None:
                continue
            if (ms := self.kernel_ms(e)) is not None:
                rows[i]["kernels"] += 1
                rows[i]["kernel_ms"] += ms
                kernel = self.launched(e)
                spans[i].append((kernel["ts"], kernel["ts"] + kernel["dur"]))
            rows[i]["host_syncs"] += self.is_sync(e)
            rows[i]["dtoh_copies"] += self.is_dtoh(e)
            rows[i]["host_reads"] += self.is_read(e)
        for e in self.labels:
            if label_of(e["name"]) == "dstrain.log_window" and (i := self.step_of(e)) is not None:
                rows[i]["log_window"] = True
        for row, kernels in zip(rows, spans):  # first kernel's start to last kernel's end
            if kernels:
                row["device_span_ms"] = (
                    max(e for _, e in kernels) - min(s for s, _ in kernels)
                ) / 1000
        return rows

    def sync_sites(self, cuda: bool) -> dict[str, int]:
        """Each host synchronisation and device-to-host copy (CUDA) or host read (CPU) in the
        profiled steps, by site."""
        wanted = (lambda e: self.is_sync(e) or self.is_dtoh(e)) if cuda else self.is_read
        found = [e for e in self.calls if wanted(e) and self.step_of(e) is not None]
        return dict(Counter(self.site(e) for e in found).most_common())

    def groups(self, steps: int) -> dict[str, dict]:
        """Per label, per step: calls, host ms (inclusive), kernels launched inside it and their
        device ms, host synchronisations (CUDA calls) and host reads inside it."""
        keys = ("calls", "host_ms", "kernels", "kernel_ms", "host_syncs", "host_reads")
        out = defaultdict(lambda: dict.fromkeys(keys, 0))
        for label in self.labels:
            if self.step_of(label) is None:
                continue
            row = out[label_of(label["name"])]
            row["calls"] += 1
            row["host_ms"] += label["dur"] / 1000
            for e in self.inside(label):
                if (ms := self.kernel_ms(e)) is not None:
                    row["kernels"] += 1
                    row["kernel_ms"] += ms
                row["host_syncs"] += self.is_sync(e)
                row["host_reads"] += self.is_read(e)
        return {
            name: {key: value / steps for key, value in row.items()} | {"what": LABELS[name]}
            for name, row in sorted(out.items())
        }


def start_of(e: dict) -> float:
    return e["ts"]


@functools.cache
def label_of(name: str) -> str | None:
    """The LABELS key an annotation's name stands for, or None (not one of ours or torch's)."""
    if name in LABELS:
        return name
    return next((key for prefix, key in TORCH_LABELS.items() if name.startswith(prefix)), None)


def summarise(timeline: Timeline, loop: str, measured: dict, steps: int, cuda: bool) -> dict:
    """One loop's numbers from its trace: per step, per label, sync sites, top operators."""
    rows = timeline.per_step()
    if len(rows) != steps:
        raise SystemExit(f"{loop}: {len(rows)} profiled steps in the trace, expected {steps}")
    quiet = [r for r in rows if not r["log_window"]]
    sync_key = "host_syncs" if cuda else "host_reads"
    per_step = {
        "host_ms": statistics.median(r["host_ms"] for r in rows),
        "period_ms": statistics.median(r["period_ms"] for r in rows[:-1]) if steps > 1 else None,
        "wall_ms": measured["wall_ms_per_step"],
        "kernel_ms": statistics.median(r["kernel_ms"] for r in rows) if cuda else None,
        "device_span_ms": (
            statistics.median(r["device_span_ms"] for r in rows if "device_span_ms" in r)
            if any("device_span_ms" in r for r in rows)
            else None
        ),
        # the device's time per step without a kernel running (one stream): what the host costs
        "device_idle_ms": (
            measured["wall_ms_per_step"] - sum(r["kernel_ms"] for r in rows) / steps
            if cuda
            else None
        ),
        "kernels": sum(r["kernels"] for r in rows) / steps if cuda else None,
        "host_syncs": sum(r[sync_key] for r in rows) / steps,
        "host_syncs_outside_log_window": (
            sum(r[sync_key] for r in quiet) / len(quiet) if quiet else None
        ),
        "dtoh_copies": sum(r["dtoh_copies"] for r in rows) / steps if cuda else None,
        "host_reads": sum(r["host_reads"] for r in rows) / steps,
    }
    groups = timeline.groups(steps)
    return {
        "steps": len(rows),
        "log_windows": sum(r["log_window"] for r in rows),
        "per_step": per_step,
        "steps_detail": rows,
        "groups": groups,
        "bookkeeping": bookkeeping(groups) if loop == "dstrain" else {},
        "sync_sites": timeline.sync_sites(cuda),
        "top_operators": top_operators(measured["operators"]),
    }


def group_ms(groups: dict, names: str, key: str = "host_ms") -> float:
    """A group's per-step value (``a+b``: the sum of two), 0 where the label never ran."""
    return sum(groups.get(name, {}).get(key, 0.0) for name in names.split("+"))


def bookkeeping(groups: dict) -> dict:
    """dstrain's and DeepSpeed's host ms per step outside the model, autograd and the optimizer."""
    return {
        "deepspeed backward outside autograd": group_ms(groups, "deepspeed.backward")
        - group_ms(groups, "autograd.backward"),
        "deepspeed hooks inside autograd": group_ms(
            groups, "deepspeed.backward_prologue+deepspeed.backward_hook_per_tensor"
        ),
        "deepspeed step outside the optimizer": group_ms(groups, "deepspeed.step")
        - group_ms(groups, "torch.optimizer.step"),
        "train_micro_batch outside the engine (input cast, loss, checks, metrics)": group_ms(
            groups, "dstrain.train_micro_batch"
        )
        - group_ms(groups, "deepspeed.forward+deepspeed.backward+deepspeed.step"),
        "set_lr + after_step + log window": group_ms(
            groups, "dstrain.set_lr+dstrain.after_step+dstrain.log_window"
        ),
    }


def differences(bare: dict, ours: dict) -> dict:
    """dstrain minus bare, per step: each per_step number and each COMPARED group pair."""
    per_step = {
        key: ours["per_step"][key] - value
        for key, value in bare["per_step"].items()
        if value is not None and ours["per_step"].get(key) is not None
    }
    groups = {}
    for what, (twin, mine) in COMPARED.items():
        groups[what] = {
            key: group_ms(ours["groups"], mine, key) - group_ms(bare["groups"], twin, key)
            for key in ("host_ms", "kernels", "kernel_ms", "host_syncs", "host_reads")
        }
    return {"per_step": per_step, "groups": groups}


def write_trace(doc: dict, timeline: Timeline, keep: range, path: Path) -> None:
    """``doc`` (a Chrome trace) cut to the profiled steps ``keep`` and packed small, gzipped: times
    from the window's start in 0.1 us, arguments only where a viewer or a reader needs them
    (correlation, stream, device), the launch-to-kernel arrows kept, the rest dropped."""
    lo = timeline.steps[keep[0]]["ts"]
    hi = timeline.steps[keep[-1]]["ts"] + timeline.steps[keep[-1]]["dur"]
    host, device, arrows = [], [], []
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            device.append(e)
        elif e.get("ph") == "X" and e.get("cat") != "Trace" and lo <= e["ts"] < hi:
            host.append(e)
        elif e.get("ph") in ("s", "f") and e.get("cat") == "ac2g":
            arrows.append(e)
    launched = {e["args"]["correlation"] for e in host if "correlation" in e.get("args", {})}
    linked = [
        e
        for e in device
        if e["cat"] in LAUNCHED and e.get("args", {}).get("correlation") in launched
    ]
    end = max((e["ts"] + e["dur"] for e in linked), default=hi)
    marks = [  # the device-side spans of the window's labels
        e for e in device if e["cat"] == "gpu_user_annotation" and lo <= e["ts"] <= end
    ]
    arrows = [e for e in arrows if e.get("id") in launched]
    meta = [{**e, "ts": 0} for e in doc["traceEvents"] if e.get("ph") == "M"]

    def packed(e: dict) -> dict:
        kept = {
            k: v for k, v in e.get("args", {}).items() if k in ("correlation", "stream", "device")
        }
        out = {k: v for k, v in e.items() if k != "args"} | {"ts": round(e["ts"] - lo, 1)}
        if "dur" in e:
            out["dur"] = round(e["dur"], 1)
        return out | ({"args": kept} if kept else {})

    events = meta + [packed(e) for e in host + linked + marks + arrows]
    small = {k: v for k, v in doc.items() if k != "traceEvents"} | {"traceEvents": events}
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb", compresslevel=9) as fh:
        fh.write(json.dumps(small, separators=(",", ":")).encode())


# ---------------------------------------------------------------- the run
def main() -> int:
    args = parse_args()
    import torch

    from dstrain.core import dist
    from dstrain.core.logs import setup_logging
    from dstrain.settings.config import FaultConfig

    setup_logging()  # the progress line is written, as in a run
    dist.setup_env_for_single_process()
    device = dist.device()
    # as a run joins its job, before either loop: both run with the same CPU threads
    dist.init_process_group(FaultConfig().collective_timeout_s)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    result = header(args, environment(device))
    slug = re.sub(r"[^a-z0-9]+", "_", result["environment"]["device"].lower()).strip("_")
    out = Path(args.out or REPO / f"results/bench/profile_step_{slug}.json")
    print(
        f"{result['environment']['device']}: {args.model}, batch {args.batch}, "
        f"{args.image_size} px, {settings_name(args)}",
        flush=True,
    )
    tables = {}
    with tempfile.TemporaryDirectory(prefix="dstrain-profile-") as tmp:
        for loop in ("bare", "dstrain"):
            result["loops"][loop], tables[loop] = run_loop(loop, args, device, Path(tmp))
            torch._dynamo.reset()  # the second loop compiles as a fresh process would
            gc.collect()  # the first loop's model and optimizer state, before the second's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.shutdown()
    bare, ours = result["loops"]["bare"], result["loops"]["dstrain"]
    result["dstrain_minus_bare"] = differences(bare, ours) | {
        "operator_calls": call_differences(tables["bare"], tables["dstrain"])
    }
    from bench.common import write_result

    title = (
        f"Where a step's time goes, dstrain vs its bare twin: {args.model}, batch {args.batch}, "
        f"{args.image_size} px, {settings_name(args)}, {result['environment']['device']}"
    )
    write_result(out, result, title=title, headline=headline(result))
    print(report(result))
    print(f"-> {out}")
    return 0


def headline(result: dict) -> str:
    """Wall time per step of both loops and the host synchronisations dstrain adds."""
    bare, ours = result["loops"]["bare"]["per_step"], result["loops"]["dstrain"]["per_step"]
    return (
        f"dstrain {ours['wall_ms']:.1f} ms a step vs the bare twin's {bare['wall_ms']:.1f} ms; "
        f"{ours['host_syncs_outside_log_window']:g} host syncs a step outside the log window"
    )


def settings_name(args) -> str:
    """``bf16_nhwc_compile_on``: a trace file's name part."""
    layout = "nhwc" if args.channels_last == "on" else "nchw"
    return f"{args.precision}_{layout}_compile_{args.compile}"


def header(args, env: dict) -> dict:
    from bench.common import provenance

    return {
        "what": "torch.profiler of training steps: dstrain's Trainer vs its bare PyTorch twin",
        **provenance("profile_step.py"),  # command, git SHA, date, versions
        "environment": env,
        "settings": {
            "model": args.model,
            "batch": args.batch,
            "image_size": args.image_size,
            "precision": args.precision,
            "channels_last": args.channels_last == "on",
            "compile": args.compile == "on",
            "compile_mode": args.compile_mode,
            "warmup_steps": args.warmup,
            "profiled_steps": args.steps,
            "log_every": args.log_every,
            "log_window_steps": log_window_steps(args),
        },
        "labels": LABELS,
        "notes": [
            "host_ms (a step's own host time), period_ms (start to next start), kernel_ms: medians "
            "over the profiled steps; counts: means per step",
            "host_syncs: CUDA, the host calls that wait for the device ("
            + ", ".join(SYNC_CALLS)
            + ", cudaMemcpy*/cuMemcpy* but not *Async); CPU, aten::_local_scalar_dense (a tensor "
            "read on the host); host_reads: aten::_local_scalar_dense on both",
            "wall_ms: the profiled steps' wall time / steps, the device drained at the end "
            "(profiler overhead included, in both loops)",
            "both loops' SGD: nesterov momentum 0.9, weight decay 5e-5 (the shipped JSONs'); "
            "dstrain's has two groups (BN/bias without weight decay), the twin's one",
        ],
        "loops": {},
    }


def run_loop(loop: str, args, device, tmp: Path) -> tuple[dict, dict]:
    """Build, warm up and profile one loop; its summary, and its full operator table."""
    t0 = time.perf_counter()
    total_steps = args.warmup + 1 + args.steps
    if loop == "bare":
        step, labels = bare_twin(args, device)
    else:
        step, labels = dstrain_trainer(args, device, tmp / "run", total_steps)
    trace = tmp / f"{loop}.json"
    measured = profile_loop(loop, step, labels, args, device, trace)
    del step, labels  # the model, its optimizer state and batch: the next loop needs the memory
    doc = json.loads(trace.read_text())
    timeline = Timeline(doc["traceEvents"], f"{loop}.step")
    summary = summarise(timeline, loop, measured, args.steps, device.type == "cuda")
    if args.trace:
        keep = trace_window(args)
        path = Path(args.trace) / f"profile_step_{loop}_{settings_name(args)}.json.gz"
        write_trace(doc, timeline, keep, path)
        size = path.stat().st_size
        summary["trace"] = {"path": str(path), "bytes": size, "steps": [keep[0], keep[-1]]}
        print(
            f"trace {path}: profiled steps {keep[0]}-{keep[-1]}, {size / 2**20:.2f} MiB "
            f"(the whole profile unpacked: {trace.stat().st_size / 2**20:.1f} MiB)",
            flush=True,
        )
    summary["seconds"] = time.perf_counter() - t0
    return summary, measured["operators"]


def report(result: dict) -> str:
    """A few lines for the console: per-step numbers of both loops and their difference."""
    loops, diff = result["loops"], result["dstrain_minus_bare"]["per_step"]
    lines = []
    keys = ("host_ms", "period_ms", "wall_ms", "kernel_ms", "device_span_ms", "device_idle_ms")
    for key in keys + ("kernels", "host_syncs", "host_reads", "dtoh_copies"):
        bare, ours = loops["bare"]["per_step"][key], loops["dstrain"]["per_step"][key]
        if bare is None or ours is None:
            continue
        lines.append(f"{key:15s} bare {bare:9.2f}  dstrain {ours:9.2f}  diff {diff[key]:+9.2f}")
    lines.append("dstrain host syncs by site: " + json.dumps(loops["dstrain"]["sync_sites"]))
    lines.append("bare host syncs by site: " + json.dumps(loops["bare"]["sync_sites"]))
    lines += [f"{k}: {v:.3f} ms/step" for k, v in loops["dstrain"]["bookkeeping"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
