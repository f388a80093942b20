"""What rides on the training loop without being training: the loop's events, as a small protocol.

:class:`dstrain.loop.trainer.Trainer` trains, evaluates, checkpoints and stops; at each of its events
it calls every :class:`LoopHook` it was given, in order, passing itself. A hook that logs, measures
or decides when training ends is one class that overrides the events it needs (subclassing
:class:`Hook`, whose events do nothing); the loop does not know it exists. The events, in the
order a run meets them:

- ``fit_start(trainer)``: before the first epoch this process trains; ``True`` from any hook
  means there is nothing to train (a resumed run that already reached its target);
- ``epoch_start(trainer, epoch)``; ``train_end(trainer, epoch)``: the epoch's training part is
  done (its evaluation and checkpoint not yet);
- ``eval_start(trainer, epoch)``; ``eval_end(trainer, epoch, metrics)``: ``True`` from any hook
  makes this epoch the last (a quality target reached);
- ``epoch_values(trainer, epoch)``: what the hook adds to the epoch's metrics (its row of the
  history and its ``epoch/*`` scalars), e.g. the gradient noise scale at the epoch's end;
- ``epoch_end(trainer, epoch, metrics)``: the epoch recorded in the history;
- ``step_end(trainer, step)``: optimizer step ``step`` (1-based, global) is done;
- ``window_values(trainer)``: what the hook adds to the log line about to be written (its
  ``train/*`` scalars), e.g. LARS's trust ratios;
- ``log_window(trainer, step)``: a log line was written for the window ending at ``step``;
- ``checkpoint_files(trainer)``: ``{file name: payload}`` saved (``torch.save``, rank 0) in every
  checkpoint directory beside DeepSpeed's files, read back by the hook itself at ``fit_start``
  (``trainer.checks.last_checkpoint`` is the checkpoint the run resumed from);
- ``polish_end(trainer, run_dir, info, refit)``: Final Polishing of the trained model is done;
  ``refit(module)`` refits and evaluates another FP32 copy of the model (the EMA's) the same way;
- ``fit_end(trainer, completed)``: training ended, ``completed`` False when it was stopped (a
  signal, a failure) rather than run to its end or its target;
- ``summary(trainer)``: what the hook adds to summary.json; ``close()``: the run is over.

The trainer's type is a parameter (``LoopHook[Trainer]``): this floor knows nothing of the trainer.

Implementers: :class:`dstrain.loop.mlperf.MLPerfMarks` (MLPerf's marks),
:class:`dstrain.loop.target.TargetStop` (``target_top1``), :class:`dstrain.techniques.lars.LARSLog`
(LARS's trust ratios, ``log.lars_tensors``), :class:`dstrain.techniques.ema.EMAHook` (``optim.ema``),
:class:`dstrain.techniques.noise_scale.GradientNoise` (``log.noise_scale``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

TrainerT = TypeVar("TrainerT", contravariant=True)
# Final Polishing's refit of a module: its BN statistics refit, then its evaluation (a metrics dict)
Refit = Callable[[Any], dict]


@runtime_checkable
class LoopHook(Protocol[TrainerT]):
    """The events :class:`dstrain.loop.trainer.Trainer` calls, with what each returns."""

    def fit_start(self, trainer: TrainerT) -> bool: ...

    def epoch_start(self, trainer: TrainerT, epoch: int) -> None: ...

    def train_end(self, trainer: TrainerT, epoch: int) -> None: ...

    def eval_start(self, trainer: TrainerT, epoch: int) -> None: ...

    def eval_end(self, trainer: TrainerT, epoch: int, metrics: dict) -> bool: ...

    def epoch_values(self, trainer: TrainerT, epoch: int) -> dict: ...
    def epoch_end(self, trainer: TrainerT, epoch: int, metrics: dict) -> None: ...

    def step_end(self, trainer: TrainerT, step: int) -> None: ...

    def window_values(self, trainer: TrainerT) -> dict: ...

    def log_window(self, trainer: TrainerT, step: int) -> None: ...

    def checkpoint_files(self, trainer: TrainerT) -> dict: ...

    def polish_end(self, trainer: TrainerT, run_dir: Path, info: dict, refit: Refit) -> None: ...

    def fit_end(self, trainer: TrainerT, completed: bool) -> None: ...

    def summary(self, trainer: TrainerT) -> dict: ...

    def close(self) -> None: ...


EVENTS = tuple(
    name for name in vars(LoopHook) if not name.startswith("_") and callable(vars(LoopHook)[name])
)


class Hook:
    """One concern riding on the loop: every event is a no-op unless overridden. The trainer is
    ``Any`` here: a hook below the loop's floor (dstrain/techniques) cannot import it."""

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

    def epoch_values(self, trainer: Any, epoch: int) -> dict:
        return {}

    def epoch_end(self, trainer: Any, epoch: int, metrics: dict) -> None:
        pass

    def step_end(self, trainer: Any, step: int) -> None:
        pass

    def window_values(self, trainer: Any) -> dict:
        return {}

    def log_window(self, trainer: Any, step: int) -> None:
        pass

    def checkpoint_files(self, trainer: Any) -> dict:
        return {}

    def polish_end(self, trainer: Any, run_dir: Path, info: dict, refit: Refit) -> None:
        pass

    def fit_end(self, trainer: Any, completed: bool) -> None:
        pass

    def summary(self, trainer: Any) -> dict:
        return {}

    def close(self) -> None:
        pass


class Hooks(Generic[TrainerT]):
    """The hooks of one run, called in the order given; each event reaches every hook (a hook
    that ends training does not keep the others from hearing of the event). An object missing an
    event is refused here, when the run is put together, not when the loop first calls it."""

    def __init__(self, hooks: Iterable[LoopHook[TrainerT]] = ()) -> None:
        self.hooks: list[LoopHook[TrainerT]] = list(hooks)
        for hook in self.hooks:
            missing = [name for name in EVENTS if not callable(getattr(hook, name, None))]
            if missing:
                raise TypeError(
                    f"{type(hook).__name__} is not a loop hook: it lacks {', '.join(missing)} "
                    "(subclass dstrain.core.hooks.Hook for the events it does not need)"
                )

    def __iter__(self) -> Iterator[LoopHook[TrainerT]]:
        return iter(self.hooks)

    def fit_start(self, trainer: TrainerT) -> bool:
        return any([hook.fit_start(trainer) for hook in self.hooks])

    def epoch_start(self, trainer: TrainerT, epoch: int) -> None:
        for hook in self.hooks:
            hook.epoch_start(trainer, epoch)

    def train_end(self, trainer: TrainerT, epoch: int) -> None:
        for hook in self.hooks:
            hook.train_end(trainer, epoch)

    def eval_start(self, trainer: TrainerT, epoch: int) -> None:
        for hook in self.hooks:
            hook.eval_start(trainer, epoch)

    def eval_end(self, trainer: TrainerT, epoch: int, metrics: dict) -> bool:
        return any([hook.eval_end(trainer, epoch, metrics) for hook in self.hooks])

    def epoch_values(self, trainer: TrainerT, epoch: int) -> dict:
        out: dict = {}
        for hook in self.hooks:
            out.update(hook.epoch_values(trainer, epoch))
        return out

    def epoch_end(self, trainer: TrainerT, epoch: int, metrics: dict) -> None:
        for hook in self.hooks:
            hook.epoch_end(trainer, epoch, metrics)

    def step_end(self, trainer: TrainerT, step: int) -> None:
        for hook in self.hooks:
            hook.step_end(trainer, step)

    def window_values(self, trainer: TrainerT) -> dict:
        out: dict = {}
        for hook in self.hooks:
            out.update(hook.window_values(trainer))
        return out

    def log_window(self, trainer: TrainerT, step: int) -> None:
        for hook in self.hooks:
            hook.log_window(trainer, step)

    def checkpoint_files(self, trainer: TrainerT) -> dict:
        out: dict = {}
        for hook in self.hooks:
            out.update(hook.checkpoint_files(trainer))
        return out

    def polish_end(self, trainer: TrainerT, run_dir: Path, info: dict, refit: Refit) -> None:
        for hook in self.hooks:
            hook.polish_end(trainer, run_dir, info, refit)

    def fit_end(self, trainer: TrainerT, completed: bool) -> None:
        for hook in self.hooks:
            hook.fit_end(trainer, completed)

    def summary(self, trainer: TrainerT) -> dict:
        out: dict = {}
        for hook in self.hooks:
            out.update(hook.summary(trainer))
        return out

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()
