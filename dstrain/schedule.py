"""LR and weight-decay schedules: pure functions of training progress in epochs.

The LR in the DeepSpeed JSON (or ``optim.base_lr``) is the LR per
``lr_reference_batch`` images. For the global batch ``B`` in force, the peak LR
follows the scaling rule (Goyal et al.): ``peak = base * B / ref`` (or
``sqrt(B / ref)``). The curve is written in epochs, not steps, so that a batch-size
ramp (fewer, larger steps per epoch) keeps the schedule continuous in ``lr / B``.

``t`` is the progress at the END of the optimizer step being taken
(``epoch + (i + 1) / steps_in_epoch``), so the first warmup step has a non-zero LR
and the last step of training lands exactly on the end LR.

Warmup shapes over ``warmup_epochs`` W:

* ``linear``: from 0 to peak: ``peak * t / W``.
* ``gradual`` (Goyal et al.): from the base LR (the LR of the reference batch) to
  peak: ``base + (peak - base) * t / W``.
* ``hybrid``: exponential, then linear. During the first ``hybrid_exp_fraction`` of
  W the LR grows geometrically from ``warmup_start_factor * peak`` to the base LR;
  then it rises linearly from the base LR to peak. The exponential start keeps the
  first large-batch steps tiny (as a linear-from-0 warmup would) without spending
  half the warmup near zero; the linear part is Goyal's. (The exact shape of Lu et
  al.'s hybrid warmup is not public; this is our documented variant.)

Decay after warmup, with ``p = (t - W) / (epochs - W)`` in (0, 1]:
``cosine``, ``poly`` (``(1 - p) ** power``; MLPerf uses 2, Fujitsu 2.2), ``step``
(times ``gamma`` at each milestone epoch) and ``constant``; all but ``step`` end at
``end_lr_factor * peak``.
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


def warmup_lr(t: float, *, base_lr: float, peak_lr: float, warmup_epochs: float, shape: str = "linear",
              start_factor: float = 1e-3, hybrid_exp_fraction: float = 0.5) -> float:
    """LR at progress ``t`` (epochs, 0 < t <= warmup_epochs) of the warmup."""
    x = min(1.0, t / warmup_epochs)
    if shape == "linear":
        return peak_lr * x
    start = min(base_lr, peak_lr)  # a batch below the reference one has nothing to warm up from
    if shape == "gradual":
        return start + (peak_lr - start) * x
    if shape == "hybrid":
        f = hybrid_exp_fraction
        low = peak_lr * start_factor
        if x < f:
            return low * (start / low) ** (x / f)
        return start + (peak_lr - start) * (x - f) / (1 - f)
    raise ValueError(f"unknown warmup shape {shape!r}")


def decay_lr(p: float, *, peak_lr: float, decay: str = "cosine", end_lr_factor: float = 0.0,
             poly_power: float = 2.0) -> float:
    """LR at decay progress ``p`` in [0, 1] for cosine, poly and constant."""
    end = peak_lr * end_lr_factor
    p = min(1.0, max(0.0, p))
    if decay == "cosine":
        return end + (peak_lr - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    if decay == "poly":
        return end + (peak_lr - end) * (1.0 - p) ** poly_power
    if decay == "constant":
        return peak_lr
    raise ValueError(f"unknown decay {decay!r}")


def lr_at(t: float, *, base_lr: float, peak_lr: float, epochs: float, warmup_epochs: float = 0.0,
          warmup: str = "linear", start_factor: float = 1e-3, hybrid_exp_fraction: float = 0.5,
          decay: str = "cosine", end_lr_factor: float = 0.0, poly_power: float = 2.0,
          milestones: tuple[float, ...] = (), gamma: float = 0.1) -> float:
    """The LR for the optimizer step that ends at progress ``t`` (epochs)."""
    if warmup_epochs > 0 and t <= warmup_epochs:
        return warmup_lr(t, base_lr=base_lr, peak_lr=peak_lr, warmup_epochs=warmup_epochs, shape=warmup,
                         start_factor=start_factor, hybrid_exp_fraction=hybrid_exp_fraction)
    if decay == "step":
        # a step that ends exactly on a milestone still uses the LR before it
        return peak_lr * gamma ** bisect.bisect_left(list(milestones), t)
    p = (t - warmup_epochs) / max(epochs - warmup_epochs, 1e-12)
    return decay_lr(p, peak_lr=peak_lr, decay=decay, end_lr_factor=end_lr_factor, poly_power=poly_power)


def weight_decay_at(lr: float, peak_lr: float, weight_decay: float) -> float:
    """Fujitsu's schedule: weight decay warmed up and decayed with the LR curve."""
    return weight_decay * (lr / peak_lr if peak_lr > 0 else 0.0)
