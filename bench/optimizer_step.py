"""Time one optimizer step on ResNet-50's parameter set: our LARS/LAMB vs SGD(foreach), timm's Lars and
DeepSpeed's FusedLamb (where its CUDA op builds); LAMB also on channels_last (NHWC) parameters;
Muon (filters by Newton-Schulz, the rest by SGD) and SOAP (pytorch_optimizer's, where installed).

    .venv/bin/python bench/optimizer_step.py [--device cpu|cuda] [--rounds 30] [--model resnet50]

Writes results/bench/optimizer_step_<device>.json. Every optimizer steps the same
parameters and gradients (BN/bias tensors in a second, excluded group, as the trainer
builds them); timings are interleaved round by round (the order reversed every other round) so that machine
noise hits all rows alike, and each row reports its median. Ratios are against
torch.optim.SGD(momentum, foreach=True) measured in the same run: the ratio of the medians, and
each round's own ratio with its median and 10th-90th percentile spread over the rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import provenance, write_result  # noqa: E402
from dstrain.techniques.lamb import LAMB  # noqa: E402
from dstrain.techniques.lars import LARS  # noqa: E402
from dstrain.techniques.muon import Muon, muon_groups  # noqa: E402
from dstrain.techniques.optim import param_groups  # noqa: E402


class UnchunkedLARS(LARS):
    """dstrain's LARS with the CPU chunking switched off: shows what the chunking buys."""

    def step(self, closure=None):
        import dstrain.techniques.multitensor as mt

        saved, mt.CPU_CHUNK_VALUES = mt.CPU_CHUNK_VALUES, float("inf")
        try:
            return super().step(closure)
        finally:
            mt.CPU_CHUNK_VALUES = saved


def timm_lars_rows(groups) -> tuple[dict, str]:
    """timm's Lars, per tensor and foreach, as far as the installed timm offers them (bench-only:
    its version is not ours to pin; older releases have no ``foreach`` argument)."""
    import inspect

    try:
        import timm.optim
    except ImportError:
        return {}, "timm is not installed"
    Lars = timm.optim.Lars
    if "foreach" not in inspect.signature(Lars).parameters:
        note = f"timm {timm.__version__}'s Lars has no foreach argument: one (per-tensor) row"
        return {
            "timm_lars_per_tensor": Lars(groups(), lr=0.1, momentum=0.9, trust_coeff=0.001)
        }, note
    return {
        "timm_lars_per_tensor": Lars(
            groups(), lr=0.1, momentum=0.9, trust_coeff=0.001, foreach=False
        ),
        "timm_lars_foreach": Lars(groups(), lr=0.1, momentum=0.9, trust_coeff=0.001, foreach=True),
    }, ""


def fused_lamb_row(groups) -> tuple[dict, str]:
    """DeepSpeed's FusedLamb (``"type": "FusedLamb"``) where its CUDA op builds."""
    from dstrain.techniques.optim import OpBuildError, load_fused_lamb_op

    try:
        load_fused_lamb_op()
    except OpBuildError as err:
        return {}, f"DeepSpeed FusedLamb not run: {err}"
    from deepspeed.ops.lamb import FusedLamb

    plain = [{k: v for k, v in g.items() if k != "lars_exclude"} for g in groups(layerwise=True)]
    return {"deepspeed_fused_lamb": FusedLamb(plain, lr=1e-3)}, ""


def soap_row(groups) -> tuple[dict, str]:
    """pytorch_optimizer's SOAP (``"type": "SOAP"``, the optimizers extra) where it is installed.
    Its eigenbases are refreshed every 10th step (a QR per preconditioned dimension): the median
    step is a step between refreshes, the mean (``mean_step_ms``) carries them."""
    try:
        from pytorch_optimizer import SOAP
    except ImportError as err:
        return {}, f"SOAP not run: {err} (pip install 'dstrain[optimizers]')"
    return {"soap": SOAP(groups(), lr=3e-3, data_format="channels_first")}, ""


def make_optimizers(model, model_cl) -> tuple[dict, list[str]]:
    """The rows, and a note for each row that could not run here."""

    def groups(layerwise=False, m=model):
        return param_groups(m, 5e-5, layerwise=layerwise)

    opts = {
        "sgd_foreach": torch.optim.SGD(groups(), lr=0.1, momentum=0.9, foreach=True),
        "sgd_per_tensor": torch.optim.SGD(groups(), lr=0.1, momentum=0.9, foreach=False),
        "dstrain_lars": LARS(groups(layerwise=True), lr=0.1, momentum=0.9, trust_coefficient=0.001),
        "dstrain_lars_unchunked": UnchunkedLARS(
            groups(layerwise=True), lr=0.1, momentum=0.9, trust_coefficient=0.001
        ),
        "adamw_foreach": torch.optim.AdamW(groups(), lr=1e-3, foreach=True),
        "adamw_per_tensor": torch.optim.AdamW(groups(), lr=1e-3, foreach=False),
        "dstrain_lamb": LAMB(groups(layerwise=True), lr=1e-3),
        # the same parameters stored NHWC (model.channels_last=true), which FusedLamb refuses
        "dstrain_lamb_channels_last": LAMB(groups(layerwise=True, m=model_cl), lr=1e-3),
    }
    # Muon on the filters (Newton-Schulz on each as a matrix), Nesterov SGD on the rest
    opts["dstrain_muon"] = Muon(muon_groups(groups(), 4.0), lr=0.02)
    notes = []
    for rows, note in (timm_lars_rows(groups), fused_lamb_row(groups), soap_row(groups)):
        opts.update(rows)
        if note:
            notes.append(note)
    return opts, notes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def spread(sorted_values: list[float]) -> dict:
    """Median and 10th/90th percentiles (nearest rank) of already sorted values."""
    n = len(sorted_values)

    def at(q: float) -> float:
        return round(sorted_values[min(n - 1, max(0, round(q * (n - 1))))], 3)

    return {"median": round(statistics.median(sorted_values), 3), "p10": at(0.1), "p90": at(0.9)}


def headline(result: dict) -> str:
    """Our LARS and LAMB against SGD(foreach), and LAMB on channels_last against LAMB on NCHW."""
    ratio, ms = result["ratio_vs_sgd_foreach"], result["median_step_ms"]
    layouts = ms["dstrain_lamb_channels_last"] / ms["dstrain_lamb"]
    return (
        f"LARS {ratio['dstrain_lars']:.2f}x, LAMB {ratio['dstrain_lamb']:.2f}x the time of "
        f"SGD(foreach); LAMB on channels_last {layouts:.3f}x LAMB on NCHW"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--model",
        default="resnet50",
        help="torchvision model whose parameters are stepped (resnet18: the suite's tiny run)",
    )
    ap.add_argument("--out", default="", help="default results/bench/optimizer_step_<device>.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    build = getattr(torchvision.models, args.model)
    model = build().to(device)
    model_cl = build().to(device, memory_format=torch.channels_last)
    for m in (model, model_cl):
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    opts, notes = make_optimizers(model, model_cl)
    for note in notes:
        print("note:", note)
    for opt in opts.values():  # warm-up: allocate state
        for _ in range(3):
            opt.step()
    times = {name: [] for name in opts}
    order = list(opts)
    for n in range(args.rounds):
        # alternate the order round by round: a row is not always the one after the same neighbour
        for name in order if n % 2 == 0 else reversed(order):
            sync(device)
            t0 = time.perf_counter()
            opts[name].step()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["sgd_foreach"]
    # each round's own ratio (the same round's SGD step as the reference): the spread of the claim
    per_round = {
        name: sorted(t / b for t, b in zip(ts, times["sgd_foreach"], strict=True))
        for name, ts in times.items()
    }
    params = list(model.parameters())
    result = {
        **provenance("optimizer_step.py"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "parameter_set": f"torchvision {args.model}: {len(params)} tensors, {sum(p.numel() for p in params)} values",
        "rounds": args.rounds,
        "median_step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "mean_step_ms": {k: round(statistics.mean(ts) * 1e3, 3) for k, ts in times.items()},
        "ratio_vs_sgd_foreach": {k: round(v / base, 3) for k, v in med.items()},
        # per-round ratios: median and the middle 80% (10th to 90th percentile) over the rounds
        "round_ratio_vs_sgd_foreach": {k: spread(v) for k, v in per_round.items()},
        "rows_not_run": notes,
        "targets": "CPU: dstrain_lars within 1.15x of sgd_foreach; GPU: within 1.3x and >= 3x faster than "
        "timm_lars_per_tensor",
    }
    out = Path(args.out or REPO / "results" / "bench" / f"optimizer_step_{device.type}.json")
    title = f"LARS/LAMB step on {args.model}'s parameters, {result['device']}, {args.rounds} rounds"
    write_result(out, result, title=title, headline=headline(result))
    for k in med:
        r = result["round_ratio_vs_sgd_foreach"][k]
        print(
            f"{k:24s} {med[k] * 1e3:9.2f} ms  {med[k] / base:6.3f}x SGD "
            f"(rounds: {r['p10']:.3f}-{r['p90']:.3f}x)"
        )
    print("->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
