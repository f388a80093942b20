"""Helpers shared by the multi-tensor optimizers (LARS, LAMB)."""

from __future__ import annotations

import torch


class GroupwiseOptimizer(torch.optim.Optimizer):
    """``step()`` runs the closure, then ``_step_group(group, params)`` for every group that has
    gradients; subclasses implement the update for one group's list of tensors."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        raise NotImplementedError


CPU_CHUNK_VALUES = 1 << 17  # 512 KiB of fp32 per tensor list: a chunk's working set fits a 2 MiB L2


def chunks(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Index ranges to update together. On GPU: one range (fewest kernel launches). On CPU,
    where a foreach op is a C++ loop over tensors, ranges of ~CPU_CHUNK_VALUES values, so that
    all the step's passes over a chunk run while it is in cache."""
    if params[0].device.type != "cpu":
        return [(0, len(params))]
    out, lo, size = [], 0, 0
    for i, p in enumerate(params):
        size += p.numel()
        if size >= CPU_CHUNK_VALUES:
            out.append((lo, i + 1))
            lo, size = i + 1, 0
    if lo < len(params):
        out.append((lo, len(params)))
    return out
