"""Phase 1 of a run: everything the trainer config and the DeepSpeed JSON decide, checked before
anything starts (no process group, run directory or model yet).

:func:`prepare` validates the trainer config for the job's world size, reads the JSON once, plans the
batch-size stages and checks what needs both (an optimizer op that cannot take the memory layout, a
2D-Torus grid that does not fit the world). ``python -m dstrain`` (dstrain/run/train.py) and its
``--check`` (dstrain/run/preflight.py) both start here, so they refuse the same input with the same line.
"""

from __future__ import annotations

from dataclasses import dataclass

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.loop import mlperf, tracking
from dstrain.run import ds_config
from dstrain.settings.config import TrainConfig, validate
from dstrain.settings.ramp import BatchStage, batch_plan
from dstrain.techniques import comm
from dstrain.techniques.schedule import LRSchedule


@dataclass(frozen=True)
class Plan:
    """What the config and the DeepSpeed JSON decide, checked before anything starts."""

    cfg: TrainConfig
    spec: ds_config.DeepSpeedSpec
    stages: list[BatchStage]  # the batch-size ramp
    world: int
    schedule: LRSchedule  # the LR per step, from optim.base_lr (the LR's one home)


def prepare(
    cfg: TrainConfig,
    ds_path: str,
    world: int | None = None,
    cuda: bool | None = None,
    node_sizes: list[int] | None = None,
) -> Plan:
    """Phase 1, nothing started yet: validate the config, read the JSON once, plan the batch sizes.

    ``world`` (default: this job's) and ``cuda`` (default: whether this machine has a GPU) let
    ``python -m dstrain --check`` plan a job for other ranks and devices than the machine it runs on;
    ``node_sizes`` (default: this job's, from its launcher's environment) the ranks of each node."""
    dist.setup_env_for_single_process()
    world = world or dist.world_size()
    validate(cfg, world, node_sizes if node_sizes is not None else dist.node_sizes(world))
    if cfg.log.mlperf:
        mlperf.require_package()
    tracking.require_packages(cfg.log)  # log.mlflow / log.wandb: their packages
    spec = ds_config.load(ds_path, cuda_available=cuda)
    stages = batch_plan(
        cfg.batch.global_size, cfg.batch.micro_per_rank, cfg.batch.ramp, world, cfg.epochs
    )
    if spec.optimizer.kind == "fusedlamb" and cfg.model.channels_last:
        raise ConfigError(
            f"{spec.path}: optimizer type FusedLamb (DeepSpeed's CUDA op) needs contiguous tensors, "
            'and model.channels_last=true stores conv weights NHWC. Use "type": "Lamb" '
            "(dstrain's LAMB takes any layout) or set model.channels_last=false"
        )
    if spec.engine.get("zero_optimization", {}).get("stage", 0) and cfg.model.channels_last:
        raise ConfigError(
            f"{spec.path}: zero_optimization.stage "
            f"{spec.engine['zero_optimization']['stage']} flattens gradients with .view(-1), which "
            "NHWC (model.channels_last=true) conv gradients cannot give; set "
            "model.channels_last=false, or ZeRO stage 0"
        )
    if spec.comm is not None and spec.comm.config.mode == "torus2d":
        comm.grid_for(world, spec.comm.config.grid)  # a grid that does not fit the world fails here
    return Plan(cfg, spec, stages, world, LRSchedule.from_config(cfg.optim, cfg.epochs))
