"""What rides on the training loop without being training: the loop's events, as a small protocol.

:class:`dstrain.loop.trainer.Trainer` trains, evaluates, checkpoints and stops; at each of its events
it calls every :class:`Hook` it was given, in order, passing itself. A hook that logs, measures
or decides when training ends is one class that overrides the events it needs; the loop does
not know it exists. The events, in the order a run meets them:

- ``fit_start(trainer)``: before the first epoch this process trains; ``True`` from any hook
  means there is nothing to train (a resumed run that already reached its target);
- ``epoch_start(trainer, epoch)``; ``train_end(trainer, epoch)``: the epoch's training part is
  done (its evaluation and checkpoint not yet);
- ``eval_start(trainer, epoch)``; ``eval_end(trainer, epoch, metrics)``: ``True`` from any hook
  makes this epoch the last (a quality target reached);
- ``epoch_end(trainer, epoch, metrics)``: the epoch recorded in the history;
- ``step_end(trainer, step)``: optimizer step ``step`` (1-based, global) is done;
- ``log_window(trainer, step)``: a log line was written for the window ending at ``step``;
- ``checkpoint_files(trainer)``: ``{file name: payload}`` saved (``torch.save``, rank 0) in every
  checkpoint directory beside DeepSpeed's files, read back by the hook itself at ``fit_start``
  (``trainer.checks.last_checkpoint`` is the checkpoint the run resumed from);
- ``polish_end(trainer, run_dir, info)``: Final Polishing of the trained model is done;
- ``fit_end(trainer, completed)``: training ended, ``completed`` False when it was stopped (a
  signal, a failure) rather than run to its end or its target;
- ``summary(trainer)``: what the hook adds to summary.json; ``close()``: the run is over.

Implementers: :class:`dstrain.loop.mlperf.MLPerfLog` (MLPerf's marks), :class:`TargetStop`
(``target_top1``), :class:`dstrain.techniques.lars.TensorLog` (``log.lars_tensors``),
:class:`dstrain.techniques.ema.EMAHook` (``optim.ema``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


class Hook:
    """One concern riding on the loop: every event is a no-op unless overridden."""

    def fit_start(self, trainer: Any) -> bool:
        return False

    def epoch_start(self, trainer: Any, epoch: int) -> None:
        pass

    def train_end(self, trainer: Any, epoch: int) -> None:
        pass

    def eval_start(self, trainer: Any, epoch: int) -> None:
        pass

    def eval_end(self, trainer: Any, epoch: int, metrics: dict) -> bool:
        return False

    def epoch_end(self, trainer: Any, epoch: int, metrics: dict) -> None:
        pass

    def step_end(self, trainer: Any, step: int) -> None:
        pass

    def log_window(self, trainer: Any, step: int) -> None:
        pass

    def checkpoint_files(self, trainer: Any) -> dict:
        return {}

    def polish_end(self, trainer: Any, run_dir: Any, info: dict) -> None:
        pass

    def fit_end(self, trainer: Any, completed: bool) -> None:
        pass

    def summary(self, trainer: Any) -> dict:
        return {}

    def close(self) -> None:
        pass


class Hooks:
    """The hooks of one run, called in the order given; each event reaches every hook (a hook
    that ends training does not keep the others from hearing of the event)."""

    def __init__(self, hooks: Iterable[Hook] = ()) -> None:
        self.hooks = list(hooks)

    def __iter__(self):
        return iter(self.hooks)

    def fit_start(self, trainer: Any) -> bool:
        return any([hook.fit_start(trainer) for hook in self.hooks])

    def epoch_start(self, trainer: Any, epoch: int) -> None:
        for hook in self.hooks:
            hook.epoch_start(trainer, epoch)

    def train_end(self, trainer: Any, epoch: int) -> None:
        for hook in self.hooks:
            hook.train_end(trainer, epoch)

    def eval_start(self, trainer: Any, epoch: int) -> None:
        for hook in self.hooks:
            hook.eval_start(trainer, epoch)

    def eval_end(self, trainer: Any, epoch: int, metrics: dict) -> bool:
        return any([hook.eval_end(trainer, epoch, metrics) for hook in self.hooks])

    def epoch_end(self, trainer: Any, epoch: int, metrics: dict) -> None:
        for hook in self.hooks:
            hook.epoch_end(trainer, epoch, metrics)

    def step_end(self, trainer: Any, step: int) -> None:
        for hook in self.hooks:
            hook.step_end(trainer, step)

    def log_window(self, trainer: Any, step: int) -> None:
        for hook in self.hooks:
            hook.log_window(trainer, step)

    def checkpoint_files(self, trainer: Any) -> dict:
        out: dict = {}
        for hook in self.hooks:
            out.update(hook.checkpoint_files(trainer))
        return out

    def polish_end(self, trainer: Any, run_dir: Any, info: dict) -> None:
        for hook in self.hooks:
            hook.polish_end(trainer, run_dir, info)

    def fit_end(self, trainer: Any, completed: bool) -> None:
        for hook in self.hooks:
            hook.fit_end(trainer, completed)

    def summary(self, trainer: Any) -> dict:
        out: dict = {}
        for hook in self.hooks:
            out.update(hook.summary(trainer))
        return out

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()


class TargetStop(Hook):
    """``target_top1``: training ends after the first evaluation at or above it (MLPerf's rule),
    recorded in ``state.target_epoch`` (so a resumed run trains no more) and in summary.json."""

    def __init__(self, target_top1: float) -> None:
        self.target = target_top1

    def fit_start(self, trainer: Any) -> bool:
        reached = trainer.state.target_epoch
        if reached:
            log.info(
                "target_top1 %.4f was reached in epoch %d: nothing left to train",
                self.target,
                reached,
            )
        return bool(reached)

    def eval_end(self, trainer: Any, epoch: int, metrics: dict) -> bool:
        if metrics["val_top1"] < self.target:
            return False
        trainer.state.target_epoch = epoch + 1
        log.info(
            "target_top1 %.4f reached in epoch %d (top-1 %.4f): training ends here",
            self.target,
            epoch + 1,
            metrics["val_top1"],
        )
        return True

    def summary(self, trainer: Any) -> dict:
        return {"target_top1": self.target, "target_epoch": trainer.state.target_epoch or None}
