"""Dynamic loss scaling on DeepSpeed's engines: the current scale, and the multiply DeepSpeed 0.19 forgets.

Two engines scale FP16 losses (docs/gpu.md): ``torch_autocast`` float16, whose GradScaler the engine
applies in ``backward``, and the native engine (``fp16.enabled``), whose optimizer wrapper
(``FP16_UnfusedOptimizer`` for a client optimizer, ``FP16_Optimizer`` for FusedAdam) divides every
gradient by the loss scale in ``step()``. In DeepSpeed 0.19.8 ``engine.backward`` multiplies the loss
by the scale only for ZeRO optimizers and the GradScaler: with ZeRO stage 0 the native engine's
gradients are divided by a scale nobody multiplied them with, so each update is 65,536x too small
and the weights do not move (the first H100 run: ResNet-50's loss 6.9231 -> 6.9232 in 40 steps;
DeepSpeed PR #8393, open). :func:`backward_multiplier` names the scale dstrain multiplies the loss by
itself in that case; ``tests/test_loss_scaling.py`` trains the real engine on the CPU and fails
both ways, if the workaround is missing and if a DeepSpeed that fixed the bug scales twice.
"""

from __future__ import annotations

from collections.abc import Callable


def loss_scale_of(engine) -> float | None:
    """The current dynamic loss scale (DeepSpeed's fp16 engine, or the GradScaler of its
    ``torch_autocast`` float16 path); None for precisions without one. A GradScaler keeps the
    scale on the device: reading it waits for the GPU, so call it where the loop syncs anyway."""
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is not None:
        return float(scaler.get_scale())
    optimizer = engine.optimizer
    config = getattr(
        optimizer, "loss_scale_config", None
    )  # DeepSpeed 0.19's fp16 wrappers (ZeRO 0)
    if config is not None:
        return float(config.cur_scale) if config.use_grad_scaling else None
    scaler = getattr(optimizer, "loss_scaler", None)  # ZeRO stages 1-3
    scale = getattr(scaler, "cur_scale", None) if scaler is not None else None
    return float(scale) if scale is not None else None


def backward_multiplier(engine) -> Callable[[], float] | None:
    """What to multiply the loss by before ``engine.backward`` (a function of no arguments: the scale
    changes after every overflow), or None where the engine scales the loss itself.

    That is the native fp16 engine without ZeRO: its wrapper keeps the scale in a plain Python float
    (``loss_scale_config.cur_scale``), so reading it costs no host synchronisation."""
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return None  # the engine applies its GradScaler
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, ZeROOptimizer):
        return None  # engine.backward calls its scale_if_loss
    config = getattr(optimizer, "loss_scale_config", None)
    if config is None or not config.use_grad_scaling:
        return None  # FP32, or a wrapper without FP16 loss scaling
    return lambda: config.cur_scale


def scale_in_force(engine):
    """The loss scale the current step's gradients carry, without a host sync: the GradScaler's
    scale tensor (torch_autocast float16), the native fp16 engine's float, or 1.0."""
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is not None:
        return scaler._scale if scaler._scale is not None else 1.0  # a device tensor
    config = getattr(getattr(engine, "optimizer", None), "loss_scale_config", None)
    if config is not None and config.use_grad_scaling:
        return config.cur_scale
    return 1.0
