"""Cost of BN groups across ranks (model.bn_group): a data-parallel step with BN over K ranks vs each
rank's own BN, and the bytes each sends beside the gradient all-reduce.

    .venv/bin/python bench/bn_group.py                       # 2 CPU ranks (gloo), resnet_small
    .venv/bin/python bench/bn_group.py --ranks 4 --model resnet50 --image-size 224 --batch 32 \\
        --device cuda                                        # 4 GPUs (NCCL), one per rank
    .venv/bin/python bench/bn_group.py --ranks 1 --device cuda ...   # one GPU: the layer's own
                                                             # arithmetic against cuDNN's BN

Every rank times the same steps (forward, backward, the gradient all-reduce as DeepSpeed makes it:
one flat buffer averaged over all ranks) for the plain model and the grouped one alternately, in
rounds of --steps, so the ratio is taken under the same load; rank 0 writes
results/bench/bn_group_<device>_<ranks>ranks.json with the medians, their ratio (and that of the
group layer over a group of the rank alone: its arithmetic without waiting) and the bytes per
step and rank: BN's (an all-gather of 2C+1 numbers per layer and chunk forward, an all-reduce of 2C
backward, ring algorithms) against the gradient all-reduce's (2 (W-1)/W x the gradient bytes).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import provenance, write_result  # noqa: E402
from dstrain.core.dist import free_port  # noqa: E402
from dstrain.techniques.bn_group import apply_bn_group, join_groups  # noqa: E402
from dstrain.techniques.bn_span import apply_bn_span  # noqa: E402
from dstrain.techniques.models import build_model, has_batchnorm  # noqa: E402


def bytes_per_step(model: torch.nn.Module, group: int, world: int, chunks: int) -> dict:
    """Bytes one rank sends per training step (ring collectives, FP32 statistics)."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    channels = sum(m.num_features for m in bns)
    gathered = sum((2 * chunks * m.num_features + 1) for m in bns) * 4 * (group - 1)
    reduced = 2 * chunks * channels * 4 * 2 * (group - 1) / group
    grads = sum(p.numel() for p in model.parameters()) * 4 * 2 * (world - 1) / world
    return {
        "bn_layers": len(bns),
        "bn_channels": channels,
        "bn_forward_bytes": gathered,
        "bn_backward_bytes": reduced,
        "gradient_allreduce_bytes": grads,
        "bn_share_of_gradient_bytes": (gathered + reduced) / grads if grads else None,
        "bn_collectives": 2 * len(bns),
    }


def step_time(model, x, y, steps: int, flat_grads) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        flat = flat_grads(model)
        tdist.all_reduce(flat)  # DeepSpeed's data-parallel average, one buffer
        flat.div_(tdist.get_world_size())
    sync()
    return (time.perf_counter() - t0) / steps


def image_channels(model: str) -> int:
    """Fashion-MNIST's one channel for the study's resnet_small, RGB for the ImageNet models."""
    return 1 if model == "resnet_small" else 3


def plain_model(args: argparse.Namespace) -> torch.nn.Module:
    """The measured model as the options name it, with per-rank BN (its span, if any)."""
    model = build_model(
        args.model, args.classes, in_channels=image_channels(args.model), width=args.width
    )
    apply_bn_span(model, args.span)
    return model


def rank_bytes(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    """:func:`bytes_per_step` for the options' group, ranks and span chunks."""
    chunks = args.batch // args.span if args.span else 1
    return bytes_per_step(model, args.group, args.ranks, chunks)


def worker(rank: int, args, port: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks)
    )
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tdist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.ranks)
    channels = image_channels(args.model)
    torch.manual_seed(0)
    plain = plain_model(args)
    grouped, alone = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_bn_group(grouped, args.group)
    join_groups(grouped)  # a group of 1 (one rank): the plain model again, not timed
    # the group layer's arithmetic with a group of this rank alone: its collectives carry nothing
    # to anyone, so grouped - alone is the cost of waiting on the peers
    apply_bn_group(alone, 2)
    itself = [tdist.new_group([r]) for r in range(args.ranks)][rank]
    for m in alone.modules():
        if hasattr(m, "process_group"):
            m.process_group, m.group_size = itself, 1
    fmt = torch.channels_last if args.channels_last == "on" else torch.contiguous_format
    plain = plain.to(device, memory_format=fmt)
    grouped = grouped.to(device, memory_format=fmt)
    alone = alone.to(device, memory_format=fmt)

    def flat_grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    g = torch.Generator().manual_seed(rank)
    size = args.image_size
    x = torch.randn(args.batch, channels, size, size, generator=g).to(device, memory_format=fmt)
    y = torch.randint(0, args.classes, (args.batch,), generator=g).to(device)
    models = {"plain": plain, "group": grouped, "group_of_one": alone}
    if args.group == 1:
        del models["group"]
    for model in models.values():  # warm-up
        step_time(model, x, y, 2, flat_grads)
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(step_time(model, x, y, args.steps, flat_grads))
    if rank == 0:
        out["times"] = times
        out["bytes"] = rank_bytes(plain, args)
        out["has_bn"] = has_batchnorm(plain)
    tdist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--group", type=int, default=0, help="BN group (default: all ranks)")
    p.add_argument("--model", default="resnet_small")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--batch", type=int, default=64, help="images per rank")
    p.add_argument("--span", type=int, default=0, help="model.bn_span (0: the whole batch)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--channels-last", choices=("on", "off"), default="off")
    p.add_argument("--classes", type=int, default=10, help="the classifier's classes")
    p.add_argument(
        "--bytes-only",
        action="store_true",
        help="write the bytes per step and rank (no ranks started, nothing timed): "
        "results/bench/bn_group_bytes_<model>_<ranks>ranks_group<K>.json",
    )
    p.add_argument("--out")
    args = p.parse_args()
    args.group = args.group or args.ranks
    if args.ranks % args.group:
        p.error(f"--group {args.group} must divide --ranks {args.ranks}")
    if args.bytes_only:
        return write_bytes(args)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(args, free_port(), out), nprocs=args.ranks, join=True)
        out = dict(out)
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    result = {
        **provenance("bn_group.py"),
        "config": vars(args),
        "step_s": out["times"],
        "median_step_ms": {k: 1000 * v for k, v in med.items()},
        "group_over_plain": med["group"] / med["plain"] if "group" in med else None,
        # the layer's own arithmetic (no peer to wait on) against the native BN
        "group_of_one_over_plain": med["group_of_one"] / med["plain"],
        "per_step_and_rank": out["bytes"],
    }
    name = f"bn_group_{args.device}_{args.ranks}ranks.json"
    path = Path(args.out or REPO / "results" / "bench" / name)
    backend = "NCCL" if args.device == "cuda" else "gloo"
    group = f"BN groups of {args.group}" if args.group < args.ranks else "BN group"
    title = f"{group} over {args.ranks} {args.device.upper()} ranks ({backend}), {args.model}"
    write_result(path, result, title=title, headline=timed_headline(result))
    b = out["bytes"]
    grouped = (
        f"{1000 * med['group']:.1f} ms grouped ({med['group'] / med['plain']:.2f}x; "
        if "group" in med
        else "("
    )
    print(
        f"{args.model}, {args.batch} images per rank, {args.ranks} {args.device} ranks, BN group "
        f"{args.group}: step {1000 * med['plain']:.1f} ms plain, {grouped}"
        f"{med['group_of_one'] / med['plain']:.2f}x with a group of one rank, no peer to wait "
        "on); BN sends "
        f"{(b['bn_forward_bytes'] + b['bn_backward_bytes']) / 1024:.1f} KiB per step and rank in "
        f"{b['bn_collectives']} collectives, the gradient all-reduce "
        f"{b['gradient_allreduce_bytes'] / 2**20:.2f} MiB -> {path}"
    )
    return 0


def timed_headline(result: dict) -> str:
    """The grouped step over the plain one (and the group of one rank's: the layer's arithmetic)."""
    alone = f"{result['group_of_one_over_plain']:.2f}x with a group of one rank"
    if result["group_over_plain"] is None:
        return f"{alone} the per-rank-BN step"
    return f"{result['group_over_plain']:.2f}x the per-rank-BN step ({alone})"


def bytes_headline(result: dict) -> str:
    return (
        f"BN {result['bn_mib']:.2f} MiB in {result['per_step_and_rank']['bn_collectives']} "
        f"collectives against the gradient all-reduce's {result['gradient_allreduce_mib']:.1f} MiB"
    )


def write_bytes(args: argparse.Namespace) -> int:
    """The arithmetic alone: what one rank sends per step for BN groups of --group among --ranks,
    against the gradient all-reduce, for --model (a document quotes these; nothing is timed)."""
    model = plain_model(args)
    b = rank_bytes(model, args)
    result = {
        **provenance("bn_group.py"),
        "config": vars(args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "per_step_and_rank": b,
        "bn_mib": (b["bn_forward_bytes"] + b["bn_backward_bytes"]) / 2**20,
        "gradient_allreduce_mib": b["gradient_allreduce_bytes"] / 2**20,
    }
    name = f"bn_group_bytes_{args.model}_{args.ranks}ranks_group{args.group}.json"
    path = Path(args.out or REPO / "results" / "bench" / name)
    title = (
        f"BN groups of {args.group} among {args.ranks} ranks: bytes per step and rank, {args.model}"
    )
    write_result(path, result, title=title, headline=bytes_headline(result))
    print(
        f"{args.model} ({args.classes} classes), BN groups of {args.group} among {args.ranks} ranks: "
        f"BN sends {result['bn_mib']:.2f} MiB per step and rank in {b['bn_collectives']} "
        f"collectives ({b['bn_layers']} layers, {b['bn_channels']} channels), the gradient "
        f"all-reduce {result['gradient_allreduce_mib']:.1f} MiB -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
