"""``python -m dstrain ... --check``: everything a run would refuse, found before a job is queued.

    python -m dstrain --config imagenet_resnet50 --deepspeed_config ds_configs/bf16.json \\
        data.root=/groups/x/imagenet --check --world 64 --device cuda

Runs the run's own checks, the same functions in the same order (dstrain/plan.py: the recipe and
overrides, the DeepSpeed JSON, the batch arithmetic for ``--world`` ranks; dstrain/startup.py: the
run directory and, with ``resume=auto``, whether its checkpoint can be continued, what the precision
needs of ``--device``, the data root and its image counts against every batch stage), then
prints the resolved plan: the loader and image counts, every batch stage (micro x accumulation x
ranks, steps per epoch, peak LR), the total steps, the precision. It writes nothing and starts no
process group: exit 0 when the run could start, 2 with the run's own one-line error when not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dstrain import mlperf, startup
from dstrain.config import TrainConfig
from dstrain.data import ImageCounts
from dstrain.errors import ConfigError
from dstrain.plan import Plan, prepare
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
    """Every start-up check of a run of ``cfg`` on ``target`` (the run's own, dstrain/startup.py);
    the plan's lines. Writes nothing."""
    plan = prepare(cfg, ds_path, target.world, cuda=target.device == "cuda")
    start = startup.check(plan, torch.device(target.device))
    return plan_lines(plan, start, target)


def plan_lines(plan: Plan, start: startup.Start, target: Target) -> list[str]:
    cfg, spec, images = plan.cfg, plan.spec, start.images
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
    *stages, steps = startup.stage_lines(plan, images.n_train, schedule)
    lines += [f"batch        {line}" for line in stages]
    lines += [f"schedule     {steps}", f"run_dir      {start.run_dir_use}"]
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
