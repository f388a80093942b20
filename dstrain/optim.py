"""Client optimizers built from the DeepSpeed JSON ``optimizer`` block.

The trainer builds the optimizer itself so that parameter groups can be chosen
by tensor shape: tensors with ``ndim <= 1`` (BN gamma/beta, biases) get no
weight decay (Goyal et al.). The result is handed to ``deepspeed.initialize``
as the client optimizer, so DeepSpeed's precision wrappers, clipping and
checkpointing apply as usual.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from dstrain.config import ConfigError

log = logging.getLogger("dstrain")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    log.info("param groups: %d tensors with weight decay %.3g, %d BN/bias tensors without",
             len(decay), weight_decay, len(no_decay))
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _sgd(groups, lr, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0):
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, dampening=dampening)


def _adamw(groups, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)


def _adam(groups, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    return torch.optim.Adam(groups, lr=lr, betas=tuple(betas), eps=eps)


# JSON "type" (lower-cased) -> builder(groups, **params). Issue 3 adds LARS and LAMB here.
OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw, "adam": _adam}


def build_optimizer(model: torch.nn.Module, spec: dict | None, source: str = "optimizer") -> tuple[torch.optim.Optimizer, float]:
    """(optimizer, base LR per reference batch) from a JSON optimizer block."""
    spec = spec or {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-5}}
    kind = str(spec.get("type", "")).lower()
    if kind not in OPTIMIZERS:
        raise ConfigError(f"{source}: optimizer type {spec.get('type')!r} is not supported; "
                          f"use one of {', '.join(sorted(OPTIMIZERS))} (case-insensitive)")
    params = dict(spec.get("params", {}))
    if "lr" not in params:
        raise ConfigError(f"{source}: optimizer.params.lr is missing (the LR per optim.lr_reference_batch images)")
    try:
        opt = OPTIMIZERS[kind](param_groups(model, float(params.get("weight_decay", 0.0))), **params)
    except TypeError as err:
        raise ConfigError(f"{source}: optimizer.params for {spec['type']}: {err}") from None
    return opt, float(params["lr"])


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@contextlib.contextmanager
def steps_suppressed(optimizer: torch.optim.Optimizer):
    """Make ``optimizer.step()`` a no-op inside the block.

    DeepSpeed's FP16/BF16 wrapper (no ZeRO) calls the client optimizer's step once
    with all-zero gradients during ``deepspeed.initialize``; with weight decay that
    moves the weights and seeds the momentum before training starts. Wrapping
    ``initialize`` in this block makes that call harmless.
    """
    def skipped_step(closure=None):
        log.debug("optimizer step suppressed (DeepSpeed initialize)")
        return None

    optimizer.step = skipped_step  # instance attribute shadows the class method
    try:
        yield optimizer
    finally:
        del optimizer.step
