"""Synthetic batches: made once on the device, no decode or copy cost, for throughput benchmarks."""

from __future__ import annotations

import torch

from dstrain.data.sharding import Output, Shard, ShardedBatches, epoch_steps, val_range


class SyntheticLoader(ShardedBatches):
    """Yields the same device-resident random batch; the epoch length follows the shard's batch arithmetic."""

    def __init__(
        self,
        n: int,
        shape: tuple[int, ...],
        num_classes: int,
        shard: Shard,
        mode: str,
        out: Output = Output(),
    ):
        super().__init__(n, shard, mode)
        device, dtype, channels_last = out.device, out.dtype, out.channels_last
        batch = shard.micro if mode == "train" else shard.eval_batch
        g = torch.Generator().manual_seed(shard.seed * 1024 + shard.rank)
        x = torch.randn((batch, *shape), generator=g).to(device=device, dtype=dtype)
        self.x = (
            x.contiguous(memory_format=torch.channels_last) if channels_last and x.ndim == 4 else x
        )
        self.y = torch.randint(0, num_classes, (batch,), generator=g).to(device)

    def __len__(self) -> int:
        if self.mode == "train":  # read at each epoch: a batch-size ramp changes the accumulation
            shard = self.shard
            steps = epoch_steps(self.n, shard.global_batch, shard.fill, self.offset)
            return steps * shard.accumulation
        return -(-len(val_range(self.n, self.shard.rank, self.shard.world)) // len(self.y))

    def __iter__(self):
        for _ in range(len(self) - self.start):
            yield self.x, self.y
