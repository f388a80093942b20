"""``python -m dstrain ... --check``: everything a run would refuse, found before a job is queued.

    python -m dstrain --config imagenet_resnet50 --deepspeed_config ds_configs/bf16.json \\
        data.root=/groups/x/imagenet --check --world 64 --device cuda

Runs the run's own checks in the order the run makes them (the recipe and overrides, the DeepSpeed
JSON, the batch arithmetic for ``--world`` ranks, what the precision needs of ``--device``, the data
root, the run directory and, with ``resume=auto``, whether its checkpoint can be continued), then
prints the resolved plan: the loader and image counts, every batch stage (micro x accumulation x
ranks, steps per epoch, peak LR), the total steps, the precision. It writes nothing and starts no
process group: exit 0 when the run could start, 2 with the run's own one-line error when not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain import checkpoint, compat, mlperf, rundir
from dstrain.components import check_precision
from dstrain.config import TrainConfig
from dstrain.data import ImageCounts, check_enough_images, count_images
from dstrain.errors import ConfigError
from dstrain.launch import RUN_DIR_FILE_ENV
from dstrain.models import model_from_config
from dstrain.plan import Plan, prepare
from dstrain.ramp import batch_at
from dstrain.schedule import LRSchedule


@dataclass(frozen=True)
class Target:
    """Where the checked run will train: its ranks and their device."""

    world: int
    device: str  # "cuda" | "cpu"

    @classmethod
    def resolve(cls, world: int | None, device: str) -> Target:
        """``world`` None: this job's ($WORLD_SIZE, else 1); ``device`` auto: this machine's."""
        if world is not None and world < 1:
            raise ConfigError(f"--world {world}: the job's number of ranks must be >= 1")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(world or int(os.environ.get("WORLD_SIZE", "1")), device)


def check(cfg: TrainConfig, ds_path: str, target: Target) -> list[str]:
    """Every start-up check of a run of ``cfg`` on ``target``; the plan's lines. Writes nothing."""
    plan = prepare(cfg, ds_path, target.world, cuda=target.device == "cuda")
    check_precision(
        plan.spec.precision,
        torch.device(target.device),
        model_from_config(cfg.model),
        plan.spec.path,
    )
    images = count_images(cfg.data, cfg.model.num_classes)
    check_enough_images(images.n_train, plan.stages[0].global_size)
    for stage in plan.stages[1:]:
        check_enough_images(images.n_train, stage.global_size, key="batch.ramp")
    run_dir = check_run_dir(cfg, plan)
    return plan_lines(plan, images, target, run_dir)


def check_run_dir(cfg: TrainConfig, plan: Plan) -> str:
    """The run directory the run would use, checked as the run checks it; how it would be used."""
    pointer = os.environ.pop(RUN_DIR_FILE_ENV, None)  # launch.sh's pointer file: not written here
    try:  # choose() refuses a file, a used directory without resume=auto, a foreign one
        path = rundir.choose(cfg)
    finally:
        if pointer is not None:
            os.environ[RUN_DIR_FILE_ENV] = pointer
    root = path / rundir.CHECKPOINTS
    tag = checkpoint.newest_complete(root) if cfg.resume == "auto" and root.is_dir() else None
    if tag:
        compat.check(path, cfg, plan.spec, plan.world, checkpoint.trainer_state(root, tag))
        return f"{path} (resume=auto: continues from {tag})"
    if path.is_dir():
        return (
            f"{path} (exists; {'no complete checkpoint, starts fresh' if cfg.resume else 'empty'})"
        )
    parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run_dir={str(path)!r}: cannot be created ({parent} is not writable); "
            "choose another run_dir"
        )
    return f"{path} (new)"


def plan_lines(plan: Plan, images: ImageCounts, target: Target, run_dir: str) -> list[str]:
    cfg, spec = plan.cfg, plan.spec
    schedule = LRSchedule.from_config(cfg.optim, spec.optimizer.lr, cfg.epochs)
    comm = (
        "DeepSpeed's all-reduce"
        if spec.comm is None
        else f"dstrain {spec.comm.config.mode}, compression {spec.comm.config.compression}"
    )
    lines = [
        f"recipe       {cfg.name}: {cfg.epochs} epochs, seed {cfg.seed}",
        f"DeepSpeed    {spec.path}: precision {spec.precision}, optimizer {spec.optimizer.name} "
        f"(lr {spec.optimizer.lr:g} per {cfg.optim.lr_reference_batch} images, "
        f"{cfg.optim.lr_scaling} scaling), gradients by {comm}",
        f"job          {target.world} rank(s) on {target.device}",
        f"model        {cfg.model.name}, channels_last {str(cfg.model.channels_last).lower()}, "
        f"compile {str(cfg.model.compile).lower()}",
        f"data         {images.kind} loader, {images.n_train} train / {images.n_val} val images "
        f"from {images.source}",
    ]
    if images.note:
        lines.append(f"             note: {images.note}")
    steps = 0
    for epoch in range(cfg.epochs):
        steps += images.n_train // batch_at(epoch, plan.stages).global_size
    for stage in plan.stages:
        lines.append(
            f"batch        from epoch {stage.epoch + 1}: global {stage.global_size} = "
            f"{stage.micro} micro x {stage.accumulation} accumulation x {plan.world} ranks, "
            f"{images.n_train // stage.global_size} steps/epoch, "
            f"peak lr {schedule.peak(stage.global_size):.4g}"
        )
    lines += [
        f"schedule     {steps} optimizer steps; warmup {cfg.optim.warmup_epochs:g} epochs "
        f"({cfg.optim.warmup}), decay {cfg.optim.decay}",
        f"run_dir      {run_dir}",
    ]
    if cfg.log.mlperf:
        lines.append(mlperf_line(plan, images, schedule))
    return lines


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
