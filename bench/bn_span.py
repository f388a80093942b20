"""Cost of the BN span: a training step (forward + backward) with model.bn_span=N vs plain BN.

    .venv/bin/python bench/bn_span.py                      # resnet_small width 8, batch 256, span 32, CPU
    .venv/bin/python bench/bn_span.py --model resnet50 --image-size 224 --batch 128 --device cuda

The models are timed alternately in one process (rounds of --steps each), so the ratios are taken
under the same machine load: plain BN, the span, and on a CPU with channels_last also the span by
the native kernel (``SpanBatchNorm2d.cpu_in_place=False``: the groups reshuffled into channels, the
way a GPU takes), against which the CPU's in-place way is measured. --threads sets torch's threads
(the accuracy study's runs use 1 each). Writes results/bench/bn_span_<device>.json.
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
from dstrain.techniques.bn_span import SpanBatchNorm2d, apply_bn_span  # noqa: E402
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
    native = result.get("native_span_over_plain")
    return f"{result['span_over_plain']:.2f}x the plain-BN step" + (
        f" (the native-kernel span: {native:.2f}x)" if native else ""
    )


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
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    channels = 1 if args.model == "resnet_small" else 3
    plain = build_model(args.model, 10, in_channels=channels, width=args.width).to(args.device)
    spanned = copy.deepcopy(plain)
    apply_bn_span(spanned, args.span)
    fmt = torch.channels_last if args.channels_last == "on" else torch.contiguous_format
    models = {"plain": plain.to(memory_format=fmt), "span": spanned.to(memory_format=fmt)}
    if args.device == "cpu" and args.channels_last == "on":
        models["native_span"] = copy.deepcopy(models["span"])
        for m in models["native_span"].modules():
            if isinstance(m, SpanBatchNorm2d):
                m.cpu_in_place = False
    x = torch.randn(args.batch, channels, args.image_size, args.image_size, device=args.device)
    x = x.contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), device=args.device)
    times = {name: [] for name in models}
    for model in models.values():  # warm-up
        step_time(model, x, y, 2)
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(step_time(model, x, y, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        **provenance("bn_span.py"),
        "config": vars(args),
        "torch_threads": torch.get_num_threads(),
        "step_s": times,
        "median_step_ms": {k: 1000 * v for k, v in med.items()},
        "span_over_plain": med["span"] / med["plain"],
    }
    if "native_span" in med:
        result["native_span_over_plain"] = med["native_span"] / med["plain"]
        result["span_over_native_span"] = med["span"] / med["native_span"]
    out = Path(args.out or REPO / "results" / "bench" / f"bn_span_{args.device}.json")
    write_result(out, result, title=title(args), headline=headline(result))
    print(
        f"{args.model} batch {args.batch}, span {args.span}, {args.device}: plain "
        f"{1000 * med['plain']:.1f} ms/step, span {1000 * med['span']:.1f} ms/step, "
        f"{headline(result)} -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
