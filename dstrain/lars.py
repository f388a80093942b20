"""LARS (You, Gitman, Ginsburg 2017) with multi-tensor (``torch._foreach_*``) ops.

Per parameter tensor, with weight decay ``beta`` and trust coefficient ``eta``::

    trust = eta * ||w|| / (||g|| + beta * ||w|| + eps)     # 1 if ||w|| == 0 or ||g|| == 0
    trust = min(trust / lr, 1)                             # only with LARC clipping
    v     = m * v + lr * trust * (g + beta * w)
    w     = w - v

A parameter group with ``"lars_exclude": True`` (the trainer puts tensors with
``ndim <= 1`` there: BN gamma/beta and biases) gets no weight decay and trust 1,
i.e. plain momentum SGD. The whole step is a fixed number of foreach calls per
group and chunk (see ``dstrain/multitensor.py``), whatever the number of tensors.

timm's ``Lars`` applies the LR after the momentum (``v = m*v + trust*g; w -= lr*v``);
this is the paper's form, with the LR inside the momentum. The two agree while the
LR is constant and differ while it changes (warmup, decay).
"""

from __future__ import annotations

import torch

from dstrain.multitensor import GroupwiseOptimizer, chunks


class LARS(GroupwiseOptimizer):
    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        larc_clip: bool = False,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError(
                "LARS: lr, momentum, weight_decay, eps must be >= 0 and trust_coefficient > 0"
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            larc_clip=larc_clip,
            lars_exclude=False,
        )
        super().__init__(params, defaults)

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        bufs = []
        if group["momentum"]:
            for p in params:  # state lookup only; no tensor math per parameter
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
        for lo, hi in chunks(params):
            self._update(params[lo:hi], [p.grad for p in params[lo:hi]], bufs[lo:hi], group)

    @staticmethod
    def _update(params, grads, bufs, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        if group["lars_exclude"]:
            update = torch._foreach_mul(grads, lr)
        else:
            w_norm = torch.stack(torch._foreach_norm(params))
            g_norm = torch.stack(torch._foreach_norm(grads))
            trust = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
            trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
            if group["larc_clip"] and lr > 0:
                trust = torch.clamp(trust / lr, max=1.0)
            scale = (trust * lr).unbind(0)  # 0-d tensors: no host sync
            if wd:
                update = torch._foreach_add(grads, params, alpha=wd)
                torch._foreach_mul_(update, scale)
            else:
                update = torch._foreach_mul(grads, scale)
        if bufs:
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, update)
            update = bufs
        torch._foreach_sub_(params, update)
