"""The gradient noise scale while training (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", Appendix A): the critical batch, measured for the run's users.

B_noise = tr(Σ)/|G|², where G is the true gradient and Σ the per-example covariance. A gradient
averaged over B examples has E|G_B|² = |G|² + tr(Σ)/B, so the squared norms at two batch sizes
B_small < B_big give unbiased estimates of both:

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

each smoothed by its own moving average, then divided. Here B_small is the micro batch: the
gradient of every micro batch on every rank, its norm taken as backward produces it (a hook per
parameter, before DeepSpeed's accumulation and all-reduce), so one rank with accumulation and
several ranks without it measure the same thing over the same images. B_big is the step's global
batch: the gradient the optimizer is given (after the all-reduce, before the optimizer, so LARS,
LAMB and the weight decay do not change it); with lossy compressed communication, whose average is
not the gradient's, it is each rank's own accumulated gradient before the sync (B_big = micro x
accumulation). Norms are taken in FP32 whatever the precision, the loss scale and DeepSpeed's
1/accumulation divided out; a step with a non-finite norm (an FP16 overflow) is left out.

Every ``log.noise_scale_every``-th step is measured (the same steps on every rank and after a
resume; a norm per parameter per micro batch costs ~2% of a small model's CPU step, so it is
sampled). The sums stay on the device (no host sync); at each log window the ranks' sums are added
in one all-reduce of three numbers, the window's two estimates enter moving averages whose decay
is per measured step (``log.noise_scale_decay`` to the power of the window's measured steps,
bias-corrected as Adam's), and B_noise is their ratio. The averages are in every checkpoint, so a resume continues
them exactly (a window always ends at a checkpoint). What B_noise means for a batch: the steps
to a loss scale as S_min (1 + B_noise/B), the epochs as E_min (1 + B/B_noise); batches well under
B_noise are nearly free in epochs, batches well over it nearly free in steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dstrain.core import dist
from dstrain.core.hooks import Hook
from dstrain.core.safe_load import load_data
from dstrain.settings.ramp import BatchStage, batch_at, grown

log = logging.getLogger(__name__)

STATE_FILE = "noise_scale.pt"  # in every checkpoint directory


def estimates(b_small: float, small_sq: float, b_big: float, big_sq: float) -> tuple[float, float]:
    """(|G|², tr(Σ)) from the mean squared gradient norms at two batch sizes (the formulas above)."""
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


def unmeasurable(world: int, accumulation: int, local_big: bool) -> str:
    """Why a stage of ``world`` ranks with ``accumulation`` micro batches per step cannot measure
    the noise scale ('' when it can): the two batch sizes must differ."""
    if accumulation > 1 or (world > 1 and not local_big):
        return ""
    if local_big:
        return (
            "lossy compressed communication leaves each rank's gradient as the large batch, "
            "the same as its micro batch without accumulation (batch.micro_per_rank smaller)"
        )
    return "one rank and one micro batch per step measure one batch size only (lower batch.micro_per_rank)"


def norm_dtype(grad: torch.Tensor) -> torch.dtype:
    """Norms in FP32 at least: FP16/BF16 gradients are summed in FP32, FP64 ones in FP64."""
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def batch_sizes(micro: int, accumulation: int, world: int, local_big: bool) -> tuple[int, int]:
    """(B_small, B_big): the micro batch, and the global batch (or, ``local_big``, one rank's)."""
    return micro, micro * accumulation * (1 if local_big else world)


def unsupported(engine_cfg: dict, bn_group: int = 1) -> str:
    """Why a run's DeepSpeed config keeps the gradients where this measurement cannot read them,
    or its BN groups make a rank's gradient not its own images' ('' if neither)."""
    if bn_group > 1:
        # a rank's backward also carries the group's other images' share through the shared
        # statistics: the ranks' gradients anti-correlate, and with 2 ranks the |G|^2 estimate
        # (their dot product) stayed negative all through a batch-128 run on Fashion-MNIST
        return (
            f"model.bn_group={bn_group}: BN statistics shared across ranks couple their "
            "gradients, so one rank's gradient is not an estimate from its own images"
        )
    if engine_cfg.get("bf16", {}).get("enabled"):
        return (
            "bf16.enabled accumulates the gradients in BF16_Optimizer's own buffers "
            "(torch_autocast bf16, ds_configs/bf16.json, is measured)"
        )
    if engine_cfg.get("zero_optimization", {}).get("stage", 0):
        return "ZeRO stages 1-3 partition the gradients across ranks"
    return ""


def plan_line(
    on: bool, every: int, engine_cfg: dict, lossy: bool, stages: list, world: int, bn_group: int = 1
) -> str:
    """What ``--check`` and the run's plan say about the measurement: off, not possible (why),
    or the two batch sizes of each stage and the cost."""
    if not on:
        return "off (log.noise_scale=false)"
    if why := unsupported(engine_cfg, bn_group):
        return f"not measured: {why}"
    whys = {unmeasurable(world, stage.accumulation, lossy) for stage in stages}
    if "" not in whys:  # no stage has two batch sizes
        return f"not measured: {sorted(whys)[0]}"
    parts = []
    for stage in stages:
        where = f"from epoch {stage.epoch + 1}: " if len(stages) > 1 else ""
        if why := unmeasurable(world, stage.accumulation, lossy):
            parts.append(f"{where}not measured: {why}")
            continue
        _, big = batch_sizes(stage.micro, stage.accumulation, world, lossy)
        whose = "each rank's gradient before the lossy sync" if lossy else "the global batch"
        parts.append(f"{where}B_small {stage.micro} (a micro batch) vs B_big {big} ({whose})")
    return (
        f"B_noise every {every} step(s) (log.noise_scale_every), a gradient norm per micro "
        f"batch: {'; '.join(parts)}"
    )


@dataclass
class Averages:
    """The moving averages of the two estimates (bias-corrected by ``weight``) and what they saw."""

    grad_sq: float = 0.0
    trace: float = 0.0
    weight: float = 0.0  # 1 - decay^steps: Adam's bias correction
    steps: int = 0  # steps measured

    def update(self, grad_sq: float, trace: float, steps: int, decay: float) -> None:
        keep = decay**steps
        self.grad_sq = keep * self.grad_sq + (1 - keep) * grad_sq
        self.trace = keep * self.trace + (1 - keep) * trace
        self.weight = keep * self.weight + (1 - keep)
        self.steps += steps

    def noise_scale(self) -> float | None:
        """tr(Σ)/|G|², or None while either part is not estimated above 0: each is a difference of
        two noisy norms and can come out <= 0 (a trace <= 0 says the noise is below what the two
        batch sizes resolve, not that B_noise is 0 or negative; the parts stay in the values)."""
        if not self.steps or self.grad_sq <= 0 or self.trace <= 0:
            return None
        return self.trace / self.grad_sq


class GradientNoise(Hook):
    """The measurement on one rank's model (``params``), fed by the trainer around its backward
    and optimizer step, and its place on the loop (windows, checkpoints, history, summary)."""

    def __init__(
        self,
        params,
        decay: float,
        device: torch.device,
        every_steps: int = 1,
        local_big: bool = False,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.decay, self.local_big, self.device = decay, local_big, device
        self.every_steps = every_steps
        self.averages = Averages()
        self._norms: list[torch.Tensor] = []  # this micro batch's per-parameter norms (FP32)
        self._small = torch.zeros((), dtype=torch.float64, device=device)  # this step's sum
        self._micro = 0
        # the window's sums over measured steps: mean |G_small|², |G_big|², steps
        self._window = torch.zeros(3, dtype=torch.float64, device=device)
        # (B_small, B_big) of the stage in force, None where it has one batch size only
        self._sizes: tuple[int, int] | None = None
        self.last: dict = {}
        self.active = False  # this step is measured
        self._handles: list = []

    def attach(self) -> None:
        """Hook every parameter: each backward's own gradient is seen before it is accumulated
        (for a measured step only: a hook on a parameter costs a Python call per backward)."""
        if not self._handles:
            self._handles = [p.register_hook(self._grad_norm) for p in self.params]

    # ------------------------------------------------------------ fed by the trainer
    def _grad_norm(self, grad: torch.Tensor) -> None:
        if self.active:
            self._norms.append(torch.linalg.vector_norm(grad, dtype=norm_dtype(grad)))

    @property
    def measurable(self) -> bool:
        """The stage in force has two batch sizes."""
        return self._sizes is not None

    def stage(self, micro: int, accumulation: int, world: int) -> None:
        """A batch-size stage begins: whether it can measure, and its two batch sizes."""
        sizes = batch_sizes(micro, accumulation, world, self.local_big)
        self._sizes = None if unmeasurable(world, accumulation, self.local_big) else sizes

    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` (1-based, global) begins: measured every ``every_steps``-th, the
        same steps on every rank and after a resume."""
        self.active = self.measurable and step % self.every_steps == 0
        if self.active:
            self.attach()

    def micro_batch_done(self, unscale) -> None:
        """After a micro batch's backward: its squared gradient norm, times ``unscale``² (the
        accumulation count over the loss scale: DeepSpeed divides the loss by the one, the scaler
        multiplies it by the other)."""
        if not self.active or not self._norms:
            return
        sq = torch.stack(self._norms).double().square().sum()
        self._small += sq * torch.as_tensor(unscale, dtype=torch.float64).square()
        self._micro += 1
        self._norms.clear()

    def step_done(self, unscale) -> None:
        """At the step's end, before the optimizer: the squared norm of the gradient it is given
        (or, ``local_big``, of this rank's own before the sync), times ``unscale``² (1 over the
        loss scale)."""
        if not self.active or not self._micro:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads, 2, dtype=norm_dtype(grads[0]))
        big = torch.stack(norms).double().square().sum()
        big = big * torch.as_tensor(unscale, dtype=torch.float64).square()
        small = self._small / self._micro
        ok = torch.isfinite(small) & torch.isfinite(big)
        measured = torch.stack([small, big, torch.ones_like(big)])
        self._window += torch.where(ok, measured, torch.zeros_like(measured))
        self._small.zero_()
        self._micro = 0
        self.active = False
        self.close()

    # ------------------------------------------------------------ the loop's events
    def window_values(self, trainer: Any) -> dict:
        """The window's estimates into the averages (one all-reduce of 3 numbers, every rank)."""
        if self._sizes is None:
            return {}
        sums = dist.all_reduce_sum(self._window.clone()).tolist()
        self._window.zero_()
        steps = round(sums[2] / dist.world_size())  # each rank counted every step
        if not steps:
            return {}
        small_sq, big_sq = sums[0] / sums[2], sums[1] / sums[2]
        b_small, b_big = self._sizes
        grad_sq, trace = estimates(b_small, small_sq, b_big, big_sq)
        self.averages.update(grad_sq, trace, steps, self.decay)
        self.last = self.values()
        return self.last

    def values(self) -> dict:
        """What the averages say now: B_noise and its two parts, with the batch sizes measured."""
        a = self.averages
        if not a.steps:
            return {}
        b_small, b_big = self._sizes or (None, None)
        return {
            "noise_scale": a.noise_scale(),
            "noise_grad_sq": a.grad_sq / a.weight,
            "noise_trace": a.trace / a.weight,
            "noise_b_small": b_small,
            "noise_b_big": b_big,
        }

    def epoch_values(self, trainer: Any, epoch: int) -> dict:
        return {"noise_scale": self.last["noise_scale"]} if self.last else {}

    def checkpoint_files(self, trainer: Any) -> dict:
        """The averages, once something was measured (before that a resume starts them anew)."""
        a = self.averages
        if not a.steps:
            return {}
        return {
            STATE_FILE: {
                "grad_sq": a.grad_sq,
                "trace": a.trace,
                "weight": a.weight,
                "steps": a.steps,
            }
        }

    def fit_start(self, trainer: Any) -> bool:
        """Resumed: the averages as the checkpoint kept them (a window ended at every checkpoint)."""
        last = trainer.checks.last_checkpoint
        saved = Path(last) / STATE_FILE if last else None
        if saved is not None and saved.is_file():
            state = load_data(saved)
            self.averages = Averages(
                float(state["grad_sq"]),
                float(state["trace"]),
                float(state["weight"]),
                int(state["steps"]),
            )
            log.info("noise scale: its averages resumed from %s", saved)
        return False

    def summary(self, trainer: Any) -> dict:
        values = self.values()
        if not values:
            return {}
        settings = {"decay": self.decay, "every_steps": self.every_steps}
        return {"noise_scale": {**values, **settings, "steps_measured": self.averages.steps}}

    def close(self) -> None:
        """The parameters' hooks removed (the next measured step puts them back)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class NoiseRamp(Hook):
    """``batch.follow_noise``: a batch-size ramp decided while training. At the end of each epoch
    but the last, where the averages measured B_noise at or above the global batch in force, the
    next epoch's batch is ``factor`` times it (whole micro batches on every rank, at most ``cap``;
    :func:`dstrain.settings.ramp.grown`), the LR following the scaling rule at the new batch, over
    ``rewarm_epochs`` from the old batch's LR. Every rank decides alike (the averages come from one
    all-reduce); each switch is logged and kept in the train state (``batch_switches``), so a resume
    rebuilds the stages and continues the ramp exactly. Goes after :class:`GradientNoise` in the
    hooks (its epoch's last window is in the averages when this one decides)."""

    def __init__(self, noise: GradientNoise, factor: float, cap: int, rewarm_epochs: float):
        self.noise, self.factor, self.cap, self.rewarm = noise, factor, cap, rewarm_epochs

    def stage_for(self, epoch: int, size: int, before: BatchStage, world: int) -> BatchStage:
        unit = before.micro * world
        return BatchStage(epoch, size, before.micro, size // unit, before.global_size, self.rewarm)

    def fit_start(self, trainer: Any) -> bool:
        """Resumed: the stages the run switched to before, from its train state."""
        world = dist.world_size()  # each switch divides it (start-up's compat.check_batch_switches)
        for epoch, size, *_ in trainer.state.batch_switches:
            before = batch_at(epoch - 1, trainer.stages)
            trainer.stages.append(self.stage_for(epoch, size, before, world))
        return False

    def epoch_end(self, trainer: Any, epoch: int, metrics: dict) -> None:
        if epoch + 1 >= trainer.cfg.epochs:
            return
        noise = self.noise.averages.noise_scale()
        stage = batch_at(epoch, trainer.stages)
        if noise is None or noise < stage.global_size:
            return
        world = dist.world_size()
        size = grown(stage, self.factor, self.cap, world)
        if size is None:
            return
        trainer.stages.append(self.stage_for(epoch + 1, size, stage, world))
        trainer.state.batch_switches.append([epoch + 1, size, noise])
        log.info(
            "batch.follow_noise: B_noise %.0f passed the global batch %d after epoch %d: %d "
            "from epoch %d%s",
            noise,
            stage.global_size,
            epoch + 1,
            size,
            epoch + 2,
            f" (the LR moving to its over {self.rewarm:g} epochs)" if self.rewarm else "",
        )
