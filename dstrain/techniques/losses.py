"""Label smoothing (Szegedy et al.; used by Mikami et al. and MLPerf at s = 0.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy against ``(1 - s) * onehot + s / K``; ``s = 0`` is plain cross-entropy.

    Computed in FP32 whatever the logits' dtype. Used for the training loss only;
    validation loss is always plain cross-entropy.
    """
    return F.cross_entropy(logits.float(), target, label_smoothing=smoothing)
