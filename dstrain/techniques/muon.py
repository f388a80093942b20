"""Muon (Jordan et al. 2024) on convolution filters, Nesterov SGD on everything else.

The airbench recipe that set the CIFAR-10 speed record: each convolution filter bank
``[out, in, kh, kw]`` is stepped as the matrix ``[out, in * kh * kw]`` (its logical flattening,
whatever the memory layout) by Muon, every other tensor (BN, biases, the fully connected head) by
momentum SGD. Per filter matrix, with momentum ``mu`` and the scheduled LR ``lr``::

    B = mu * B + (1 - mu) * G                       # torch's Muon keeps the momentum as a lerp
    U = G + mu * (B - G)   (Nesterov)   or   B
    O = NewtonSchulz5(U)                            # ~ the orthogonal factor U V^T of U's SVD
    W = W * (1 - lr * weight_decay)                 # decoupled, as torch's Muon
    W = W - lr * adjust(out, in * kh * kw) * O      # adjust: sqrt(max(1, A/B)) ("original")

This is ``torch.optim.Muon``'s algorithm, coefficients and defaults (torch >= 2.9), step for step:
tests/test_muon.py holds every filter's step to torch's Muon run on the flattened matrix. torch's
own class takes only 2-D parameters, and a 2-D view of a filter cannot be handed to it once for
the run: DeepSpeed's precision wrappers replace the parameters an optimizer holds. So the filters
are flattened at each step, from the parameters the optimizer holds then.

The rest, per tensor: ``v = m v + g + wd w`` and ``w -= lr' (g + wd w + m v)`` with Nesterov
(``torch.optim.SGD``'s form), at ``lr' = lr * sgd_lr_factor`` (airbench steps the two parts at
different LRs). Weight decay applies to the filters and the head, not to BN and biases.
"""

from __future__ import annotations

import math

import torch

from dstrain.techniques.multitensor import GroupwiseOptimizer

ADJUST_LR = ("original", "match_rms_adamw", "spectral_unclamped", "none")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
NS_EPS = 1e-7


def is_filter(p: torch.Tensor) -> bool:
    """A convolution's filter bank (1-D, 2-D or 3-D convolution): stepped by Muon."""
    return p.ndim >= 3


def newton_schulz(
    g: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS
) -> torch.Tensor:
    """The orthogonalised matrix of ``g`` by ``steps`` quintic Newton-Schulz iterations in bfloat16,
    as torch's Muon computes it (the wider side kept as columns)."""
    a, b, c = coefficients
    x = g.to(dtype=torch.bfloat16, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str, rows: int, cols: int) -> float:
    if how == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if how == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    return lr


class Muon(GroupwiseOptimizer):
    """Muon for the groups marked ``"muon": True`` (filters), Nesterov SGD for the others."""

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr: str = "original",
        sgd_momentum: float = 0.9,
        sgd_nesterov: bool = True,
    ):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or not 0 <= sgd_momentum < 1:
            raise ValueError("Muon: lr and weight_decay must be >= 0, the momenta in [0, 1)")
        if not 0 < ns_steps < 100:
            raise ValueError(f"Muon: ns_steps={ns_steps} must be in [1, 100)")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Muon: adjust_lr={adjust_lr!r}: use one of {', '.join(ADJUST_LR)}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
            sgd_momentum=sgd_momentum,
            sgd_nesterov=sgd_nesterov,
            muon=False,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] and not all(is_filter(p) for p in group["params"]):
                raise ValueError("Muon: a group marked muon holds a tensor that is not a filter")

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        if group["muon"]:
            self._muon(group, params)
        else:
            self._sgd(group, params)

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in params:
            g = p.grad.reshape(p.shape[0], -1)  # the logical flattening (a copy if channels_last)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    g, memory_format=torch.contiguous_format
                )
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            update = g.lerp(buf, mu) if group["nesterov"] else buf
            update = newton_schulz(update, group["ns_steps"])
            p.mul_(1 - lr * wd)
            step = adjusted_lr(lr, group["adjust_lr"], *g.shape)
            p.add_(update.reshape(p.shape).to(p.dtype), alpha=-step)

    def _sgd(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, m, wd = group["lr"], group["sgd_momentum"], group["weight_decay"]
        for p in params:
            g = p.grad.add(p, alpha=wd) if wd else p.grad
            if m:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = g.detach().clone()
                else:
                    state["momentum_buffer"].mul_(m).add_(g)
                buf = state["momentum_buffer"]
                g = g.add(buf, alpha=m) if group["sgd_nesterov"] else buf
            p.add_(g, alpha=-lr)


def muon_groups(groups: list[dict], sgd_lr_factor: float) -> list[dict]:
    """:func:`dstrain.techniques.optim.param_groups`' groups for Muon: the filters of the weight
    group in a group of their own (``"muon": True``), its other tensors (the head) and the BN/bias
    group stepped by SGD at ``sgd_lr_factor`` times their LR."""
    out = []
    for group in groups:
        filters = [p for p in group["params"] if is_filter(p)]
        others = [p for p in group["params"] if not is_filter(p)]
        if filters:
            out.append({**group, "params": filters, "muon": True})
        if others:
            factor = group.get("lr_factor", 1.0) * sgd_lr_factor
            out.append({**group, "params": others, "muon": False, "lr_factor": factor})
    return out
