"""BN groups across ranks (``model.bn_group=K``): batch statistics reduced over K consecutive ranks.

NVIDIA's MLPerf ResNet submissions normalise each BN layer over a group of GPUs (``bn_group`` 2, 4
or 8, within a node) when the per-GPU batch is small: MLPerf logs the images a BN layer normalises
over as ``model_bn_span`` = the per-GPU batch x the group. ``model.bn_group=K`` does the same here:
ranks ``g*K ... g*K+K-1`` form group ``g``; in training mode each BN layer's mean and variance are
those of the group's whole batch, and its backward reduces the two gradient sums the statistics
need over the group too, so a group of K ranks trains exactly as one rank holding the group's
images would (``tests/test_bn_group.py`` checks outputs, running statistics and every gradient
against that, in FP64). K = 1 is the ordinary layer; K = the world size is full SyncBN.

With ``model.bn_span=S`` (dstrain/techniques/bn_span.py) each rank's micro batch is cut into groups
of S images first, and the j-th group of every rank of the BN group is normalised together: the
statistics span K x S images (K x the micro batch without a span). Evaluation uses the running
statistics, unchanged. Running statistics are updated as the span updates them, from the group's
statistics, so every rank of a group holds the same running statistics.

Communication per BN layer and training step (per span group): forward, one all-gather of the
rank's count, per-channel means and centred sums of squares (2C + 1 numbers per rank); backward,
one all-reduce of two per-channel sums (2C numbers). docs/large-batch.md sets that beside the
gradient all-reduce; bench/bn_group.py measures it.

The statistics are taken in FP32 (FP64 inputs: FP64) around each rank's own mean and combined with
Chan's parallel formula, so no sum of squares cancels; the output keeps the input's dtype and memory
format. Outside a process group, or with ``local`` set (:func:`grouped_locally`: the BN refit of
Final Polishing, which must not meet a collective on a rank that has fewer batches than its
peers), a layer normalises its own input in chunks of K x S images: the same statistics a group
of K ranks computes for K consecutive chunks of S.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from dstrain.techniques.bn_span import SpanBatchNorm2d

log = logging.getLogger(__name__)


def _stats(x: torch.Tensor, k: int, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (chunk, channel) mean and centred sum of squares of x cut into k chunks along the batch."""
    n, c, h, w = x.shape
    xs = x.view(k, n // k, c, h, w).to(acc)
    mean = xs.mean((1, 3, 4))
    m2 = (xs - mean.view(k, 1, c, 1, 1)).square().sum((1, 3, 4))
    return mean, m2


def _chunk_sums(t: torch.Tensor, k: int) -> torch.Tensor:
    """Per (chunk, channel) sums of an (n, C, H, W) tensor cut into k chunks along the batch."""
    n, c, h, w = t.shape
    return t.reshape(k, n // k, c, h, w).sum((1, 3, 4))


def _per_image(t: torch.Tensor, n: int) -> torch.Tensor:
    """A (k, C) per-chunk value broadcast to (n, C, 1, 1): each image gets its chunk's."""
    k, c = t.shape
    return t.repeat_interleave(n // k, dim=0).view(n, c, 1, 1)


class _GroupNorm(torch.autograd.Function):
    """Batch norm of k chunks per rank, each chunk's statistics over the same chunk of every rank of
    ``group`` (the autograd function; :class:`GroupBatchNorm2d` is the layer). Outputs are computed
    in the input's own shape (a fresh tensor, so an in-place ReLU after it is allowed)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, k, group, size):
        n, c, h, w = x.shape
        acc = torch.promote_types(x.dtype, torch.float32)
        if k == 1:  # one chunk a rank (no span): one fused pass each way (var_mean, BN's kernels)
            xa = x if x.dtype == acc else x.to(acc)
            var, mean = torch.var_mean(xa, dim=(0, 2, 3), correction=0)
            mean, m2 = mean.view(1, c), (var * (n * h * w)).view(1, c)
        else:
            mean, m2 = _stats(x, k, acc)
        count = float(n // k * h * w)
        mine = torch.cat([mean.flatten(), m2.flatten(), mean.new_tensor([count])])
        every = [torch.empty_like(mine) for _ in range(size)]
        tdist.all_gather(every, mine, group=group)
        gathered = torch.stack(every)  # (ranks, 2kC + 1)
        means = gathered[:, : k * c].view(size, k, c)
        m2s = gathered[:, k * c : 2 * k * c].view(size, k, c)
        counts = gathered[:, -1].view(size, 1, 1)
        total = counts.sum(0)  # (1, 1)
        g_mean = (counts * means).sum(0) / total  # Chan et al.: exact, no cancellation
        g_m2 = m2s.sum(0) + (counts * (means - g_mean).square()).sum(0)
        invstd = torch.rsqrt(g_m2 / total + eps)
        if k == 1:  # normalise with the group's statistics: the native kernel in inference form
            w_acc = weight.to(acc) if weight is not None else None
            b_acc = bias.to(acc) if bias is not None else None
            y = F.batch_norm(xa, g_mean[0], g_m2[0] / total[0], w_acc, b_acc, False, 0.0, eps)
        else:
            y = (x.to(acc) - _per_image(g_mean, n)) * _per_image(invstd, n)
            if weight is not None:
                y = y * weight.to(acc).view(1, c, 1, 1) + bias.to(acc).view(1, c, 1, 1)
        ctx.save_for_backward(x, weight, g_mean, invstd, g_m2 / total)
        ctx.eps = eps
        # the group's count stays a tensor: float() would wait for the device every layer
        ctx.k, ctx.group, ctx.total = k, group, total.reshape(())
        unbiased = g_m2 / (total - 1).clamp(min=1)
        ctx.mark_non_differentiable(g_mean, unbiased)
        return y.to(x.dtype), g_mean, unbiased

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, g_mean, invstd, biased = ctx.saved_tensors
        k, group = ctx.k, ctx.group
        n, c = x.shape[:2]
        acc = g_mean.dtype
        if k == 1:
            return _backward_one_chunk(ctx, dy, x, weight, g_mean[0], invstd[0], biased[0])
        inv = _per_image(invstd, n)
        xhat = (x.to(acc) - _per_image(g_mean, n)) * inv
        g = dy.to(acc)
        sums = torch.stack([_chunk_sums(g, k), _chunk_sums(g * xhat, k)])  # (2, k, C)
        d_weight = sums[1].sum(0) if weight is not None else None  # this rank's share
        d_bias = sums[0].sum(0) if weight is not None else None
        dx = None
        if ctx.needs_input_grad[0]:
            tdist.all_reduce(sums, group=group)  # the group's sums
            scale = inv / ctx.total
            if weight is not None:
                scale = scale * weight.to(acc).view(1, c, 1, 1)
            dx = scale * (ctx.total * g - _per_image(sums[0], n) - xhat * _per_image(sums[1], n))
            dx = dx.to(x.dtype)
        if weight is not None:
            d_weight, d_bias = d_weight.to(weight.dtype), d_bias.to(weight.dtype)
        return dx, d_weight, d_bias, None, None, None, None


def _backward_one_chunk(ctx, dy, x, weight, mean, invstd, var):
    """The backward of one chunk a rank through BN's own backward kernel in inference form (it
    gives g w invstd and this rank's two sums in one pass), corrected by the group's sums:
    dx = w invstd (g - S1/N - xhat S2/N), written as g w invstd - (A x + B) per channel."""
    c, acc = x.shape[1], mean.dtype
    xa, g = x.to(acc), dy.to(acc)
    w = weight.to(acc) if weight is not None else torch.ones(c, dtype=acc, device=x.device)
    dx, s2, s1 = torch.ops.aten.native_batch_norm_backward(
        g, xa, w, mean, var, None, None, False, ctx.eps, [True, True, True]
    )
    d_weight, d_bias = s2.clone(), s1.clone()  # this rank's shares
    if ctx.needs_input_grad[0]:
        sums = torch.stack([s1, s2])
        tdist.all_reduce(sums, group=ctx.group)  # the group's sums
        scale = w * invstd / ctx.total
        a = scale * invstd * sums[1]
        b = scale * (sums[0] - mean * invstd * sums[1])
        dx = torch.addcmul(dx - b.view(1, c, 1, 1), xa, a.view(1, c, 1, 1), value=-1)
        dx = dx.to(x.dtype)
    else:
        dx = None
    if weight is None:
        return dx, None, None, None, None, None, None
    return dx, d_weight.to(weight.dtype), d_bias.to(weight.dtype), None, None, None, None


class GroupBatchNorm2d(SpanBatchNorm2d):
    """``nn.BatchNorm2d`` whose training-mode statistics are reduced over a group of ranks (and, with
    a span, over each rank's chunks of ``span`` images)."""

    group_size: int
    process_group: object  # the torch.distributed group of this rank, or None: normalise locally
    local: bool  # normalise locally in chunks of group_size x span (the BN refit)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return nn.BatchNorm2d.forward(self, x)
        if self.local or self.process_group is None:
            return self._local(x)
        self._check_input_dim(x)
        n = x.shape[0]
        k = n // self.span if self.span else 1
        if self.span and n % self.span:
            raise ValueError(
                f"BN group: a training batch of {n} images is not a multiple of model.bn_span="
                f"{self.span}; the ranks of a group must cut their batches alike"
            )
        y, means, unbiased = _GroupNorm.apply(
            x,
            self.weight if self.affine else None,
            self.bias if self.affine else None,
            self.eps,
            k,
            self.process_group,
            self.group_size,
        )
        if self.track_running_stats:
            self._update_running(means.detach(), unbiased.detach(), k)
        return y

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """The group's statistics emulated on one rank: chunks of group_size x span images (the
        whole input without a span), as the span layer normalises them."""
        chunk = self.group_size * self.span if self.span else x.shape[0]
        span = self.span
        try:
            self.span = chunk
            return SpanBatchNorm2d.forward(self, x)
        finally:
            self.span = span


def apply_bn_group(model: nn.Module, group_size: int) -> int:
    """Make every ``BatchNorm2d`` of ``model`` a group layer of ``group_size`` ranks (without a
    process group until :func:`join_groups`: it normalises locally, as the group would), in place,
    keeping its span; returns how many layers. ``group_size`` 1 leaves the model as it is."""
    if group_size <= 1:
        return 0
    count = 0
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            span = getattr(m, "span", 0)
            m.__class__ = GroupBatchNorm2d  # the same object: parameters, buffers, optimizer
            m.span, m.group_size, m.process_group, m.local = span, group_size, None, False
            count += 1
    return count


def join_groups(model: nn.Module) -> int:
    """Give the group layers of ``model`` this rank's process group (after the job's process group
    is up; every rank must call it); returns the group size (1: no group layers)."""
    layers = [m for m in model.modules() if isinstance(m, GroupBatchNorm2d)]
    if not layers:
        return 1
    size = layers[0].group_size
    group = rank_groups(size)
    for m in layers:
        m.process_group = group
    log.info(
        "BN groups: %d BatchNorm2d layers normalise over ranks %d-%d (groups of %d consecutive ranks)",
        len(layers),
        tdist.get_rank() // size * size,
        tdist.get_rank() // size * size + size - 1,
        size,
    )
    return size


def rank_groups(group_size: int) -> object:
    """This rank's group of ``group_size`` consecutive ranks; every rank creates every group, in
    order, as ``torch.distributed.new_group`` requires."""
    world, rank = tdist.get_world_size(), tdist.get_rank()
    mine = None
    for first in range(0, world, group_size):
        group = tdist.new_group(list(range(first, first + group_size)))
        if first <= rank < first + group_size:
            mine = group
    return mine


@contextlib.contextmanager
def grouped_locally(model: nn.Module) -> Iterator[int]:
    """Inside: every group layer normalises its own input in chunks of group x span images, no
    collective (the BN refit, dstrain/techniques/bn_refit.py); yields the group size (1: none)."""
    layers = [m for m in model.modules() if isinstance(m, GroupBatchNorm2d)]
    for m in layers:
        m.local = True
    try:
        yield max((m.group_size for m in layers), default=1)
    finally:
        for m in layers:
            m.local = False
