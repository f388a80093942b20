"""LR schedules as pure functions of the optimizer step.

The LR in the DeepSpeed JSON is the LR for ``lr_reference_batch`` images; the
peak LR follows the scaling rule for the actual global batch (Goyal et al.).
After a linear warmup from 0 the LR decays to ``end_lr_factor * peak``.
"""
from __future__ import annotations

import bisect
import math


def scaled_lr(base_lr: float, global_batch: int, reference_batch: int = 256, rule: str = "linear") -> float:
    ratio = global_batch / reference_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown LR scaling rule {rule!r}")


def lr_at(step: int, *, peak_lr: float, total_steps: int, warmup_steps: int, decay: str = "cosine",
          end_lr_factor: float = 0.0, poly_power: float = 2.0, milestone_steps: tuple[int, ...] = (),
          step_gamma: float = 0.1) -> float:
    """LR for optimizer step ``step`` (0-based) of ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    end_lr = peak_lr * end_lr_factor
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if decay == "cosine":
        return end_lr + (peak_lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "poly":
        return end_lr + (peak_lr - end_lr) * (1.0 - progress) ** poly_power
    if decay == "step":
        return peak_lr * step_gamma ** bisect.bisect_right(list(milestone_steps), step)
    if decay == "constant":
        return peak_lr
    raise ValueError(f"unknown decay {decay!r}")
