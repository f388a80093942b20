"""A run's start-up checks: one list, one order, one wording for the run and for ``--check``.

:func:`check` is what ``python -m dstrain`` (dstrain/run/train.py) calls after :func:`dstrain.run.plan.prepare`
and before it builds anything, and what ``python -m dstrain --check`` (dstrain/run/preflight.py) calls
for the job it is asked about; :func:`stage_lines` is the batch plan both print. In order:

1. the run directory: a file, a used directory without ``resume=auto``, a foreign one, one another
   live run holds, or one that cannot be created is refused (:func:`dstrain.run.rundir.choose`,
   :func:`dstrain.run.rundir.in_use`);
2. with ``resume=auto``, a checkpoint this config cannot continue, or whose train state a newer
   dstrain wrote (dstrain/run/compat.py);
3. the model, built once: what the precision needs of the device (bf16 weight casts with
   BatchNorm on a CPU), the optimizer's arguments (built on it once: what torch or our optimizers
   refuse, e.g. nesterov without momentum), room on the run directory's file system for two
   checkpoints of it (``fault.check_disk``), and for a fresh start from ``init.weights`` the file,
   read as data and fitted to it (dstrain/techniques/warm_start.py);
4. the data: the loader, its files and image counts (dstrain/data: a missing root, an empty or
   corrupt shard index...), at least one global batch of training images at every stage, and
   with ``polish.enabled`` a polish set the BN refit can use (2 images or more).

Nothing here writes a file or starts a process group. Every refusal of input the run makes is
made here or before (dstrain/run/plan.py), so ``--check`` and the run give the same line; what only
reading the data finds (a corrupt image inside a file) is the exception.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.data import ImageCounts, count_images
from dstrain.data.sharding import steps_per_epoch
from dstrain.loop import checkpoint, mlperf
from dstrain.run import compat, rundir
from dstrain.run.components import check_precision
from dstrain.run.plan import Plan
from dstrain.settings.config import TrainConfig, polish_batch
from dstrain.settings.ramp import batch_at, grown
from dstrain.techniques import noise_scale, warm_start
from dstrain.techniques.models import model_from_config
from dstrain.techniques.optim import build_optimizer
from dstrain.techniques.schedule import LRSchedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """What the checks found: where the run lives, where it continues from, what it reads."""

    run_dir: Path
    resume_tag: str | None  # the complete checkpoint resume=auto continues from, or None
    images: ImageCounts  # the loader and its counts; build_data builds from them
    run_dir_use: (
        str  # how the run uses its directory, in words, as found before anything is written
    )
    skipped: tuple[tuple[str, str], ...] = ()  # newer checkpoints passed over as damaged, with why
    warm_start: str = ""  # init.weights for a fresh start: what of the file fits, in words
    # and its tensors that fit, read once here (as images' counts are), loaded by the build
    init_tensors: dict | None = None


@contextlib.contextmanager
def quiet(logger: str):
    """``logger``'s INFO lines left out while a check builds what the run builds again."""
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(logging.WARNING)
    try:
        yield
    finally:
        target.setLevel(level)


def run_dir_use(run_dir: Path, tag: str | None, skipped=()) -> str:
    if tag:
        passed = "".join(f"; {t} skipped, damaged: {why}" for t, why in skipped)
        return f"{run_dir} (resume=auto: continues from {tag}{passed})"
    if run_dir.is_dir():
        held = "no complete checkpoint, starts fresh" if rundir.contents(run_dir) else "empty"
        return f"{run_dir} (exists; {held})"
    return f"{run_dir} (new)"


def check(plan: Plan, device: torch.device, draw_seed: bool = True) -> Start:
    """Every start-up check of ``plan`` on ``device``, in the order listed above (``seed=auto``
    is resolved first: ``draw_seed`` False for ``--check``, which starts nothing)."""
    cfg = plan.cfg
    run_dir = rundir.choose(cfg)
    # rank 0 alone probes the lock (a probe on another rank could meet rank 0's own hold)
    if busy := dist.broadcast_object(rundir.in_use(run_dir) if dist.is_main() else None):
        raise ConfigError(busy)
    rundir.resolve_seed(cfg, run_dir, draw=draw_seed)
    tag, skipped = resume_tag(plan, run_dir)
    if not run_dir.exists():
        check_creatable(run_dir)
    use = run_dir_use(run_dir, tag, skipped)
    model = model_from_config(cfg.model)
    check_precision(plan.spec.precision, device, model, plan.spec.path)
    # its arguments refused now, not at build time (the run logs its groups when it builds it)
    with quiet("dstrain.techniques.optim"):
        build_optimizer(model, plan.spec.optimizer, plan.schedule.base_lr)
    if cfg.fault.check_disk:
        size = rundir.checkpoint_bytes(model, plan.spec.precision, ema=bool(cfg.optim.ema.decay))
        short = rundir.disk_shortfall(run_dir, size)
        if short:
            raise ConfigError(short)
    warm, tensors = "", None
    if cfg.init.weights and not tag:  # a resume continues its checkpoint instead
        init = cfg.init
        tensors, found = warm_start.fitting(model, init.weights, cfg.model.name, init.strict)
        warm = warm_start.describe(found, init.weights)
    check_noise_ramp(plan)
    images = count_images(cfg.data, cfg.model.num_classes)
    check_images(plan, images.n_train)
    check_polish_set(plan, images.n_train)
    return Start(run_dir, tag, images, use, tuple(skipped), warm, tensors)


def resume_tag(plan: Plan, run_dir: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """resume=auto: the newest intact checkpoint in ``run_dir`` (dstrain/loop/manifest.py), refused
    (dstrain/run/compat.py) when this config cannot continue it, and the newer ones passed over as
    damaged, each warned about; (None, []) when there is nothing to continue. Collective."""
    root = run_dir / rundir.CHECKPOINTS
    if plan.cfg.resume != "auto" or not root.is_dir():
        return None, []
    tag, skipped = checkpoint.newest_intact(root)
    if skipped and not tag:
        raise checkpoint.damaged_error(root, skipped, "resume=auto")
    for damaged, why in skipped:
        if dist.is_main():
            log.warning("checkpoint %s skipped, damaged: %s; trying the one before", damaged, why)
    if tag:
        compat.check(run_dir, plan.cfg, plan.spec, plan.world, checkpoint.trainer_state(root, tag))
        checkpoint.refuse_foreign_code(root / tag)  # DeepSpeed's loader unpickles what it finds
    return tag, skipped


def check_creatable(path: Path) -> None:
    """A new run directory's nearest existing parent must take it (the wording of
    :func:`dstrain.run.rundir.create`'s refusal, which finds an unwritable directory too late)."""
    parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if os.access(parent, os.W_OK | os.X_OK):
        return
    read_only = os.statvfs(parent).f_flag & os.ST_RDONLY
    reason = "Read-only file system" if read_only else "Permission denied"
    raise ConfigError(
        f"run_dir={str(path)!r}: not writable ({reason}) in {parent}; choose another run_dir"
    )


def check_noise_ramp(plan: Plan) -> None:
    """batch.follow_noise: the noise scale measured from the first batch on, and a larger batch of
    whole micro batches under the cap."""
    cfg, spec, first = plan.cfg, plan.spec, plan.stages[0]
    if not cfg.batch.follow_noise:
        return
    why = noise_scale.unsupported(spec.engine, cfg.model.bn_group) or noise_scale.unmeasurable(
        plan.world, first.accumulation, spec.lossy_comm
    )
    if why:
        raise ConfigError(f"batch.follow_noise needs B_noise measured from the first batch: {why}")
    if grown(first, cfg.batch.noise_factor, cfg.batch.noise_cap, plan.world) is None:
        raise ConfigError(
            f"batch.noise_cap={cfg.batch.noise_cap}: no larger batch of whole micro batches "
            f"({first.micro} x {plan.world} ranks) fits under it; raise it"
        )


def check_images(plan: Plan, n_train: int) -> None:
    """At least one global batch of training images at every batch-size stage."""
    for i, stage in enumerate(plan.stages):
        if n_train >= stage.global_size:
            continue
        asks = (
            f"batch.global_size={stage.global_size}"
            if i == 0
            else f"batch.ramp reaches {stage.global_size} at epoch {stage.epoch + 1}"
        )
        key = "batch.global_size" if i == 0 else "batch.ramp"
        raise ConfigError(
            f"data: {n_train} training images is less than one global batch ({asks}); "
            f"lower {key} or use more data"
        )
    batch = plan.cfg.batch
    if batch.follow_noise and batch.noise_cap > n_train:
        raise ConfigError(
            f"data: {n_train} training images is less than the batch batch.follow_noise may grow "
            f"to (batch.noise_cap={batch.noise_cap}); lower batch.noise_cap or use more data"
        )


def polish_images(plan: Plan, n_train: int) -> int:
    """How many training images the BN refit will see over all ranks: ``polish.images`` (or
    ``polish.batches`` batches) of the training set, cut into whole batches of
    ``polish.batch_per_rank`` (0: the last micro batch x the BN group), a short last batch dropped unless it is
    the only one (dstrain/data/sharding.py: polish_batches)."""
    settings = plan.cfg.polish
    batch = polish_batch(plan.cfg, plan.stages[-1].micro)
    limit = settings.batches * batch * plan.world if settings.batches else settings.images
    size = min(limit or n_train, n_train)
    return size if size <= batch else size // batch * batch


def check_polish_set(plan: Plan, n_train: int) -> None:
    """polish.enabled: a BN refit estimates a variance per channel, so it needs 2 images or more
    (found here, not after the last epoch)."""
    if not plan.cfg.polish.enabled:
        return
    n = polish_images(plan, n_train)
    if n >= 2:
        return
    settings = plan.cfg.polish
    asked = (
        f"polish.batches={settings.batches}"
        if settings.batches
        else f"polish.images={settings.images}"
    )
    raise ConfigError(
        f"{asked}: the polish set holds {n} training image(s); the BN refit needs at least 2. "
        "Raise it (polish.images=0 takes the whole training set) or set polish.enabled=false"
    )


def stage_lines(plan: Plan, n_train: int, schedule: LRSchedule) -> list[str]:
    """The batch plan, one line per stage, and the total steps: the run logs these lines and
    ``--check`` prints them."""
    cfg = plan.cfg
    fill = cfg.data.last_batch == "fill"
    batches = [batch_at(epoch, plan.stages).global_size for epoch in range(cfg.epochs)]
    per_epoch = steps_per_epoch(n_train, batches, fill)
    steps = sum(per_epoch)

    def epoch_steps(stage) -> str:
        if not fill or n_train % stage.global_size == 0:
            return f"{n_train // stage.global_size} steps/epoch"
        return (
            f"{n_train / stage.global_size:.2f} steps/epoch (data.last_batch=fill: an epoch's last "
            "batch completed from the next epoch's images)"
        )

    lines = [
        f"from epoch {stage.epoch + 1}: global {stage.global_size} = {stage.micro} micro x "
        f"{stage.accumulation} accumulation x {plan.world} ranks, "
        f"{epoch_steps(stage)}, peak lr {schedule.peak(stage.global_size):.4g}"
        for stage in plan.stages
    ]
    batch = cfg.batch
    if batch.follow_noise:
        rewarm = (
            f", the LR moving to the new batch's over {batch.noise_rewarm_epochs:g} epochs"
            if batch.noise_rewarm_epochs
            else ""
        )
        lines.append(
            f"then x{batch.noise_factor:g} at an epoch's end where B_noise has passed the batch, "
            f"up to {batch.noise_cap} (batch.follow_noise){rewarm}"
        )
    most = "at most " if batch.follow_noise else ""
    return lines + [
        f"{most}{steps} optimizer steps; warmup {cfg.optim.warmup_epochs:g} epochs "
        f"({cfg.optim.warmup}), decay {cfg.optim.decay}"
    ]


def plan_lines(plan: Plan, start: Start, job: str) -> list[str]:
    """The resolved plan, one function for both: ``--check`` prints these lines (``job``: the ranks
    it was asked about) and the run logs them as it starts (its own ranks)."""
    cfg, spec, images, schedule = plan.cfg, plan.spec, start.images, plan.schedule
    comm = (
        "DeepSpeed's all-reduce"
        if spec.comm is None
        else f"dstrain {spec.comm.config.mode}, compression {spec.comm.config.compression}"
    )
    lines = [
        f"recipe       {cfg.name}: {cfg.epochs} epochs, seed "
        + (f"{cfg.seed}" if cfg.seed != "auto" else "auto (drawn when the run starts)"),
        f"DeepSpeed    {spec.path}: precision {spec.precision}, optimizer {spec.optimizer.name} "
        f"(optim.base_lr {schedule.base_lr:g} per {cfg.optim.lr_reference_batch} images, "
        f"{cfg.optim.lr_scaling} scaling), gradients by {comm}",
        f"job          {job}",
        f"model        {cfg.model.name}, channels_last {str(cfg.model.channels_last).lower()}, "
        f"compile {compile_line(cfg)}, {bn_line(plan)}",
    ]
    if start.warm_start:
        lines.append(f"init         {start.warm_start}")
    elif cfg.init.weights:
        lines.append(f"init         init.weights not read: continues from {start.resume_tag}")
    lines += [
        f"data         {images.kind} loader, {images.n_train} train / {images.n_val} val images "
        f"from {images.source}",
    ]
    if images.note:
        lines.append(f"             note: {images.note}")
    *stages, steps = stage_lines(plan, images.n_train, schedule)
    lines += [f"batch        {line}" for line in stages]
    lines += [f"schedule     {steps}", f"noise scale  {noise_line(plan)}"]
    lines.append(f"run_dir      {start.run_dir_use}")
    if cfg.log.mlperf:
        lines.append(mlperf_line(plan, images, schedule))
    return lines


def noise_line(plan: Plan) -> str:
    """log.noise_scale: whether and how the run measures the gradient noise scale."""
    spec, log_ = plan.spec, plan.cfg.log
    return noise_scale.plan_line(
        log_.noise_scale,
        log_.noise_scale_every,
        spec.engine,
        spec.lossy_comm,
        plan.stages,
        plan.world,
        plan.cfg.model.bn_group,
    )


def compile_line(cfg: TrainConfig) -> str:
    """``false``, or ``true (inductor, mode default)``: the plan's word on torch.compile."""
    model = cfg.model
    return (
        f"true ({model.compile_backend}, mode {model.compile_mode})" if model.compile else "false"
    )


def bn_line(plan: Plan) -> str:
    """What one BN layer normalises over in training: the span, the group of ranks, their product."""
    model, micro = plan.cfg.model, plan.stages[-1].micro
    per_rank = f"chunks of {model.bn_span}" if model.bn_span else f"the micro batch of {micro}"
    if model.bn_group == 1:
        return f"BN over {per_rank} images"
    return (
        f"BN over {per_rank} images x {model.bn_group} ranks = "
        f"{(model.bn_span or micro) * model.bn_group} images"
    )


def mlperf_line(plan: Plan, images: ImageCounts, schedule: LRSchedule) -> str:
    """log.mlperf: what the log would hold, judged now by MLPerf's own checker (a log with the
    run's values and one evaluation at the target); the closed rules name what breaks them."""
    log = plan.cfg.log
    values = mlperf.run_values(plan, images.n_train, images.n_val, schedule)
    verdict = mlperf.judge_values(values, log.mlperf_division)
    where = f"mlperf       RUN_DIR/mlperf.log, {log.mlperf_division} division: "
    if verdict.passed:
        return where + (
            f"meets MLPerf's rules (ruleset {mlperf.RULESET}) once top-1 reaches "
            f"{mlperf.TARGET_TOP1}"
        )
    broken = ", ".join(f"{k}={values.get(k, 'missing')}" for k in verdict.failed)
    return where + f"would fail MLPerf's rules (ruleset {mlperf.RULESET}) on {broken}"
