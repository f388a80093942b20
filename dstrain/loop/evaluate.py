"""Exact distributed evaluation: per-rank metric sums over disjoint shards, all-reduced."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dstrain.core import dist


def accumulate_metrics(
    sums: torch.Tensor, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor
) -> None:
    """Add (loss*n, top-1 hits, top-5 hits, n) to ``sums`` on the device: no host sync per batch."""
    hit = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]
    sums[0] += loss.double() * len(y)
    sums[1] += hit[:, 0].sum()
    sums[2] += hit.any(1).sum()
    sums[3] += len(y)


@torch.no_grad()
def evaluate(
    model,
    loader,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> dict:
    """Validation loss, top-1 and top-5 over every image of ``loader`` on every rank (each counted once).

    ``model`` is a module or a DeepSpeed engine (which applies its own autocast)."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in loader:
        logits = model(x.to(dtype=dtype, memory_format=memory_format)).float()
        accumulate_metrics(sums, F.cross_entropy(logits, y), logits, y)
    loss_sum, top1, top5, n = dist.all_reduce_sum(sums).tolist()  # host sync, once per evaluation
    model.train()
    d = max(n, 1.0)
    return {
        "val_loss": loss_sum / d,
        "val_top1": top1 / d,
        "val_top5": top5 / d,
        "val_images": int(n),
    }
