"""The model and data of a run, built from its config: shared by training (dstrain/run/train.py) and the
standalone polish command (dstrain/run/polish.py), so the two cannot drift apart."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.data import Data, ImageCounts, Shard, build_data
from dstrain.settings.config import TrainConfig
from dstrain.settings.ramp import BatchStage
from dstrain.techniques.bn_group import join_groups
from dstrain.techniques.models import (
    cpu_channels_last_hazards,
    has_batchnorm,
    input_dtype,
    memory_format,
    model_from_config,
)

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Components:
    """What a run computes with: the network, its data, and how inputs reach it."""

    model: torch.nn.Module
    data: Data
    device: torch.device
    input_dtype: torch.dtype  # inputs are cast to it (FP16/BF16 engines)
    memory_format: torch.memory_format  # NCHW or channels_last


def check_precision(
    precision: str, device: torch.device, model: torch.nn.Module, source: str
) -> None:
    """Refuse a precision this device cannot train ``model`` in (before anything is built on it)."""
    if precision == "bf16" and device.type == "cpu" and has_batchnorm(model):
        raise ConfigError(
            f"{source}: bf16.enabled casts BatchNorm weights to bf16, which fails on CPU. "
            "Use ds_configs/bf16.json (torch_autocast: bf16 compute, fp32 weights and BN)."
        )


def build_components(
    cfg: TrainConfig,
    precision: str,
    stage: BatchStage,
    device: torch.device,
    images: ImageCounts | None = None,
    source: str = "the DeepSpeed JSON",
    join_bn_groups: bool = True,
) -> Components:
    """Seed, build ``cfg.model`` and ``cfg.data`` for this rank, with ``stage``'s micro batch and
    accumulation (``images``: the data's counts from the start-up checks, counted here if None)."""
    seed_everything(cfg.seed)
    model = model_from_config(cfg.model)
    check_precision(precision, device, model, source)
    if cfg.model.bn_group > 1 and join_bn_groups:
        join_groups(model)  # BN groups across ranks (dstrain/techniques/bn_group.py)
    shard = Shard(
        rank=dist.rank(),
        world=dist.world_size(),
        micro=stage.micro,
        accumulation=stage.accumulation,
        eval_batch=cfg.batch.eval_per_rank,
        seed=cfg.seed,
        fill=cfg.data.last_batch == "fill",
    )
    dtype, channels_last = input_dtype(precision), cfg.model.channels_last
    hazards = cpu_channels_last_hazards(model) if channels_last and device.type == "cpu" else []
    if hazards:
        log.warning(
            "model.channels_last=true: training in NCHW instead, because on the CPU oneDNN's NHWC backward "
            "corrupts memory in strided 1x1 convolutions with < 8 input channels (%s); "
            "use model.width >= 8 for NHWC",
            ", ".join(hazards[:3]),
        )
        channels_last = False
    data = build_data(
        cfg.data,
        shard,
        cfg.model.in_channels,
        cfg.model.num_classes,
        device,
        dtype,
        channels_last,
        counts=images,
    )
    return Components(model, data, device, dtype, memory_format(channels_last))
