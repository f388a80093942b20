"""``target_top1``: training ends after the first evaluation at or above it (MLPerf's rule).

:class:`TargetStop` is a loop hook (dstrain/core/hooks.py) that keeps its own state, the epoch
whose evaluation reached the target: in every checkpoint as ``target.pt`` (so a resumed run trains
no more), in summary.json as ``target_epoch``, and for MLPerf's ``run_stop`` status
(:class:`dstrain.loop.mlperf.MLPerfMarks` asks :attr:`TargetStop.reached`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dstrain.core.hooks import Hook
from dstrain.core.safe_load import load_data
from dstrain.loop import checkpoint

log = logging.getLogger(__name__)
TARGET_FILE = "target.pt"  # in each checkpoint directory: {"target_epoch": N}
# the train-state key (trainer_state.json) where checkpoints before TargetStop kept its own file held it
OLD_STATE_KEY = "target_epoch"


def saved_target_epoch(ckpt: Path) -> int:
    """The epoch that reached the target as checkpoint ``ckpt`` recorded it (0: none did): its
    ``target.pt``, or in a checkpoint written before that file existed, its train state's key."""
    if (ckpt / TARGET_FILE).is_file():
        return int(load_data(ckpt / TARGET_FILE)["target_epoch"])
    return int(checkpoint.trainer_state(ckpt.parent, ckpt.name).get(OLD_STATE_KEY, 0))


class TargetStop(Hook):
    """Ends training after the first evaluation at or above ``target_top1``; ``reached`` is the
    1-based epoch of that evaluation (0: none yet), read back from the checkpoint on resume."""

    def __init__(self, target_top1: float) -> None:
        self.target = target_top1
        self.reached = 0

    def fit_start(self, trainer: Any) -> bool:
        last = trainer.checks.last_checkpoint
        self.reached = saved_target_epoch(Path(last)) if last else 0
        if self.reached:
            log.info(
                "target_top1 %.4f was reached in epoch %d: nothing left to train",
                self.target,
                self.reached,
            )
        return bool(self.reached)

    def eval_end(self, trainer: Any, epoch: int, metrics: dict) -> bool:
        if metrics["val_top1"] < self.target:
            return False
        self.reached = epoch + 1
        log.info(
            "target_top1 %.4f reached in epoch %d (top-1 %.4f): training ends here",
            self.target,
            epoch + 1,
            metrics["val_top1"],
        )
        return True

    def checkpoint_files(self, trainer: Any) -> dict:
        return {TARGET_FILE: {"target_epoch": self.reached}}

    def summary(self, trainer: Any) -> dict:
        return {"target_top1": self.target, "target_epoch": self.reached or None}
