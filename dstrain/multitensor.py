"""Helpers shared by the multi-tensor optimizers."""
from __future__ import annotations

import torch

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
