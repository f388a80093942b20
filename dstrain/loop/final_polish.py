"""Final Polishing of a trained run (``polish.enabled``), after the Trainer's last epoch.

A fit-end step outside the loop: :func:`dstrain.run.train.fit_and_summarise` calls :func:`polish`
once :meth:`dstrain.loop.trainer.Trainer.fit` has returned. It refits BN on the polish set
(the technique: :func:`dstrain.techniques.bn_refit.polish_model`), evaluates, writes
``RUN_DIR/polished/`` and tells the hooks (the EMA refits its own average with :func:`refit`).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.loop.trainer import Trainer
from dstrain.settings.config import polish_batch
from dstrain.techniques import bn_refit

log = logging.getLogger(__name__)


def polish(trainer: Trainer, run_dir: Path) -> dict:
    """Final Polishing after the last epoch: BN refit, evaluation, RUN_DIR/polished/ (the
    checkpoints stay). A resumed, finished run that polished already reads its polish.json."""
    done = run_dir / bn_refit.POLISHED_DIR / "polish.json"
    if done.is_file():
        log.info(
            "polish: %s already exists (a resumed, finished run); not polishing again",
            done.parent,
        )
        return json.loads(done.read_text())
    trainer.phase("polish")
    state = trainer.state
    # the trained model as it ends: the last epoch's evaluation, made now where the grid left
    # it out (no hook hears it)
    before = state.history[-1] if "val_top1" in state.history[-1] else trainer.evaluate()
    after = refit(trainer)
    info = bn_refit.summarize(before, after, state.train_time_s)
    trainer.monitor.scalars(
        "polish",
        {
            "val_top1_before": before["val_top1"],
            "val_top1_after": after["val_top1"],
            "val_loss_before": before["val_loss"],
            "val_loss_after": after["val_loss"],
            "refit_s": after["refit_s"],
        },
        state.epoch,
    )
    log.info(
        "polish: top-1 %.4f -> %.4f (%+.4f), %.1f s = %.2f%% of the training time",
        before["val_top1"],
        after["val_top1"],
        info["top1_gain"],
        after["refit_s"],
        100 * (info["refit_fraction_of_training"] or 0),
    )
    trainer.phase("polish")
    if dist.is_main():
        bn_refit.save_polished(
            run_dir, trainer.engine.module, {"checkpoint": f"epoch{state.epoch:04d}", **info}
        )
    dist.barrier()
    trainer.hooks.polish_end(trainer, run_dir, info, functools.partial(refit, trainer))
    return info


def refit(trainer: Trainer, module: torch.nn.Module | None = None) -> dict:
    """Final Polishing's BN refit of the trainer's model, or of ``module`` (an FP32 copy such as
    the EMA's) in FP32, on the polish set, then its evaluation."""
    forward = trainer.engine if module is None else module

    def marked(x: torch.Tensor) -> torch.Tensor:
        trainer.phase("polish")  # each refit batch is progress for the stall watchdog
        return forward(x)

    return bn_refit.polish_model(
        trainer.engine.module if module is None else module,
        marked,
        trainer.data.polish,
        lambda: trainer.evaluate(module),
        trainer.cfg.polish,
        batch_per_rank=polish_batch(trainer.cfg, trainer.stages[-1].micro),
        dtype=trainer.input_dtype if module is None else torch.float32,
        memory_format=trainer.memory_format,
    )
