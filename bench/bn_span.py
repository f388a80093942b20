"""Cost of the BN span: a training step (forward + backward) with model.bn_span=N vs plain BN.

    .venv/bin/python bench/bn_span.py                      # resnet_small width 8, batch 256, span 32, CPU
    .venv/bin/python bench/bn_span.py --model resnet50 --image-size 224 --batch 128 --device cuda

The two models are timed alternately in one process (rounds of --steps each), so the ratio is
taken under the same machine load; writes results/bench/bn_span_<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import provenance, write_result  # noqa: E402
from dstrain.techniques.bn_span import apply_bn_span  # noqa: E402
from dstrain.techniques.models import build_model  # noqa: E402


def step_time(model, x, y, steps: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
    sync()
    return (time.perf_counter() - t0) / steps


def title(args) -> str:
    """``BN span 32 cost, channels_last (resnet_small, cpu)``."""
    layout = "channels_last" if args.channels_last == "on" else "NCHW"
    return f"BN span {args.span} cost, {layout} ({args.model}, {args.device})"


def headline(result: dict) -> str:
    return f"{result['span_over_plain']:.2f}x the plain-BN step"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet_small")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--span", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--channels-last", choices=("on", "off"), default="on")
    p.add_argument("--out")
    args = p.parse_args()
    channels = 1 if args.model == "resnet_small" else 3
    plain = build_model(args.model, 10, in_channels=channels, width=args.width).to(args.device)
    spanned = copy.deepcopy(plain)
    apply_bn_span(spanned, args.span)
    fmt = torch.channels_last if args.channels_last == "on" else torch.contiguous_format
    plain, spanned = plain.to(memory_format=fmt), spanned.to(memory_format=fmt)
    x = torch.randn(args.batch, channels, args.image_size, args.image_size, device=args.device)
    x = x.contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), device=args.device)
    times = {"plain": [], "span": []}
    for model in (plain, spanned):  # warm-up
        step_time(model, x, y, 2)
    for _ in range(args.rounds):
        times["plain"].append(step_time(plain, x, y, args.steps))
        times["span"].append(step_time(spanned, x, y, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        **provenance("bn_span.py"),
        "config": vars(args),
        "step_s": times,
        "median_step_ms": {k: 1000 * v for k, v in med.items()},
        "span_over_plain": med["span"] / med["plain"],
    }
    out = Path(args.out or REPO / "results" / "bench" / f"bn_span_{args.device}.json")
    write_result(out, result, title=title(args), headline=headline(result))
    print(
        f"{args.model} batch {args.batch}, span {args.span}, {args.device}: plain "
        f"{1000 * med['plain']:.1f} ms/step, span {1000 * med['span']:.1f} ms/step, "
        f"{result['span_over_plain']:.2f}x -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
