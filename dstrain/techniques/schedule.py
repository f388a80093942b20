"""LR and weight-decay schedules: pure functions of training progress in epochs.

``optim.base_lr`` (the LR's one home: a DeepSpeed JSON may not set it) is the LR per
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
(times ``gamma`` at each milestone epoch) and ``constant``; cosine and poly end at
``end_lr_factor * peak``, or at ``end_lr`` exactly when it is set (MLPerf's 0.0001).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from dstrain.settings.config import OptimConfig


def scaled_lr(
    base_lr: float, global_batch: int, reference_batch: int = 256, rule: str = "linear"
) -> float:
    """The peak LR for ``global_batch`` from the LR per ``reference_batch`` images (the one scaling rule)."""
    ratio = global_batch / reference_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown LR scaling rule {rule!r}")


def warmup_lr(t: float, cfg: OptimConfig, *, base_lr: float, peak_lr: float) -> float:
    """LR at progress ``t`` (epochs, 0 < t <= cfg.warmup_epochs) of the warmup."""
    x = min(1.0, t / cfg.warmup_epochs)
    if cfg.warmup == "linear":
        return peak_lr * x
    start = min(base_lr, peak_lr)  # a batch below the reference one has nothing to warm up from
    if cfg.warmup == "gradual":
        return start + (peak_lr - start) * x
    if cfg.warmup == "hybrid":
        f = cfg.hybrid_exp_fraction
        low = peak_lr * cfg.warmup_start_factor
        if x < f:
            return low * (start / low) ** (x / f)
        return start + (peak_lr - start) * (x - f) / (1 - f)
    raise ValueError(f"unknown warmup shape {cfg.warmup!r}")


def end_lr(cfg: OptimConfig, peak_lr: float) -> float:
    """The LR the cosine/poly decay ends at: ``optim.end_lr`` when set, else a fraction of the peak."""
    return cfg.end_lr if cfg.end_lr > 0 else peak_lr * cfg.end_lr_factor


def decay_lr(p: float, cfg: OptimConfig, *, peak_lr: float) -> float:
    """LR at decay progress ``p`` in [0, 1] for cosine, poly and constant."""
    end = end_lr(cfg, peak_lr)
    p = min(1.0, max(0.0, p))
    if cfg.decay == "cosine":
        return end + (peak_lr - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    if cfg.decay == "poly":
        return end + (peak_lr - end) * (1.0 - p) ** cfg.poly_power
    if cfg.decay == "constant":
        return peak_lr
    raise ValueError(f"unknown decay {cfg.decay!r}")


def lr_at(t: float, cfg: OptimConfig, *, base_lr: float, peak_lr: float, epochs: float) -> float:
    """The LR for the optimizer step that ends at progress ``t`` (epochs)."""
    if cfg.warmup_epochs > 0 and t <= cfg.warmup_epochs:
        return warmup_lr(t, cfg, base_lr=base_lr, peak_lr=peak_lr)
    if cfg.decay == "step":
        # a step that ends exactly on a milestone still uses the LR before it
        return peak_lr * cfg.step_gamma ** bisect.bisect_left(list(cfg.step_milestones), t)
    length = cfg.decay_epochs or epochs - cfg.warmup_epochs  # then the end LR is held
    p = (t - cfg.warmup_epochs) / max(length, 1e-12)
    return decay_lr(p, cfg, peak_lr=peak_lr)


def weight_decay_factor(lr: float, peak_lr: float) -> float:
    """Fujitsu's schedule: weight decay warmed up and decayed with the LR curve (a factor on its initial value)."""
    return lr / peak_lr if peak_lr > 0 else 0.0


@dataclass(frozen=True)
class LRSchedule:
    """The whole LR schedule of a run, from its ``optim`` config section: ``at(t, B)`` per optimizer step."""

    cfg: OptimConfig
    base_lr: float  # LR per cfg.lr_reference_batch images
    epochs: int

    @classmethod
    def from_config(cls, cfg: OptimConfig, epochs: int) -> LRSchedule:
        """The run's schedule: ``optim.base_lr``, the one place the LR is set. An OmegaConf node
        becomes the plain dataclass: ``at`` runs every optimizer step, and each attribute read of a
        DictConfig costs tens of microseconds (about 0.85 ms a step before), host time that a GPU
        step waiting on a loss scaler's sync cannot hide."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_object(cfg)
        return cls(cfg, cfg.base_lr, epochs)

    def peak(self, global_batch: int) -> float:
        """The peak LR at global batch ``global_batch`` (the scaling rule applied to the base LR)."""
        return scaled_lr(
            self.base_lr, global_batch, self.cfg.lr_reference_batch, self.cfg.lr_scaling
        )

    def at(self, t: float, global_batch: int) -> tuple[float, float | None]:
        """(LR, weight-decay factor or None) for the step ending at progress ``t`` (epochs) at batch B."""
        peak = self.peak(global_batch)
        lr = lr_at(t, self.cfg, base_lr=self.base_lr, peak_lr=peak, epochs=self.epochs)
        return lr, (weight_decay_factor(lr, peak) if self.cfg.wd_follows_lr else None)


def augment_at(
    epoch: int, epochs: int, last_epochs_without_augmentation: int, augment: bool = True
) -> bool:
    """Whether epoch ``epoch`` (0-based) trains on augmented images: not in the last K epochs
    (Final Polishing's seed-recipe variant, ``polish.last_epochs_without_augmentation``)."""
    return augment and epoch < epochs - last_epochs_without_augmentation
