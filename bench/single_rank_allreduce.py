"""What DeepSpeed's backward all-reduce costs a single-rank run, which dstrain now skips (world size 1, ZeRO 0).

    .venv/bin/python bench/single_rank_allreduce.py      # -> bench/results/single_rank_allreduce_cpu.json

With one rank, DeepSpeed 0.19 still flattens every gradient into buckets, all-reduces them over a
group of one and copies them back after each backward: an identity. One engine (torchvision
resnet18, 64 px, batch 32, ds_configs/bf16.json, channels_last) runs alternating passes of
``--steps`` steps with ``engine.enable_backward_allreduce`` on (DeepSpeed's default) and off (what
``dstrain.run.train.run`` sets for one rank); the ratio of the median pass times is the saving.
Found while comparing the trainer with a bare PyTorch loop (``bench/throughput.py`` on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=15, help="steps per timed pass")
    p.add_argument("--pairs", type=int, default=7, help="on/off pass pairs (the first is warm-up)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "bench/results/single_rank_allreduce_cpu.json"))
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.nn.functional as F
    import torchvision

    from bench.common import provenance
    from dstrain.core import dist
    from dstrain.run import ds_config
    from dstrain.techniques.optim import build_optimizer

    dist.setup_env_for_single_process()
    dist.skip_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=1000)
    spec = ds_config.load(REPO / "ds_configs/bf16.json")
    optimizer = build_optimizer(model, spec.optimizer, 0.1)  # Goyal's SGD LR
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=spec.engine_config(args.batch, 1, 1)
    )
    engine.module.to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,))

    def run_pass(allreduce: bool) -> float:
        engine.enable_backward_allreduce = allreduce
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        return time.perf_counter() - t0

    times = {"allreduce_on": [], "allreduce_off": []}
    for pair in range(args.pairs):
        for name in times:
            seconds = run_pass(name == "allreduce_on")
            if pair:  # the first pair warms up
                times[name].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "what": __doc__.split("\n\n")[0],
        **provenance("single_rank_allreduce.py"),
        "torch_threads": torch.get_num_threads(),
        "batch": args.batch,
        "steps_per_pass": args.steps,
        "pass_seconds": times,
        "median_step_ms": {k: 1000 * v / args.steps for k, v in med.items()},
        "speedup_without_allreduce": med["allreduce_on"] / med["allreduce_off"],
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"step with DeepSpeed's single-rank all-reduce {result['median_step_ms']['allreduce_on']:.1f} ms, without "
        f"{result['median_step_ms']['allreduce_off']:.1f} ms -> {result['speedup_without_allreduce']:.2f}x ({out})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
