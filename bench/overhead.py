"""The trainer's per-step overhead against a bare DeepSpeed loop: same model, data, batch, engine.

    .venv/bin/python bench/overhead.py          # 1 rank -> results/bench/overhead_cpu_1rank.json
    .venv/bin/deepspeed --num_gpus 2 bench/overhead.py --out results/bench/overhead_cpu_2rank.json

One engine (resnet_small, Fashion-MNIST from memory, global batch 256, ds_configs/fp32.json) runs
alternating passes of ``--steps`` optimizer steps: a bare loop (forward, cross-entropy,
``engine.backward``, ``engine.step``) and dstrain's ``Trainer.train_epoch``, the trainer built by the same
set-up phases as ``python -m dstrain`` (LR schedule set every step,
accumulation boundary, NaN tracking, FP16 skip counter, stop-signal agreement over ranks, metric
sums, a console/TensorBoard line every 10 steps). Each pass is timed; the ratio of the medians is the
trainer's overhead. Alternating passes in one process cancel most of the drift of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per timed pass")
    p.add_argument(
        "--pairs", type=int, default=7, help="bare/trainer pass pairs (the first is warm-up)"
    )
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument(
        "--out", default="", help="result file (default results/bench/overhead_cpu_<N>rank.json)"
    )
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    import tempfile

    import torch
    import torch.nn.functional as F

    from bench.common import provenance
    from dstrain.core import dist
    from dstrain.loop import fault
    from dstrain.loop.trainer import TrainState
    from dstrain.run import train
    from dstrain.run.plan import prepare
    from dstrain.settings.config import load_config

    # the trainer as `python -m dstrain` builds it (set-up phases of dstrain/run/train.py), in this process
    cfg = load_config(
        "fashion_mnist",
        [
            f"batch.global_size={args.batch}",
            "epochs=1",
            "optim.warmup_epochs=0",
            f"data.limit_train={args.batch * args.steps}",
            "log.tensorboard=false",
            "checkpoint.every_epochs=0",
            "fault.check_disk=false",
        ],
    )
    plan = prepare(cfg, str(REPO / "ds_configs/fp32.json"))
    dist.init_process_group(cfg.fault.collective_timeout_s)
    world, rank = dist.world_size(), dist.rank()
    signals = fault.StopSignals()
    signals.install()
    trainer = train.build_trainer(plan, Path(tempfile.mkdtemp(prefix="dstrain-overhead.")), signals)
    engine, loader, stage, fmt = (
        trainer.engine,
        trainer.data.train,
        plan.stages[0],
        trainer.memory_format,
    )

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

    times = {"bare": [], "trainer": []}
    for i in range(args.pairs):
        for name, fn in (
            (("bare", bare), ("trainer", trainer_pass))
            if i % 2 == 0
            else (("trainer", trainer_pass), ("bare", bare))
        ):
            t = fn()
            if i > 0:  # the first pair warms up allocators and oneDNN kernels
                times[name].append(t)
    signals.restore()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "what": "trainer train_epoch vs a bare DeepSpeed loop, same engine/model/data/batch, alternating passes",
        **provenance(
            "", command=" ".join(["deepspeed --num_gpus 2" if world > 1 else "python"] + sys.argv)
        ),
        "world_size": world,
        "global_batch": args.batch,
        "steps_per_pass": args.steps,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "pass_seconds": times,
        "median_step_ms": {k: 1000 * v / args.steps for k, v in med.items()},
        "images_per_sec": {k: args.batch * args.steps / v for k, v in med.items()},
        "overhead_ratio": med["trainer"] / med["bare"],
    }
    if rank == 0:
        out = Path(args.out or REPO / f"results/bench/overhead_cpu_{world}rank.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"{world} rank(s): bare {result['median_step_ms']['bare']:.1f} ms/step, trainer "
            f"{result['median_step_ms']['trainer']:.1f} ms/step -> overhead ratio {result['overhead_ratio']:.3f} "
            f"({out})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
