"""The Trainer: one object that holds what the loop needs, and the loop itself.

Read top to bottom: :meth:`Trainer.fit` runs the epochs from :attr:`Trainer.state` on, and each
epoch calls :meth:`~Trainer.train_epoch`, :func:`~dstrain.core.dist.sync_bn_buffers`,
:meth:`~Trainer.evaluate` and :meth:`~Trainer.save_checkpoint` explicitly. The Trainer knows only
training: what rides on it (benchmark logs, the quality target, LARS's numbers, the EMA) is a hook
(dstrain/core/hooks.py), and Final Polishing after the last epoch is dstrain/loop/final_polish.py.
Set-up (building the engine, the data, the run directory) is :func:`dstrain.run.train.run`'s job;
a test can build a Trainer from its parts.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.core.errors import ConfigError, Preempted
from dstrain.core.hooks import Hooks
from dstrain.data import Data, sharding
from dstrain.loop import checkpoint
from dstrain.loop.evaluate import evaluate
from dstrain.loop.fault import StepChecks
from dstrain.loop.monitor import Monitor, Progress, StepMeter
from dstrain.loop.watchdog import Watchdog
from dstrain.settings.config import TrainConfig, evaluates_last_epoch, on_eval_grid
from dstrain.settings.ramp import BatchStage, batch_at
from dstrain.techniques.comm import GradientSync
from dstrain.techniques.loss_scaling import backward_multiplier, loss_scale_of, scale_in_force
from dstrain.techniques.losses import smoothed_cross_entropy
from dstrain.techniques.models import compiled_graphs
from dstrain.techniques.noise_scale import GradientNoise
from dstrain.techniques.optim import StepCounter, apply_schedule
from dstrain.techniques.schedule import LRSchedule, augment_at

log = logging.getLogger(__name__)


def evaluates_after(epoch: int, every: int, offset: int = 0) -> bool:
    """Whether epoch ``epoch`` (0-based) ends with an evaluation: on the grid of epochs offset+N,
    offset+2N, ... (:func:`dstrain.settings.config.on_eval_grid`); the last epoch does too, unless
    the run keeps to the grid (:func:`dstrain.settings.config.evaluates_last_epoch`)."""
    return on_eval_grid(epoch + 1, every, offset)


@dataclass
class TrainState:
    """What the trainer adds to DeepSpeed's checkpoint (client_state)."""

    epoch: int = 0  # completed epochs
    step: int = 0  # completed optimizer steps
    best_top1: float = 0.0
    train_time_s: float = 0.0  # wall time spent in completed epochs (train + eval)
    train_images: int = 0  # images consumed by completed epochs
    history: list = field(default_factory=list)
    epoch_step: int = 0  # optimizer steps done in the unfinished epoch (a stop part-way through it)
    epoch_sums: list = field(default_factory=list)  # its (loss*n, top1, top5, n) over all ranks
    epoch_elapsed_s: float = 0.0  # and its wall time so far
    # batch.follow_noise's switches: [epoch it starts, global batch, the B_noise that passed it]
    batch_switches: list = field(default_factory=list)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (its client_state and trainer_state.json): plain JSON values."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    def load_state_dict(self, saved: dict) -> None:
        """Take the state a checkpoint kept (refused by :func:`refuse_newer_state` as ``--check``
        refuses it); a key it lacks (an older dstrain wrote it) keeps its default."""
        refuse_newer_state(saved)
        for name, value in copy.deepcopy(saved).items():
            if name not in RETIRED_STATE_KEYS:
                setattr(self, name, value)


# keys older dstrains kept in the train state and this one keeps elsewhere: read there, not refused
RETIRED_STATE_KEYS = {
    "target_epoch": "the quality target's own checkpoint file now (dstrain/loop/target.py reads it)",
}


def refuse_newer_state(saved: dict) -> None:
    """Refuse a checkpoint's train state with keys this dstrain does not know: a newer dstrain
    wrote it. The one check of it: the run's resume (:meth:`TrainState.load_state_dict`) and the
    start-up checks, ``--check`` included (dstrain/run/compat.py, on trainer_state.json), call it."""
    known = {f.name for f in fields(TrainState)} | set(RETIRED_STATE_KEYS)
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ConfigError(
            f"the checkpoint's train state has keys this dstrain does not know ({unknown}): "
            "a newer dstrain wrote it; resume with that version"
        )


@dataclass
class Trainer:
    """The engine and everything the loop reads, as typed attributes."""

    cfg: TrainConfig
    engine: object  # deepspeed.DeepSpeedEngine (the model, the precision wrapper, the backward all-reduce)
    # the client optimizer inside the engine: the LR is set on it every step
    optimizer: torch.optim.Optimizer
    data: Data
    stages: list[BatchStage]  # the batch-size ramp (dstrain/settings/ramp.py)
    schedule: LRSchedule
    monitor: Monitor
    checks: StepChecks  # stop signals, divergence, FP16 skips (dstrain/loop/fault.py)
    checkpoint_root: Path
    input_dtype: torch.dtype = torch.float32
    memory_format: torch.memory_format = torch.contiguous_format
    grad_sync: GradientSync | None = (
        None  # our all-reduce (dstrain/techniques/comm.py), or None: DeepSpeed's
    )
    # the gradient noise scale's measurement (dstrain/techniques/noise_scale.py; also in ``hooks``)
    noise: GradientNoise | None = None
    state: TrainState = field(default_factory=TrainState)
    # what rides on the loop: its implementers are listed in dstrain/core/hooks.py
    hooks: Hooks[Trainer] = field(default_factory=Hooks)
    # derived from the above in __post_init__, never passed in
    device: torch.device = field(init=False)  # where the model's parameters live
    # client optimizer steps really taken: asked for - taken = steps a loss scaler skipped
    steps_taken: StepCounter = field(init=False)
    first_step: int = field(init=False)  # the optimizer step this process started (or resumed) at
    # the loss scale dstrain applies for the native fp16 engine (dstrain/techniques/loss_scaling.py), or None
    loss_multiplier: Callable[[], float] | None = field(init=False)
    # the stall and stop watchdog: started by dstrain.run.train.fit_and_summarise, fed by phase()
    watchdog: Watchdog = field(init=False)
    # optim.label_smoothing, read once: a DictConfig attribute costs tens of microseconds of host
    # time, which a step ending in a loss scaler's sync cannot hide behind the GPU
    label_smoothing: float = field(init=False)

    def __post_init__(self) -> None:
        self.device = next(self.engine.module.parameters()).device
        self.steps_taken = StepCounter(self.optimizer)
        self.first_step = self.state.step
        self.loss_multiplier = backward_multiplier(self.engine)
        self.label_smoothing = float(self.cfg.optim.label_smoothing)
        fault_cfg = self.cfg.fault
        self.watchdog = Watchdog(
            fault_cfg.stall_timeout_s, fault_cfg.signal_grace_s, self.checks.signals
        )

    # ------------------------------------------------------------ the epochs
    def fit(self) -> None:
        """The epochs from ``state`` on: train, BN sync, evaluate, checkpoint; a stop signal checkpoints and
        raises :class:`~dstrain.core.errors.Preempted`. The hooks (dstrain/core/hooks.py) hear each event and
        may end training (a quality target reached)."""
        try:
            if not self.hooks.fit_start(self):
                self.epochs()
        except BaseException:
            self.hooks.fit_end(self, completed=False)
            raise
        self.hooks.fit_end(self, completed=True)

    def epochs(self) -> None:
        state, epochs = self.state, self.cfg.epochs
        for epoch in range(state.epoch, epochs):
            t0 = time.perf_counter() - state.epoch_elapsed_s
            stage = self.enter_stage(epoch)
            self.hooks.epoch_start(self, epoch)
            metrics = self.train_epoch(epoch, stage)
            # eval and checkpoints see the same BN statistics everywhere
            self.phase("collective")
            dist.sync_bn_buffers(self.engine.module)
            # the training part of the epoch (no evaluation, no checkpoint)
            train_s = time.perf_counter() - t0
            if metrics is None:  # a stop signal part-way through the epoch
                state.epoch_elapsed_s = train_s
                self.stop_with_checkpoint(checkpoint.tag_for(state.epoch, state.step), epoch)
            state.epoch_elapsed_s = 0.0
            self.hooks.train_end(self, epoch)
            last = epoch + 1 == epochs
            if (last and self.evaluates_last()) or self.evaluates_after(epoch):
                self.hooks.eval_start(self, epoch)
                metrics.update(self.evaluate())
                state.best_top1 = max(state.best_top1, metrics["val_top1"])
                last = self.hooks.eval_end(self, epoch, metrics) or last
            self.end_epoch(epoch, stage, metrics, t0, train_s)
            self.hooks.epoch_end(self, epoch, metrics)
            every = self.cfg.checkpoint.every_epochs
            saved = last or (every and (epoch + 1) % every == 0)
            if saved:
                self.save_checkpoint(checkpoint.tag_for(epoch + 1), epoch)
            # a signal during evaluation or the save
            self.phase("collective")
            if not last and self.checks.stop_requested_now():
                if saved:
                    self.checks.signals.acknowledge()
                    raise Preempted(self.preempted_message("the end of", epoch))
                self.stop_with_checkpoint(checkpoint.tag_for(epoch + 1), epoch)
            if last:
                break
        self.checks.drain()

    def evaluates_after(self, epoch: int) -> bool:
        return evaluates_after(epoch, self.cfg.eval_every_epochs, self.cfg.eval_offset_epochs)

    def evaluates_last(self) -> bool:
        return evaluates_last_epoch(self.cfg)

    def enter_stage(self, epoch: int) -> BatchStage:
        """The batch-size stage of ``epoch``; tells the engine when the ramp changes its accumulation."""
        stage = batch_at(epoch, self.stages)
        if self.noise is not None:
            self.noise.stage(stage.micro, stage.accumulation, dist.world_size())
        # a ramp switch, or a resume
        if stage.accumulation != self.engine.gradient_accumulation_steps():
            self.engine.set_train_batch_size(stage.global_size)
            log.info(
                "epoch %d: global batch -> %d (%d accumulation steps)",
                epoch + 1,
                stage.global_size,
                stage.accumulation,
            )
        return stage

    def epoch_offset(self, epoch: int) -> int:
        """Where ``epoch`` starts in its permutation: data.last_batch=fill's images the epochs
        before it took from it (0 with drop)."""
        if self.cfg.data.last_batch != "fill":
            return 0
        before = [batch_at(k, self.stages).global_size for k in range(epoch)]
        return sharding.epoch_offset(self.data.n_train, before)

    def end_epoch(
        self, epoch: int, stage: BatchStage, metrics: dict, t0: float, train_s: float
    ) -> None:
        """Record the epoch's metrics in the state, the history and the monitor."""
        state = self.state
        fill = self.cfg.data.last_batch == "fill"
        steps = sharding.epoch_steps(
            self.data.n_train, stage.global_size, fill, self.epoch_offset(epoch)
        )
        metrics.update(
            epoch_time_s=time.perf_counter() - t0,
            train_s=train_s,
            global_batch=stage.global_size,
            steps_per_epoch=steps,
            peak_lr=self.schedule.peak(stage.global_size),
            augment=int(self.augment_at(epoch)),
            **self.hooks.epoch_values(self, epoch),
        )
        state.epoch, state.train_time_s = epoch + 1, state.train_time_s + metrics["epoch_time_s"]
        state.train_images += steps * stage.global_size
        state.history.append({"epoch": epoch + 1, "step": state.step, **metrics})
        self.monitor.epoch(epoch, self.cfg.epochs, metrics)

    def augment_at(self, epoch: int) -> bool:
        return augment_at(
            epoch,
            self.cfg.epochs,
            self.cfg.polish.last_epochs_without_augmentation,
            self.cfg.data.augment,
        )

    # ------------------------------------------------------------ one epoch
    def train_epoch(self, epoch: int, stage: BatchStage) -> dict | None:
        """One epoch (or its rest, from ``state.epoch_step``). Returns the epoch's metrics, or None when a
        stop signal ended it early (``state.epoch_step`` / ``epoch_sums`` then hold the part done)."""
        state, loader, accumulation = self.state, self.data.train, stage.accumulation
        first = state.epoch_step
        self.phase("data")
        self.start_loader(epoch, stage, first)
        n_micro = len(loader)  # once: a folder loader's len() draws the epoch's permutation
        steps = n_micro // accumulation
        meter = StepMeter(
            self.device, self.cfg.log.every_steps, state.epoch_sums if first else None
        )
        stop, done, lr = "", first, 0.0
        started = time.perf_counter()
        for i, (x, y) in enumerate(self.marked(loader, "data"), first * accumulation):
            if i % accumulation == 0:
                progress = epoch + (i // accumulation + 1) / steps
                lr = self.set_lr(progress, stage.lr_batch(progress))
                if self.noise is not None:
                    self.noise.begin_step(state.step + 1)
            boundary = (i + 1) % accumulation == 0
            self.train_micro_batch(x, y, boundary, meter, accumulation)
            if not boundary:
                continue
            state.step, done = state.step + 1, done + 1
            self.hooks.step_end(self, state.step)
            stop = self.after_step()
            if state.step == self.first_step + 1 and self.cfg.model.compile:
                log.info(
                    "torch.compile: first step %.1f s (tracing and compiling included)",
                    time.perf_counter() - started,
                )
            if meter.end_step() or (i + 1) == n_micro or stop:
                self.log_window(meter, Progress(epoch, self.cfg.epochs, done, steps), lr, stage)
            if stop:
                log.warning(
                    "%s received: stopping after step %d (epoch %d, step %d/%d) to write a checkpoint",
                    stop,
                    state.step,
                    epoch + 1,
                    done,
                    steps,
                )
                break
        totals = meter.epoch_totals()
        state.epoch_step, state.epoch_sums = (done, totals) if stop else (0, [])
        return None if stop else StepMeter.epoch_metrics(totals)

    def start_loader(self, epoch: int, stage: BatchStage, first_step: int) -> None:
        """The one start_epoch call of this epoch: its global batches, where to resume, augmentation."""
        augment = self.augment_at(epoch)
        if self.cfg.data.augment and not augment:
            log.info(
                "epoch %d/%d: un-augmented training images (polish.last_epochs_without_augmentation=%d)",
                epoch + 1,
                self.cfg.epochs,
                self.cfg.polish.last_epochs_without_augmentation,
            )
        if first_step:
            log.info("epoch %d: continuing after step %d of the epoch", epoch + 1, first_step)
        # DeepSpeed never calls set_epoch; our loaders reshuffle from (seed, epoch)
        self.data.train.start_epoch(
            epoch,
            accumulation=stage.accumulation,
            start=first_step * stage.accumulation,
            augment=augment,
            offset=self.epoch_offset(epoch),
        )

    def set_lr(self, progress: float, global_batch: float) -> float:
        """Set the LR (and, with optim.wd_follows_lr, the weight decay) of the step ending at
        ``progress``, as the scaling rule gives it for ``global_batch``."""
        lr, wd_factor = self.schedule.at(progress, global_batch)
        apply_schedule(self.optimizer, lr, wd_factor, self.schedule.peak(global_batch))
        return lr

    def train_micro_batch(
        self, x: torch.Tensor, y: torch.Tensor, boundary: bool, meter: StepMeter, accumulation: int
    ) -> None:
        """Forward, backward and (at an accumulation boundary) the optimizer step of one micro batch."""
        engine = self.engine
        # we own the boundary: DeepSpeed's micro-step counter drifts when a ramp changes accumulation
        engine.set_gradient_accumulation_boundary(boundary)
        # without a dstrain_communication block DeepSpeed's gradient all-reduce runs inside backward
        self.phase("forward/backward")
        logits = engine(x.to(dtype=self.input_dtype, memory_format=self.memory_format))
        loss = smoothed_cross_entropy(logits, y, self.label_smoothing)
        self.checks.nonfinite.observe(loss, self.state.step + 1)
        # the native fp16 engine's loss scale, which DeepSpeed 0.19 does not apply (loss_scaling.py)
        engine.backward(loss if self.loss_multiplier is None else loss * self.loss_multiplier())
        noise, scale = self.noise, None
        if noise is not None:  # the micro batch's gradient norm, the scales divided out
            scale = scale_in_force(engine)
            noise.micro_batch_done(accumulation / scale)
            if boundary and noise.local_big:  # this rank's own gradient, before a lossy sync
                noise.step_done(1 / scale)
        if boundary and self.grad_sync is not None:
            self.phase("collective")
            self.grad_sync.sync()  # our all-reduce (dstrain/techniques/comm.py): the engine's is switched off
        if boundary and noise is not None and not noise.local_big:
            noise.step_done(1 / scale)  # the gradient the optimizer is given
        self.phase("optimizer")
        engine.step()
        meter.add_micro_batch(loss, logits, y, accumulation)

    def after_step(self) -> str:
        """The checks after every optimizer step; the agreed stop signal's name, or ''."""
        asked = self.state.step - self.first_step
        self.checks.skips.update(
            asked - self.steps_taken.taken, self.state.step, lambda: loss_scale_of(self.engine)
        )
        self.phase("collective")
        return self.checks.stop_requested()

    def log_window(
        self, meter: StepMeter, progress: Progress, lr: float, stage: BatchStage
    ) -> None:
        # a host sync, as the logged loss is anyway
        self.phase("collective")
        self.checks.check_finite(self.state.step, progress.epoch)
        loss, steps, seconds = meter.take_window()
        sent = self.grad_sync.take_bytes() / steps if self.grad_sync is not None else None
        self.monitor.step(
            self.state.step,
            progress,
            {
                "loss": loss,
                "lr": lr,
                "global_batch": stage.global_size,
                "images_per_sec": steps * stage.global_size / seconds,
                "loss_scale": loss_scale_of(self.engine),
                "comm_bytes_per_step": sent,
                "skipped_steps": self.checks.skips.total or None,
                **self.hooks.window_values(self),  # e.g. LARS's trust ratios of the last step
            },
        )
        self.hooks.log_window(self, self.state.step)

    # ------------------------------------------------------------ evaluation, checkpoints
    def evaluate(self, module: torch.nn.Module | None = None) -> dict:
        """Evaluate the engine's model, or ``module`` (an FP32 copy such as the EMA's) in FP32."""
        compiled = self.cfg.model.compile and module is None
        started, graphs = time.perf_counter(), compiled_graphs() if compiled else 0
        batches = self.marked(self.data.val, "evaluation")  # each batch is progress
        if module is not None:
            return evaluate(module, batches, torch.float32, self.memory_format)
        metrics = evaluate(self.engine, batches, self.input_dtype, self.memory_format)
        if compiled and compiled_graphs() > graphs:
            log.info(
                "torch.compile: evaluation %.1f s, compiling %d new graphs (%d in all)",
                time.perf_counter() - started,
                compiled_graphs() - graphs,
                compiled_graphs(),
            )
        return metrics

    def save_checkpoint(self, tag: str, epoch: int) -> None:
        self.phase("checkpoint")
        # never save a diverged model
        self.checks.check_finite(self.state.step, epoch, self.engine.module)
        self.checks.last_checkpoint = checkpoint.save(
            self.engine,
            self.checkpoint_root,
            tag,
            self.state.state_dict(),
            self.cfg.checkpoint.keep_last,
            files=self.hooks.checkpoint_files(self) if dist.is_main() else {},
        )

    def stop_with_checkpoint(self, tag: str, epoch: int) -> None:
        self.checks.signals.acknowledge()  # the step is done: the checkpoint write is no longer in grace
        self.phase("collective")
        self.checks.drain()
        self.save_checkpoint(tag, epoch)
        where = f"step {self.state.epoch_step} of" if self.state.epoch_step else "the end of"
        raise Preempted(self.preempted_message(where, epoch))

    def resume_note(self) -> str:
        """Where a run that ends now stands: the end of the watchdog's message (dstrain/loop/watchdog.py)."""
        last = self.checks.last_checkpoint
        return f"at step {self.state.step}; " + (
            f"the last complete checkpoint is {last} (resume=auto continues from it)"
            if last
            else "no checkpoint was written yet"
        )

    def preempted_message(self, where: str, epoch: int) -> str:
        return (
            f"stopped by {self.checks.signals.name or 'a signal on another rank'} after global step "
            f"{self.state.step} ({where} epoch {epoch + 1}); checkpoint {self.checks.last_checkpoint} written. "
            "Run again with resume=auto and the same run_dir to continue"
        )

    # ------------------------------------------------------------ progress marks (the stall watchdog)
    def phase(self, name: str) -> None:
        """The loop enters phase ``name`` (dstrain/loop/watchdog.py's PHASES)."""
        self.watchdog.phase(name)

    def marked(self, batches: Iterable, name: str) -> Iterator:
        """``batches``, with phase ``name`` marked before each one is fetched (the first ``iter()``
        included: it may start loader workers)."""
        self.phase(name)
        for batch in batches:
            yield batch
            self.phase(name)

    def summary(self, world: int, precision: str) -> dict:
        """summary.json: final and best top-1, steps, wall and GPU time, throughput, the history."""
        state = self.state
        evaluated = [h for h in state.history if "val_top1" in h]
        return {
            "final_top1": evaluated[-1]["val_top1"] if evaluated else math.nan,
            # the epoch of that last evaluation: with eval_every_epochs (an evaluation grid) it can
            # be before the last epoch trained
            "final_top1_epoch": evaluated[-1]["epoch"] if evaluated else None,
            "best_top1": state.best_top1,
            "final_top5": evaluated[-1]["val_top5"] if evaluated else math.nan,
            "epochs": state.epoch,
            "steps": state.step,
            "global_batch": self.stages[-1].global_size,
            "world_size": world,
            "precision": precision,
            "wall_time_s": state.train_time_s,
            "gpu_time_s": state.train_time_s
            * world,  # "GPU-time" = wall x ranks (METHODS.md sec. 8)
            "images_per_sec": state.train_images / state.train_time_s
            if state.train_time_s
            else 0.0,
            "history": state.history,
            **self.hooks.summary(self),  # what the hooks add (dstrain/core/hooks.py)
        }
