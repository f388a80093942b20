"""Final Polishing (Kasagi et al., Fujitsu): re-estimate BN statistics on un-augmented training images.

The technique; the command that applies it to a finished run is dstrain/run/polish.py, and the seed
recipe's other variant, training the last K epochs un-augmented, is :func:`dstrain.techniques.schedule.augment_at`.

A network trained on random-resized crops keeps BN running statistics of
augmented images; validation images (resize + center crop) produce different
activation statistics. :func:`refit_bn` replaces every BN layer's running
mean/variance with the exact statistics of its inputs over a polish set
(training images with the validation transform), weights untouched.

How the refit runs, and why it is exact:
  * the model is in eval mode except its BN layers, which are in train mode
    (they normalise with batch statistics, as in training) with momentum None;
  * a forward pre-hook on each BN layer accumulates, per channel, the count, the
    sum and the sum of squares of its inputs: per batch in FP32 around the batch
    mean, combined across batches and ranks in FP64. BN's own cumulative average
    would not do: it averages per-batch (unbiased) variances and so misses the
    spread of the batch means, and it weights a short last batch like a full one;
  * the sums are all-reduced, so each rank refits on its shard and the result is
    the refit over the union. Batches are cut from the polish set before they are
    dealt to ranks (dstrain/data/sharding.py), so every batch, and thus every
    batch-normalised activation, is the same on any number of ranks;
  * running_var uses the unbiased estimate, like BN's own running_var.

:func:`polish_model` is the polish step of a run (refit, then evaluate), :func:`save_polished` writes
``RUN_DIR/polished/`` atomically, :func:`summarize` the before/after block of summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from dstrain.core import dist
from dstrain.core.files import atomic_write_text
from dstrain.settings.config import PolishConfig
from dstrain.techniques.bn_group import grouped_locally

log = logging.getLogger(__name__)
BatchNorm = nn.modules.batchnorm._BatchNorm
POLISHED_DIR = "polished"


def bn_layers(model: nn.Module) -> list[BatchNorm]:
    return [m for m in model.modules() if isinstance(m, BatchNorm) and m.track_running_stats]


@torch.no_grad()
def refit_bn(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    forward: Callable | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = dist.all_reduce_sum,
) -> int:
    """Replace every BN layer's running mean/var by the statistics of its inputs over ``batches``.

    ``batches`` yields model inputs; ``forward`` (default ``model``) runs one,
    e.g. a DeepSpeed engine that applies autocast. ``reduce`` sums a tensor
    across ranks in place (None: single process). Returns the number of images
    seen, over all ranks. Weights, and buffers other than BN's, are unchanged.
    """
    bns = bn_layers(model)
    if not bns:
        log.warning(
            "polish: the model has no BatchNorm layers with running statistics; nothing to refit"
        )
        return 0
    forward = forward or model
    device = bns[0].running_mean.device
    sums = {
        m: torch.zeros(3, m.num_features, dtype=torch.float64, device=device) for m in bns
    }  # n, sum x, sum x^2

    def accumulate(module: BatchNorm, inputs: tuple) -> None:
        x = inputs[0].float()  # FP16/BF16 activations: statistics in FP32
        dims = [d for d in range(x.ndim) if d != 1]
        n = x.numel() // x.shape[1]
        mean = x.mean(dims)
        # around the batch mean: no cancellation
        m2 = (x - mean.view(1, -1, *[1] * (x.ndim - 2))).square().sum(dims)
        acc, mean64 = sums[module], mean.double()
        acc[0] += n
        acc[1] += n * mean64
        acc[2] += m2.double() + n * mean64.square()

    was_training = model.training
    saved = [(m, m.momentum, m.training) for m in bns]
    previous = [
        (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in bns
    ]
    model.eval()
    for m in bns:
        m.train()
        m.momentum = None
        m.reset_running_stats()
    handles = [m.register_forward_pre_hook(accumulate) for m in bns]
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # images, batches (this rank)
    try:
        # BN groups across ranks: each batch normalised as its group did in training, with no
        # collective inside the forward (ranks may hold different numbers of batches)
        with grouped_locally(model):
            for x in batches:
                forward(x)
                counts += torch.tensor([len(x), 1.0], dtype=torch.float64, device=device)
    finally:
        for h in handles:
            h.remove()
        for m, momentum, training in saved:
            m.momentum = momentum
            m.train(training)
        model.train(was_training)
    flat = torch.cat([counts] + [sums[m].flatten() for m in bns])
    if reduce is not None:
        reduce(flat)  # the union of every rank's shard
    if flat[0] < 2:
        for m, (mean, var, tracked) in zip(bns, previous):  # leave the model as it was
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(tracked)
        raise ValueError(
            f"polish: {int(flat[0].item())} images in the polish set; at least 2 are needed"
        )
    set_statistics(bns, flat[2:], batches=int(flat[1].item()))
    return int(flat[0].item())


def set_statistics(bns: list[BatchNorm], sums: torch.Tensor, batches: int) -> None:
    """Running mean and unbiased variance of each layer from its (n, sum x, sum x^2) per channel."""
    offset = 0
    for m in bns:
        n, s1, s2 = sums[offset : offset + 3 * m.num_features].view(3, m.num_features)
        offset += 3 * m.num_features
        mean = s1 / n
        var = (s2 - n * mean.square()) / (n - 1).clamp(min=1)  # unbiased, as BN's running_var
        m.running_mean.copy_(mean)
        m.running_var.copy_(var.clamp(min=0))
        m.num_batches_tracked.fill_(batches)


# ---------------------------------------------------------------- the polish step of a run
def polish_model(
    model: nn.Module,
    forward: Callable,
    make_loader: Callable,
    evaluate_fn: Callable[[], dict],
    cfg: PolishConfig,
    *,
    batch_per_rank: int,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> dict:
    """Refit BN on the polish set (``cfg.images`` or ``cfg.batches``), then evaluate.

    ``make_loader(limit, batch)`` is ``Data.polish``; ``forward`` runs one batch (an engine or an
    autocast wrapper); ``evaluate_fn()`` evaluates the refit model."""
    limit = cfg.batches * batch_per_rank * dist.world_size() if cfg.batches else cfg.images
    loader = make_loader(limit, batch_per_rank)
    t0 = time.perf_counter()
    batches = (x.to(dtype=dtype, memory_format=memory_format) for x, _ in loader)
    n = refit_bn(model, batches, forward=forward)
    refit_s = time.perf_counter() - t0
    after = evaluate_fn()
    log.info(
        "polish: BN statistics of %d layers refit on %d training images (val transform, %d per forward) "
        "in %.1f s",
        len(bn_layers(model)),
        n,
        batch_per_rank,
        refit_s,
    )
    return {"images": n, "batch_per_rank": batch_per_rank, "refit_s": refit_s, **after}


def save_polished(
    run_dir: Path, model: nn.Module, info: dict, overwrite: bool = False, name: str = POLISHED_DIR
) -> Path:
    """RUN_DIR/polished/{model.pt, polish.json} (``name``: another folder, e.g. the EMA's), written
    into <name>.partial and renamed (rank 0 only)."""
    out, tmp = run_dir / name, run_dir / (name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, tmp / "model.pt")
    atomic_write_text(tmp / "polish.json", json.dumps(info, indent=2) + "\n")
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists")
        old = run_dir / (name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    return out


def summarize(before: dict, after: dict, train_time_s: float) -> dict:
    """The polish block of summary.json / polish.json."""
    keys = ("val_top1", "val_top5", "val_loss")
    return {
        "before": {k: before.get(k) for k in keys},
        "after": {k: after.get(k) for k in keys},
        "top1_gain": after["val_top1"] - before["val_top1"],
        "images": after["images"],
        "batch_per_rank": after["batch_per_rank"],
        "refit_s": after["refit_s"],
        "refit_fraction_of_training": after["refit_s"] / train_time_s if train_time_s else None,
    }
