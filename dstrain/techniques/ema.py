"""An exponential moving average of the weights (``optim.ema``), and Final Polishing of it.

timm, NVIDIA's DeepLearningExamples and Composer keep an EMA of the weights and evaluate it beside
the trained model. :class:`WeightEMA` is that average: a copy of the network in FP32 (on the
model's device or the CPU), updated after every ``every_steps`` optimizer steps as
``e <- d*e + (1-d)*w`` for every parameter and floating-point buffer (BN running statistics too,
as timm's ModelEmaV3 does; integer buffers are copied). The decay of update ``t`` (0-based) is
timm's: 0 at the first update (the average starts as a copy of the weights), then ``decay``, or
with ``warmup`` ``min(decay, 1 - (1 + t/gamma)^-power)``.

An EMA model's BN running statistics are averages of statistics that earlier weights produced,
not statistics of its own weights: Final Polishing's refit (dstrain/techniques/bn_refit.py)
replaces them with the exact statistics of the EMA weights on un-augmented training images.
:class:`EMAHook` runs it all on the loop (dstrain/core/hooks.py): the update after each step, the
EMA's evaluation after each of the trained model's (``val_top1_ema`` ... in the history,
TensorBoard and summary.json), its file in every checkpoint (``ema.pt``, read back bit for bit at
resume), and the refit of the EMA after the trained model's (``RUN_DIR/polished_ema/``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dstrain.core import dist
from dstrain.core.hooks import Hook, Refit
from dstrain.core.safe_load import load_data
from dstrain.settings.config import EMAConfig
from dstrain.techniques import bn_refit
from dstrain.techniques.bn_group import GroupBatchNorm2d

log = logging.getLogger(__name__)
EMA_FILE = "ema.pt"  # in each checkpoint directory
POLISHED_EMA_DIR = "polished_ema"


def decay_at(update: int, cfg: EMAConfig) -> float:
    """The decay of the ``update``-th update (0-based): timm's ModelEmaV3.get_decay, counted in
    updates."""
    if update <= 0:
        return 0.0
    if not cfg.warmup:
        return cfg.decay
    return min(cfg.decay, max(0.0, 1.0 - (1.0 + update / cfg.warmup_gamma) ** -cfg.warmup_power))


def fp32_copy(model: nn.Module, device: torch.device | str) -> nn.Module:
    """An evaluation copy of ``model`` in FP32 on ``device``: its BN groups normalise locally (the
    copy never trains; the refit normalises as the groups did), gradients off."""
    groups = {id(m.process_group): None for m in model.modules() if isinstance(m, GroupBatchNorm2d)}
    twin = copy.deepcopy(model, memo=dict(groups))  # a process group cannot be copied
    twin.to(device=device, dtype=torch.float32).eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


class WeightEMA:
    """The FP32 average of ``model``'s weights (see the module docstring)."""

    def __init__(self, model: nn.Module, cfg: EMAConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        self.module = fp32_copy(model, device)
        self.updates = 0  # updates done
        # the average's own tensors, listed once (loading a checkpoint copies into them in place)
        self.mine = self.tensors(self.module)

    @staticmethod
    def tensors(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(averaged, copied): the parameters and floating-point buffers; the other buffers."""
        state = list(module.parameters()) + list(module.buffers())
        return [t for t in state if t.is_floating_point()], [
            t for t in state if not t.is_floating_point()
        ]

    @torch.no_grad()
    def update(self, model: nn.Module) -> float:
        """Fold ``model``'s current weights into the average; returns the decay used."""
        decay = decay_at(self.updates, self.cfg)
        mine, my_ints = self.mine
        theirs, their_ints = self.tensors(model)
        device = mine[0].device
        new = [t.detach().to(device=device, dtype=torch.float32) for t in theirs]
        if decay == 0.0:
            torch._foreach_copy_(mine, new)
        else:
            torch._foreach_lerp_(mine, new, 1.0 - decay)
        for mine_int, theirs_int in zip(my_ints, their_ints):
            mine_int.copy_(theirs_int)
        self.updates += 1
        return decay

    def state_dict(self) -> dict:
        """What ``ema.pt`` holds: the averaged module's tensors (CPU) and the update count."""
        tensors = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        return {"module": tensors, "updates": self.updates, "decay": self.cfg.decay}

    def load_state_dict(self, saved: dict) -> None:
        self.module.load_state_dict(saved["module"])
        self.updates = int(saved["updates"])

    def load(self, path: Path) -> None:
        """Read ``ema.pt`` as data (dstrain/core/safe_load.py)."""
        self.load_state_dict(load_data(path))


class EMAHook(Hook):
    """``optim.ema`` on the loop: update, evaluate beside the trained model, checkpoint, polish.

    The trainer evaluates the average (``trainer.evaluate(module)``) and Final Polishing refits it
    (the ``refit`` its ``polish_end`` hands on) as it does the trained model."""

    def __init__(self, ema: WeightEMA) -> None:
        self.ema = ema
        self.polished: dict | None = None

    def fit_start(self, trainer: Any) -> bool:
        """Resumed: the average as its checkpoint saved it; fresh: a copy of the weights (the
        first update copies them too)."""
        last = trainer.checks.last_checkpoint
        saved = Path(last) / EMA_FILE if last else None
        if saved is not None and saved.is_file():
            self.ema.load(saved)
            log.info("EMA: resumed from %s after %d updates", saved, self.ema.updates)
        elif saved is not None:  # the average starts as a copy of the weights at its first update
            log.warning(
                "EMA: %s has no %s (optim.ema was off when it was written): the average starts "
                "from the resumed weights",
                last,
                EMA_FILE,
            )
        return False

    def step_end(self, trainer: Any, step: int) -> None:
        if step % self.ema.cfg.every_steps == 0:
            self.ema.update(trainer.engine.module)

    def eval_end(self, trainer: Any, epoch: int, metrics: dict) -> bool:
        got = trainer.evaluate(self.on_device(trainer))
        metrics.update({f"{k}_ema": v for k, v in got.items() if k.startswith("val_")})
        log.info(
            "EMA (decay %g, %d updates): top-1 %.4f (trained model %.4f)",
            self.ema.cfg.decay,
            self.ema.updates,
            metrics["val_top1_ema"],
            metrics["val_top1"],
        )
        return False

    def on_device(self, trainer: Any) -> nn.Module:
        """The average on the trainer's device: itself, or a copy of the one kept on the CPU."""
        if next(self.ema.module.parameters()).device == trainer.device:
            return self.ema.module
        return fp32_copy(self.ema.module, trainer.device)

    def checkpoint_files(self, trainer: Any) -> dict:
        return {EMA_FILE: self.ema.state_dict()}

    def polish_end(self, trainer: Any, run_dir: Path, info: dict, refit: Refit) -> None:
        """Final Polishing of the EMA: its BN statistics refit on the trained model's polish set."""
        before = next(h for h in reversed(trainer.state.history) if "val_top1_ema" in h)
        before = {k[: -len("_ema")]: v for k, v in before.items() if k.endswith("_ema")}
        module = self.on_device(trainer)
        after = refit(module)
        if module is not self.ema.module:  # refit on the device, kept on the CPU
            self.ema.module.load_state_dict(module.state_dict())
        self.polished = bn_refit.summarize(before, after, trainer.state.train_time_s)
        log.info(
            "polish (EMA): top-1 %.4f -> %.4f (%+.4f)",
            before["val_top1"],
            after["val_top1"],
            self.polished["top1_gain"],
        )
        trainer.monitor.scalars(
            "polish",
            {"val_top1_ema_before": before["val_top1"], "val_top1_ema_after": after["val_top1"]},
            trainer.state.epoch,
        )
        if dist.is_main():
            bn_refit.save_polished(
                run_dir,
                self.ema.module,
                {
                    "checkpoint": f"epoch{trainer.state.epoch:04d}",
                    "weights": "ema",
                    **self.polished,
                },
                overwrite=True,
                name=POLISHED_EMA_DIR,
            )
        dist.barrier()

    def summary(self, trainer: Any) -> dict:
        evaluated = [h for h in trainer.state.history if "val_top1_ema" in h]
        out = {
            "ema": {
                "decay": self.ema.cfg.decay,
                "warmup": self.ema.cfg.warmup,
                "every_steps": self.ema.cfg.every_steps,
                "updates": self.ema.updates,
                "final_top1": evaluated[-1]["val_top1_ema"] if evaluated else None,
                "best_top1": max((h["val_top1_ema"] for h in evaluated), default=0.0),
            }
        }
        if self.polished is not None:
            out["polish_ema"] = self.polished
        return out
