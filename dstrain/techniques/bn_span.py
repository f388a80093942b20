"""BN span ("ghost batch norm", Hoffer et al. 2017): batch statistics over a fixed number of images.

A 2,048-GPU record run normalises each BN layer over the images of one GPU (Goyal 32, Fujitsu 42);
one device training the same global batch in micro batches of 256 would normalise over 256 and
train a different network. ``model.bn_span=N`` makes every 2-D BN layer split its training input
into consecutive groups of N images and normalise each group with that group's own mean and
variance: a micro batch of k x N images gives exactly what k separate BN calls of N images give,
outputs, gradients and running statistics (updated once per group, in batch order, as k
successive calls update them; with ``momentum=None`` the cumulative average over groups).
Evaluation is unchanged (running statistics). Parameters and buffers keep their names, so
checkpoints load with or without a span. A batch that is not a multiple of N ends in a smaller
last group (the polish refit's last batch), as ``torch.split`` would cut it.

Two ways, the same arithmetic. On a GPU, and for NCHW inputs, the groups are normalised by one call
of the native BN kernel (groups as extra channels): the numerics of the ordinary layer, cuDNN on a
GPU, at the cost of a reshuffling copy each way. On a CPU with channels_last inputs (the layout the
trainer uses there) those copies and ATen's NHWC kernel at k x C channels cost more than the
normalisation, so :class:`NhwcGroupNorm` normalises the groups where they lie, NHWC memory read as
(k, m*H*W, C), with BN's own backward: the same values to FP32 rounding, in less time
(``bench/bn_span.py``). Either way FP16/BF16 activations are accumulated in FP32, and the output
keeps the input's dtype and memory format.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SpanBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training-mode statistics are taken over groups of ``span`` images."""

    span: int
    # channels_last on a CPU by NhwcGroupNorm; False: the native kernel there too (bench/bn_span.py
    # times the two)
    cpu_in_place: bool = True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, span={self.span}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if not self.training or n <= self.span:
            return super().forward(x)  # one group: the native kernel, bit for bit
        self._check_input_dim(x)
        full = n - n % self.span
        if full == n:
            return self._groups(x, n // self.span)
        head = self._groups(x[:full], full // self.span)
        return torch.cat([head, self._groups(x[full:], 1)])

    def _groups(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Normalise x (k x m images) as k consecutive groups of m; update the running statistics.

        The groups become channels: (k*m, C, H, W) -> (m, k*C, H, W), one call of the native
        kernel (cuDNN, oneDNN) normalises each (group, channel) over its m*H*W values, as k calls
        would; its running statistics at momentum 1 are each group's mean and unbiased variance."""
        n, c, h, w = x.shape
        m = n // k
        nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        in_place = self.cpu_in_place and nhwc and x.device.type == "cpu"
        if in_place and not torch.compiler.is_compiling():
            return self._groups_in_place(x, k)
        if nhwc:  # stay NHWC: (k, m, H, W, C) -> (m, H, W, k, C), one copy each way
            grouped = x.permute(0, 2, 3, 1).reshape(k, m, h, w, c).permute(1, 2, 3, 0, 4)
            grouped = grouped.reshape(m, h, w, k * c).permute(0, 3, 1, 2)
        else:
            grouped = x.view(k, m, c, h, w).transpose(0, 1).reshape(m, k * c, h, w)
        stats = [None, None]
        if self.track_running_stats:
            like = dict(dtype=self.running_mean.dtype, device=x.device)
            stats = [torch.zeros(k * c, **like), torch.ones(k * c, **like)]
        weight = self.weight.repeat(k) if self.affine else None
        bias = self.bias.repeat(k) if self.affine else None
        y = F.batch_norm(grouped, stats[0], stats[1], weight, bias, True, 1.0, self.eps)
        if nhwc:
            y = y.permute(0, 2, 3, 1).reshape(m, h, w, k, c).permute(3, 0, 1, 2, 4)
            y = y.reshape(n, h, w, c).permute(0, 3, 1, 2)
        else:
            y = y.view(m, k, c, h, w).transpose(0, 1).reshape(n, c, h, w)
        if self.track_running_stats:
            self._update_running(stats[0].view(k, c), stats[1].view(k, c), k)
        return y

    def _groups_in_place(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """:meth:`_groups` for a channels_last CPU input, by :class:`NhwcGroupNorm`."""
        c = x.shape[1]
        weight = self.weight if self.affine else torch.ones(c, device=x.device)
        bias = self.bias if self.affine else torch.zeros(c, device=x.device)
        y, mean, var = NhwcGroupNorm.apply(x, weight, bias, k, self.eps)
        if self.track_running_stats:
            size = x.numel() // (k * c)  # the values each (group, channel) is normalised over
            self._update_running(mean.view(k, c), var.view(k, c) * (size / (size - 1)), k)
        return y

    @torch.no_grad()
    def _update_running(self, means: torch.Tensor, unbiased: torch.Tensor, k: int) -> None:
        """k successive updates r <- (1 - a) r + a s, in closed form (a: momentum, or 1/t for the
        cumulative average with ``momentum=None``)."""
        t0 = int(self.num_batches_tracked.item()) if self.momentum is None else 0
        self.num_batches_tracked.add_(k)
        acc = torch.promote_types(self.running_mean.dtype, torch.float32)  # FP64 buffers stay FP64
        if self.momentum is None:  # cumulative average: r = (t0 r + sum s) / (t0 + k)
            keep = t0 / (t0 + k)
            weights = torch.full((k, 1), 1.0 / (t0 + k), device=means.device, dtype=acc)
        else:
            a = float(self.momentum)
            keep = (1.0 - a) ** k
            powers = torch.arange(k - 1, -1, -1, device=means.device, dtype=acc)
            weights = (a * (1.0 - a) ** powers).view(k, 1)
        for running, stats in ((self.running_mean, means), (self.running_var, unbiased)):
            update = keep * running.to(acc) + (weights * stats.to(acc)).sum(0)
            running.copy_(update.to(running.dtype))


class NhwcGroupNorm(torch.autograd.Function):
    """Batch norm of a channels_last ``x`` (N, C, H, W) in ``k`` consecutive groups of images,
    computed where the groups lie: NHWC memory is (k, L, C) with L = N/k*H*W, a view. Each (group,
    channel) is normalised over its L values with its own mean and biased variance, then scaled by
    ``weight`` and shifted by ``bias`` (C each). Returns the output (a new channels_last tensor of
    x's dtype) and each group's mean and biased variance (FP32 or FP64, (k, 1, C), not
    differentiated). Forward: the mean, then the variance of the centred values (two passes, as a
    BN kernel's); backward, with d = x - mean and r = 1/sqrt(var + eps), BN's gradient per group:
    dx = w r (dy - mean_L(dy) - d r² mean_L(dy d)), dweight = Σ_k r Σ_L dy d, dbias = Σ_k Σ_L dy.
    The arithmetic is in FP32 for FP16/BF16/FP32 inputs, in FP64 for FP64 ones. Once
    differentiable (no double backward: a run never takes one; the native way allows it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, k, eps):
        c = x.shape[1]
        acc = torch.promote_types(x.dtype, torch.float32)
        groups = x.permute(0, 2, 3, 1).reshape(k, -1, c).to(acc)  # a view, or a copy in FP32
        size = groups.shape[1]
        mean = groups.sum(1, keepdim=True) / size
        centred = groups - mean
        var = (centred * centred).sum(1, keepdim=True) / size
        rstd = torch.rsqrt(var + eps)
        # a tensor of its own (not a view), channels_last as x: an in-place ReLU may follow
        out = torch.empty_like(x)
        out_groups = out.permute(0, 2, 3, 1).view(k, -1, c)
        scale = rstd * weight.to(acc)
        if out.dtype == acc:
            torch.addcmul(bias.to(acc), centred, scale, out=out_groups)
        else:
            out_groups.copy_(torch.addcmul(bias.to(acc), centred, scale))
        # what the backward needs: the centred values, or for FP16/BF16 inputs the input and the
        # mean (half the memory; the centring done again)
        ctx.save_for_backward(centred if x.dtype == acc else x, mean, rstd, weight)
        ctx.k = k
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, _dmean, _dvar):
        saved, mean, rstd, weight = ctx.saved_tensors
        acc = mean.dtype
        n, c, h, w = dy.shape
        k = ctx.k
        if saved.dim() == 4:  # the FP16/BF16 input
            saved = saved.permute(0, 2, 3, 1).reshape(k, -1, c).to(acc) - mean
        centred, size = saved, saved.shape[1]
        g = dy.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(k, -1, c)
        g = g.to(acc)
        sum_dy = g.sum(1, keepdim=True)
        sum_dy_centred = (g * centred).sum(1, keepdim=True)
        scale = rstd * weight.to(acc)
        dx = torch.addcmul(-scale * sum_dy / size, g, scale)
        dx = torch.addcmul(dx, centred, -scale * rstd * rstd * sum_dy_centred / size)
        dx = dx.to(dy.dtype).view(n, h, w, c).permute(0, 3, 1, 2)  # channels_last, as x
        dweight = (sum_dy_centred * rstd).sum(0).view(-1).to(weight.dtype)
        return dx, dweight, sum_dy.sum(0).view(-1).to(weight.dtype), None, None


def apply_bn_span(model: nn.Module, span: int) -> int:
    """Give every ``BatchNorm2d`` of ``model`` batch statistics over ``span`` images, in place;
    returns how many layers. ``span=0`` leaves the model as it is (statistics over the micro batch)."""
    if span <= 0:
        return 0
    count = 0
    for m in model.modules():
        if type(m) in (nn.BatchNorm2d, SpanBatchNorm2d):
            m.__class__ = SpanBatchNorm2d  # the same object: parameters, buffers, hooks, optimizer
            m.span = span
            count += 1
    return count


def span_of(module: nn.Module) -> int:
    """The span of a BN layer, 0 for an ordinary one (statistics over its whole input)."""
    return getattr(module, "span", 0)
