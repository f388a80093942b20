"""LARS (You, Gitman, Ginsburg 2017) with multi-tensor (``torch._foreach_*``) ops.

Per parameter tensor, with weight decay ``beta`` and trust coefficient ``eta``::

    trust = eta * ||w|| / (||g|| + beta_T * ||w|| + eps)   # 1 if ||w|| == 0 or ||g|| == 0
    trust = min(trust / lr, 1)                             # only with LARC clipping
    trust = min(trust, trust_clip)                         # only with a cap (trust_clip > 0)
    v     = m' * v + lr * trust * (g + beta * w)
    w     = w - v

``beta_T``, the weight decay inside the trust ratio, is ``beta`` (the MLPerf TF reference, NVIDIA),
or, with ``"trust_decay": "weight_decay_x_peak_lr"``, ``beta`` times the run's peak LR (Fujitsu's
MLPerf v0.6 code passes ``wd * lr0`` to a kernel that uses it as is in the denominator, which bounds
the ratio by ``eta / (beta * lr0)``: 3.85 at their 13.0 and 5e-5); the trainer sets it
(``optim.apply_schedule``). ``m'`` is the momentum, or with ``momentum_correction`` the momentum
times ``lr_t / lr_{t-1}`` (Goyal et al.'s correction, in NVIDIA's MLPerf LARS): the velocity
holds the LR, so a changing LR would otherwise weight old gradients by old LRs.

A parameter group with ``"lars_exclude": True`` (the trainer puts tensors with
``ndim <= 1`` there: BN gamma/beta and biases) gets no weight decay and trust 1,
i.e. plain momentum SGD. The whole step is a fixed number of foreach calls per
group and chunk (see ``dstrain/techniques/multitensor.py``), whatever the number of tensors.
:meth:`LARS.trust_summary` gives the last step's per-tensor trust ratios (min, median, max) for
the log; it reads them from the device only when called.

timm's ``Lars`` applies the LR after the momentum (``v = m*v + trust*g; w -= lr*v``);
this is the paper's form, with the LR inside the momentum. The two agree while the
LR is constant and differ while it changes (warmup, decay).
"""

from __future__ import annotations

import torch

from dstrain.core.hooks import Hook
from dstrain.techniques.multitensor import GroupwiseOptimizer, chunks

TRUST_DECAY = ("weight_decay", "weight_decay_x_peak_lr")


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
        *,
        trust_clip: float = 0.0,
        trust_decay: str = "weight_decay",
        momentum_correction: bool = False,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError(
                "LARS: lr, momentum, weight_decay, eps must be >= 0 and trust_coefficient > 0"
            )
        if trust_clip < 0 or trust_decay not in TRUST_DECAY:
            raise ValueError(f"LARS: trust_clip must be >= 0, trust_decay one of {TRUST_DECAY}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            larc_clip=larc_clip,
            trust_clip=trust_clip,
            trust_decay=trust_decay,
            momentum_correction=momentum_correction,
            lars_exclude=False,
        )
        super().__init__(params, defaults)
        self._trust: list[torch.Tensor] = []  # the last step's trust ratios, on the device
        # diagnosis (log.lars_tensors): each tensor's trust and step size of the last step
        self.record_tensors = False
        self._tensors: list[tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]] = []

    def step(self, closure=None):
        self._trust = []
        self._tensors = []
        return super().step(closure)

    def tensor_stats(self) -> list[tuple[torch.Tensor, float | None, float]]:
        """The last step, per tensor (with ``record_tensors`` on): the parameter, its trust ratio
        (None for BN/bias, which take plain SGD steps) and ``||step|| / ||w||``, the relative
        size of its update, where a blow-up starts. Copies from the device: call where the loop
        syncs."""
        out = []
        for params, trust, ratio in self._tensors:
            trusts = trust.float().cpu().tolist() if trust is not None else [None] * len(params)
            out += zip(params, trusts, ratio.float().cpu().tolist(), strict=True)
        return out

    def trust_summary(self) -> dict | None:
        """min / median / max of the last step's per-tensor trust ratios (None before a step, or
        when every tensor is excluded). One device-to-host copy: call it where the loop syncs."""
        if not self._trust:
            return None
        t = torch.cat(self._trust).float().cpu()
        return {
            "trust_min": t.min().item(),
            "trust_median": t.median().item(),
            "trust_max": t.max().item(),
        }

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        bufs = []
        if group["momentum"]:
            for p in params:  # state lookup only; no tensor math per parameter
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
        momentum = group["momentum"]
        # .get: a checkpoint saved before these settings existed loads groups without them
        if group.get("momentum_correction", False):
            previous = group.get("previous_lr")
            if previous:  # the velocity holds the LR: rescale it to the new one
                momentum *= group["lr"] / previous
            group["previous_lr"] = group["lr"]
        for lo, hi in chunks(params):
            chunk = params[lo:hi]
            before = torch._foreach_mul(chunk, 1.0) if self.record_tensors else None
            trust = self._update(chunk, [p.grad for p in chunk], bufs[lo:hi], group, momentum)
            if trust is not None:
                self._trust.append(trust.detach())
            if before is not None:
                w_norm = torch.stack(torch._foreach_norm(before))
                step = torch.stack(torch._foreach_norm(torch._foreach_sub(before, chunk)))
                ratio = torch.where(w_norm > 0, step / w_norm, step)
                self._tensors.append((chunk, None if trust is None else trust.detach(), ratio))

    @staticmethod
    def _update(params, grads, bufs, group: dict, momentum: float) -> torch.Tensor | None:
        lr, wd = group["lr"], group["weight_decay"]
        trust = None
        if group["lars_exclude"]:
            update = torch._foreach_mul(grads, lr)
        else:
            w_norm = torch.stack(torch._foreach_norm(params))
            g_norm = torch.stack(torch._foreach_norm(grads))
            wd_trust = group.get("trust_weight_decay", wd)
            trust = (
                group["trust_coefficient"] * w_norm / (g_norm + wd_trust * w_norm + group["eps"])
            )
            trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
            if group["larc_clip"] and lr > 0:
                trust = torch.clamp(trust / lr, max=1.0)
            if group.get("trust_clip", 0.0) > 0:
                trust = torch.clamp(trust, max=group["trust_clip"])
            scale = (trust * lr).unbind(0)  # 0-d tensors: no host sync
            if wd:
                update = torch._foreach_add(grads, params, alpha=wd)
                torch._foreach_mul_(update, scale)
            else:
                update = torch._foreach_mul(grads, scale)
        if bufs:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, update)
            update = bufs
        torch._foreach_sub_(params, update)
        return trust


class LARSLog(Hook):
    """LARS's numbers on the loop's log lines: at every log line the last step's trust ratios,
    min / median / max over the tensors (``train/trust_*`` and the console's ``trust`` column);
    with ``tensors`` (``log.lars_tensors``) also every tensor's trust ratio and relative step, by
    name (TensorBoard ``lars_trust/*``, ``lars_step/*``), and the three largest steps in the log:
    where a LARS run's instability shows (results/harness/lars_tensors.py reads them)."""

    def __init__(self, tensors: bool = False) -> None:
        self.tensors = tensors

    def fit_start(self, trainer) -> bool:
        trainer.optimizer.record_tensors = self.tensors
        return False

    def window_values(self, trainer) -> dict:
        # a device-to-host copy: the loop calls it where it syncs anyway, for the log line
        return trainer.optimizer.trust_summary() or {}

    def log_window(self, trainer, step: int) -> None:
        optimizer = trainer.optimizer
        stats = optimizer.tensor_stats() if self.tensors else []
        if not stats:
            return
        names = {id(p): name for name, p in trainer.engine.module.named_parameters()}
        named = [(names.get(id(p), "?"), trust, ratio) for p, trust, ratio in stats]
        monitor = trainer.monitor
        monitor.scalars("lars_trust", {n: t for n, t, _ in named if t is not None}, step)
        monitor.scalars("lars_step", {n: r for n, _, r in named}, step)
        largest = sorted(named, key=lambda item: -item[2])[:3]
        monitor.note(
            "largest relative steps: "
            + ", ".join(
                f"{n} {r:.3g}" + ("" if t is None else f" (trust {t:.3g})") for n, t, r in largest
            )
        )
