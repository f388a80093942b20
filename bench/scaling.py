"""Multi-rank CPU scaling sanity: the real trainer under ./launch.sh with 1 and then N ranks, images/s and efficiency.

    .venv/bin/python bench/scaling.py                 # 1 vs 2 CPU ranks -> results/bench/scaling_cpu.json

Each configuration runs ``./launch.sh --config fashion_mnist`` (Fashion-MNIST from memory, resnet_small,
ds_configs/fp32.json, global batch 256) for ``--epochs`` epochs with ``DSTRAIN_CPU_RANKS`` ranks, every
rank limited to ``--threads`` torch threads (one core each by default, so N ranks use N cores).
Training images/s comes from the run's own ``summary.json``: images of each epoch / the training part of
the epoch (``train_s``: steps, gradient all-reduce and BN sync; evaluation and checkpoints excluded). The
configurations alternate (1, N, 1, N, ...) for ``--repeats`` rounds; the median per configuration
counts. Scaling efficiency = images/s with N ranks / (N x images/s with 1 rank).
A 1-rank run with all cores (``--threads`` x N) is recorded too, as the single-process reference.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run(ranks: int, threads: int, args, tmp: Path, port: int) -> dict:
    run_dir = tmp / f"r{ranks}t{threads}-{port}"
    cmd = [
        "./launch.sh",
        "--config",
        "fashion_mnist",
        f"epochs={args.epochs}",
        f"batch.global_size={args.batch}",
        "checkpoint.every_epochs=0",
        "checkpoint.keep_last=1",
        "log.tensorboard=false",
        "log.every_steps=1000",
        f"run_dir={run_dir}",
        *args.extra,
    ]
    from bench.common import run_trainer

    env = {
        "DSTRAIN_CPU_RANKS": str(ranks),
        "OMP_NUM_THREADS": str(threads),
        "MASTER_PORT": str(port),
    }
    s = run_trainer(cmd, run_dir, env=env, what=f"{ranks} rank(s)")
    hist = s["history"]
    images = sum(h["steps_per_epoch"] * h["global_batch"] for h in hist)
    train_s = sum(h["train_s"] for h in hist)
    return {
        "ranks": ranks,
        "threads_per_rank": threads,
        "world_size": s["world_size"],
        "images": images,
        "train_s": train_s,
        "images_per_s": images / train_s,
        "final_top1": s["final_top1"],
        "command_wall_s": s["command_wall_s"],
        "command": f"DSTRAIN_CPU_RANKS={ranks} OMP_NUM_THREADS={threads} {shlex.join(cmd)}",
    }


def headline(result: dict, args) -> str:
    """1 -> N ranks: images/s, speedup and efficiency."""
    ips = result["images_per_s"]
    one, many = ips[f"1x{args.threads}"], ips[f"{args.ranks}x{args.threads}"]
    return (
        f"1 -> {args.ranks} ranks ({args.threads} thread(s) each): {one:,.0f} -> {many:,.0f} "
        f"img/s, {result['speedup']:.2f}x, {result['scaling_efficiency']:.0%} efficiency"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ranks", type=int, default=2, help="the multi-rank configuration (compared with 1 rank)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument(
        "--batch", type=int, default=256, help="global batch (the same for every configuration)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating rounds; the median per configuration counts",
    )
    p.add_argument("--out", default=str(REPO / "results/bench/scaling_cpu.json"))
    p.add_argument("extra", nargs="*", help="more trainer overrides for every run (key=value)")
    args = p.parse_args()
    if args.ranks < 2 or args.batch % args.ranks:
        raise SystemExit(
            f"--ranks {args.ranks} --batch {args.batch}: need >= 2 ranks that divide the global batch"
        )
    from bench.common import provenance, write_result

    configs = [(1, args.threads), (args.ranks, args.threads), (1, args.threads * args.ranks)]
    runs, port = [], 29700
    with tempfile.TemporaryDirectory(prefix="dstrain-scaling-") as tmp:
        for rnd in range(args.repeats):
            for ranks, threads in configs:
                port += 1
                r = run(ranks, threads, args, Path(tmp), port)
                r["round"] = rnd
                runs.append(r)
                print(
                    f"round {rnd}: {ranks} rank(s) x {threads} thread(s): {r['images_per_s']:.0f} img/s "
                    f"({r['train_s']:.1f} s training, top-1 {100 * r['final_top1']:.2f}%)",
                    flush=True,
                )

    def median(config):
        return statistics.median(
            r["images_per_s"] for r in runs if (r["ranks"], r["threads_per_rank"]) == config
        )

    one, many, one_all = (median(c) for c in configs)
    result = {
        "what": f"trainer images/s under ./launch.sh, 1 vs {args.ranks} CPU ranks ({args.threads} thread(s) each), "
        "Fashion-MNIST resnet_small fp32, training part of each epoch",
        **provenance("scaling.py"),
        "cpu_count": os.cpu_count(),
        "global_batch": args.batch,
        "epochs": args.epochs,
        "images_per_s": {
            f"1x{args.threads}": one,
            f"{args.ranks}x{args.threads}": many,
            f"1x{args.threads * args.ranks}": one_all,
        },
        "speedup": many / one,
        "scaling_efficiency": many / (args.ranks * one),
        "vs_one_process_all_cores": many / one_all,
        "runs": runs,
    }
    out = Path(args.out)
    title = (
        f"Multi-rank CPU scaling (`./launch.sh`): 1 vs {args.ranks} ranks, "
        f"{args.threads} thread(s) each"
    )
    write_result(out, result, title=title, headline=headline(result, args))
    print(
        f"1 rank: {one:.0f} img/s, {args.ranks} ranks: {many:.0f} img/s -> speedup {result['speedup']:.2f}x, "
        f"efficiency {100 * result['scaling_efficiency']:.0f}% ({args.ranks} ranks vs 1 process with "
        f"{args.threads * args.ranks} threads: {result['vs_one_process_all_cores']:.2f}x) -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
