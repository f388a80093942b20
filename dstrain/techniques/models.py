"""Models: torchvision classifiers by name, and a small ResNet for 28x28/32x32 inputs."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from dstrain.core.errors import ConfigError
from dstrain.settings.config import ModelConfig
from dstrain.techniques.bn_group import apply_bn_group
from dstrain.techniques.bn_span import apply_bn_span

log = logging.getLogger(__name__)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """CIFAR-style ResNet (He et al. 2016, sec. 4.2): 3 stages of widths w, 2w, 4w."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 16,
        blocks_per_stage: int = 1,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        layers, c_in = [], width
        for stage in range(3):
            c_out = width * 2**stage
            for i in range(blocks_per_stage):
                layers.append(BasicBlock(c_in, c_out, stride=2 if (stage > 0 and i == 0) else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def zero_init_last_bn(model: nn.Module) -> None:
    """Goyal et al.: each residual block starts as identity (last BN gamma = 0)."""
    for m in model.modules():
        if isinstance(m, BasicBlock):
            nn.init.zeros_(m.bn2.weight)


def plain_model(cfg: ModelConfig) -> nn.Module:
    """The network the ``model`` section names, with plain BatchNorm: what its weights load into
    outside dstrain (``python -m dstrain.export``)."""
    return build_model(
        cfg.name,
        cfg.num_classes,
        in_channels=cfg.in_channels,
        width=cfg.width,
        blocks_per_stage=cfg.blocks_per_stage,
        zero_init_residual=cfg.zero_init_residual,
    )


def model_from_config(cfg: ModelConfig) -> nn.Module:
    """The network the ``model`` section describes (with its BN span, dstrain/techniques/bn_span.py)."""
    model = plain_model(cfg)
    if cfg.bn_span:
        layers = apply_bn_span(model, cfg.bn_span)
        log.info(
            "BN span: %d BatchNorm2d layers normalise over groups of %d images", layers, cfg.bn_span
        )
    apply_bn_group(model, cfg.bn_group)  # its ranks join in dstrain/run/components.py
    return model


def build_model(
    name: str,
    num_classes: int,
    *,
    in_channels: int = 3,
    width: int = 16,
    blocks_per_stage: int = 1,
    zero_init_residual: bool = True,
) -> nn.Module:
    if name == "resnet_small":
        model = SmallResNet(in_channels, num_classes, width, blocks_per_stage)
        if zero_init_residual:
            zero_init_last_bn(model)
        return model
    import torchvision  # a heavy import: only when a run names one of its models

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"model.name={name!r}: not resnet_small nor a torchvision classification model "
            f"(e.g. resnet18, resnet50, wide_resnet50_2)"
        )
    kwargs = {"weights": None, "num_classes": num_classes}
    if name.startswith(("resnet", "wide_resnet", "resnext")):
        kwargs["zero_init_residual"] = zero_init_residual
    return torchvision.models.get_model(name, **kwargs)


def batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def has_batchnorm(model: nn.Module) -> bool:
    return bool(batchnorms(model))


def input_dtype(precision: str) -> torch.dtype:
    """The dtype the model's inputs are cast to: FP16/BF16 engines take half-precision inputs."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def compile_engine(engine, mode: str, backend: str = "inductor") -> None:
    """``torch.compile`` the engine's module in place (``nn.Module.compile``, through DeepSpeed's
    ``engine.compile``): the state dict keeps its keys, so checkpoints load compiled or not.
    Compilation itself happens at the first forward of each mode (train, eval).

    Shapes are static (``dynamic=False``): a training run sees a handful of batch shapes (the micro
    batch, an epoch's last partial batch, the eval batches), each compiled once. Dynamo's default
    would turn the batch dimension symbolic at the second shape, and the BN span's grouping
    reshape (``dstrain/techniques/bn_span.py``) under a symbolic batch sent inductor's shape solver into a
    loop of tens of minutes (tests/test_trainer.py's compiled tests hung CI this way).

    ``backend``: inductor (``mode`` is its), or aot_eager / eager, which trace the same graphs
    without generating code (validated: a mode other than default needs inductor)."""
    kwargs = {"dynamic": False, **({"mode": mode} if backend == "inductor" else {})}
    log.info("torch.compile: %s, mode %s; the first train and eval steps compile", backend, mode)
    engine.compile(backend=backend, compile_kwargs=kwargs)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process; growth after the first epoch means
    recompilation (a changed shape, dtype or module attribute)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def keep_batchnorm_fp32(model: nn.Module) -> int:
    """Cast BatchNorm parameters back to FP32 after DeepSpeed's native fp16 engine made them FP16;
    returns how many modules. cuDNN normalises FP16 inputs with FP32 BN parameters and statistics
    (apex's keep_batchnorm_fp32); with FP16 parameters and the FP32 running statistics DeepSpeed
    keeps, NCHW BatchNorm fails in backward ("Expected running_mean to have type Half"). The
    Parameter objects stay the same, so the engine's FP32 master copies still map to them."""
    bns = batchnorms(model)
    for m in bns:
        m.float()
    return len(bns)


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def cpu_channels_last_hazards(model: nn.Module) -> list[str]:
    """Convolutions that oneDNN's channels_last (NHWC) backward corrupts memory on, on the CPU.

    Seen with torch 2.15.0 (a probe's report, `git show 7d4f03e:bench/results/cpu_channels_last_crash.md`):
    a strided 1x1 convolution with fewer than 8 input channels (resnet_small's downsampling shortcut
    at model.width < 8) segfaults, aborts ("free(): invalid pointer", "double free") or hangs in
    backward. Wider layers are fine.
    """
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Conv2d)
        and m.kernel_size == (1, 1)
        and max(m.stride) > 1
        and m.in_channels < 8
    ]
