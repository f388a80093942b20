"""The trainer's per-step overhead against a bare DeepSpeed loop: same model, data, batch, engine.

    .venv/bin/python bench/overhead.py          # 1 rank -> results/bench/overhead_cpu_1rank.json
    .venv/bin/python bench/overhead.py --threads 1 --out results/bench/overhead_cpu_1rank_1thread.json
    .venv/bin/deepspeed --num_gpus 2 bench/overhead.py   # -> results/bench/overhead_cpu_2rank.json
    .venv/bin/python bench/overhead.py --steps 2 --pairs 2 --batch 32 --out /tmp/o.json \\
        model.width=4 data.root=DIR            # tiny (the test suite's run)
    .venv/bin/python bench/overhead.py --config imagenet_resnet50 --deepspeed_config \\
        ds_configs/bf16.json --batch 256 data.loader=synthetic batch.micro_per_rank=128
                                               # a GPU: ResNet-50, two micro batches a step

One engine (resnet_small, Fashion-MNIST from memory, global batch 256, ds_configs/fp32.json) runs
alternating passes of ``--steps`` optimizer steps: a bare loop (forward, cross-entropy,
``engine.backward``, ``engine.step``) and dstrain's ``Trainer.train_epoch``, the trainer built by the same
set-up phases as ``python -m dstrain`` (LR schedule set every step,
accumulation boundary, NaN tracking, FP16 skip counter, stop-signal agreement over ranks, metric
sums, a console/TensorBoard line every 10 steps). Each pass is timed; the ratio of the medians is the
trainer's overhead. Alternating passes in one process cancel most of the drift of a shared machine.
Where the run measures the gradient noise scale (``log.noise_scale``: several ranks, or
accumulation), a third pass trains without it: ``noise_ratio`` is its cost, the trainer's median
over that pass's.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def command(world: int) -> str:
    """This run's command line, as a user types it (the launcher's ``--local_rank`` left out)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    launcher = f"deepspeed --num_gpus {world}" if world > 1 else "python"
    return shlex.join([*launcher.split(), "bench/overhead.py", *args])


def title(world: int, threads: int | None) -> str:
    """``Trainer overhead, 2 ranks``; ``, 1 thread`` where --threads chose the torch threads."""
    ranks = f"{world} rank" + ("s" if world > 1 else "")
    return f"Trainer overhead, {ranks}" + (
        f", {threads} thread" + ("s" if threads > 1 else "") if threads else ""
    )


def headline(result: dict) -> str:
    """One line of what a result measured: the ratio, and the bare step it is over."""
    line = (
        f"trainer step {result['overhead_ratio']:.3f}x a bare DeepSpeed step "
        f"(bare {result['median_step_ms']['bare']:.1f} ms)"
    )
    if result.get("noise_ratio") is not None:
        line += f"; measuring the gradient noise scale {result['noise_ratio']:.3f}x without"
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per timed pass")
    p.add_argument(
        "--pairs", type=int, default=7, help="bare/trainer pass pairs (the first is warm-up)"
    )
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: dstrain's)"
    )
    p.add_argument(
        "--out", default="", help="result file (default results/bench/overhead_cpu_<N>rank.json)"
    )
    p.add_argument(
        "--config",
        default="fashion_mnist",
        help="the recipe (on a GPU node: imagenet_resnet50 with data.loader=synthetic)",
    )
    p.add_argument("--deepspeed_config", default="ds_configs/fp32.json", help="the DeepSpeed JSON")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="more trainer overrides (key=value)")
    args = p.parse_args()
    if args.pairs < 2:
        p.error("--pairs must be at least 2 (the first pair is warm-up)")

    import shutil
    import tempfile

    import torch

    from bench.common import provenance, write_result
    from dstrain.core import dist
    from dstrain.loop import fault
    from dstrain.run import rundir, startup, train
    from dstrain.run.plan import prepare
    from dstrain.settings.config import load_config

    # the trainer as `python -m dstrain` builds it (dstrain/run/train.py's run: prepare, join the
    # job, the start-up checks, build_trainer), in this process; rank 0's directory is the run's
    tmp = Path(tempfile.mkdtemp(prefix="dstrain-overhead."))
    cfg = load_config(
        args.config,
        [
            f"batch.global_size={args.batch}",
            "epochs=1",
            "optim.warmup_epochs=0",
            f"data.limit_train={args.batch * args.steps}",
            f"data.synthetic_train_size={args.batch * args.steps}",  # data.loader=synthetic
            "log.tensorboard=false",
            "checkpoint.every_epochs=0",
            "fault.check_disk=false",
            f"run_dir={tmp / 'run'}",
            *args.overrides,
        ],
    )
    plan = prepare(cfg, str(REPO / args.deepspeed_config))
    dist.init_process_group(cfg.fault.collective_timeout_s)
    if args.threads:
        torch.set_num_threads(args.threads)
    world, rank = dist.world_size(), dist.rank()
    where = provenance("", command=command(world))  # the tree that runs, as it starts
    signals = fault.StopSignals()
    signals.install()
    try:
        start = startup.check(plan, dist.device())
        trainer = train.build_trainer(plan, start, signals)
        times = timed_passes(trainer, plan.stages[0], args.pairs)
    finally:
        signals.restore()
        rundir.release_all()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "what": "trainer train_epoch vs a bare DeepSpeed loop, same engine/model/data/batch, alternating passes",
        **where,
        "world_size": world,
        "global_batch": args.batch,
        "steps_per_pass": args.steps,
        "torch_threads": torch.get_num_threads(),
        "recipe": args.config,
        "deepspeed_config": args.deepspeed_config,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "overrides": args.overrides,
        "pass_seconds": times,
        "median_step_ms": {k: 1000 * v / args.steps for k, v in med.items()},
        "images_per_sec": {k: args.batch * args.steps / v for k, v in med.items()},
        "overhead_ratio": med["trainer"] / med["bare"],
        "noise_ratio": med["trainer"] / med["no_noise"] if "no_noise" in med else None,
    }
    if rank == 0:
        out = Path(args.out or REPO / f"results/bench/overhead_cpu_{world}rank.json")
        write_result(out, result, title=title(world, args.threads), headline=headline(result))
        print(
            f"{world} rank(s): bare {result['median_step_ms']['bare']:.1f} ms/step, trainer "
            f"{result['median_step_ms']['trainer']:.1f} ms/step -> overhead ratio "
            f"{result['overhead_ratio']:.3f} ({out})"
        )
    dist.shutdown()
    return 0


def timed_passes(trainer, stage, pairs: int) -> dict[str, list[float]]:
    """``pairs`` alternating passes of the bare loop and the trainer's epoch over the same engine
    and loader; each pass's seconds (the first pair, a warm-up, left out)."""
    import torch.nn.functional as F

    from dstrain.core import dist
    from dstrain.loop.trainer import TrainState

    engine, loader, fmt = trainer.engine, trainer.data.train, trainer.memory_format

    def bare() -> float:
        loader.start_epoch(0)
        engine.train()
        t0 = time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(engine(x.contiguous(memory_format=fmt)), y)
            engine.backward(loss)
            engine.step()
        dist.barrier()
        return time.perf_counter() - t0

    def trainer_pass() -> float:
        trainer.state = TrainState()
        t0 = time.perf_counter()
        trainer.train_epoch(0, stage)
        dist.barrier()
        return time.perf_counter() - t0

    def without_noise() -> float:
        """The trainer with no noise-scale measurement (off the loop and its hooks)."""
        from dstrain.core.hooks import Hooks

        noise, hooks = trainer.noise, trainer.hooks
        trainer.noise, trainer.hooks = None, Hooks([h for h in hooks if h is not noise])
        try:
            return trainer_pass()
        finally:
            trainer.noise, trainer.hooks = noise, hooks

    passes = [("bare", bare), ("trainer", trainer_pass)]
    if trainer.noise is not None:
        trainer.noise.stage(stage.micro, stage.accumulation, dist.world_size())
        if trainer.noise.measurable:
            passes.append(("no_noise", without_noise))
    times = {name: [] for name, _ in passes}
    for i in range(pairs):
        order = tuple(passes)
        for name, fn in order if i % 2 == 0 else reversed(order):
            t = fn()
            if i > 0:  # the first pair warms up allocators and oneDNN kernels
                times[name].append(t)
    return times


if __name__ == "__main__":
    sys.exit(main())
