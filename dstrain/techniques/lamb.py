"""LAMB (You et al. 2019) with multi-tensor (``torch._foreach_*``) ops.

The CPU stand-in for DeepSpeed's fused ``Lamb`` (a CUDA op), with the formula of
../shared/METHODS.md section 3::

    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
    r = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * w
    ratio = clamp(||w|| / ||r||, min_coeff, max_coeff)   # 1 if either norm is 0
    w = w - lr * ratio * r

A group with ``"lars_exclude": True`` (BN, biases) gets no weight decay and ratio 1
(plain Adam). ``max_coeff``/``min_coeff`` mirror DeepSpeed's FusedLamb clamping.
"""

from __future__ import annotations

import torch

from dstrain.techniques.multitensor import GroupwiseOptimizer, chunks


class LAMB(GroupwiseOptimizer):
    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        bias_correction: bool = True,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError("LAMB: lr, eps, weight_decay must be >= 0 and betas in [0, 1)")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            bias_correction=bias_correction,
            lars_exclude=False,
        )
        super().__init__(params, defaults)

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        exp_avg, exp_avg_sq = [], []
        for p in params:  # state lookup only
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            exp_avg.append(state["exp_avg"])
            exp_avg_sq.append(state["exp_avg_sq"])
        t = self.state[params[0]]["step"]
        for lo, hi in chunks(params):
            self._update(params[lo:hi], grads[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], t, group)

    @staticmethod
    def _update(params, grads, exp_avg, exp_avg_sq, t: int, group: dict) -> None:
        b1, b2 = group["betas"]
        torch._foreach_lerp_(exp_avg, grads, 1 - b1)  # m = b1*m + (1-b1)*g
        torch._foreach_mul_(exp_avg_sq, b2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - b2)
        c1, c2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
        denom = torch._foreach_div(exp_avg_sq, c2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avg, c1)
        torch._foreach_div_(update, denom)  # r without weight decay
        if group["lars_exclude"]:
            torch._foreach_add_(params, update, alpha=-group["lr"])
            return
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        w_norm = torch.stack(torch._foreach_norm(params))
        r_norm = torch.stack(torch._foreach_norm(update))
        clamped = (w_norm / r_norm).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((w_norm > 0) & (r_norm > 0), clamped, torch.ones_like(w_norm))
        torch._foreach_mul_(update, (ratio * -group["lr"]).unbind(0))
        torch._foreach_add_(params, update)
