"""BN groups across ranks (dstrain/techniques/bn_group.py): a group of K ranks trains as one rank
holding the group's whole batch, in FP64 on gloo, 2 and 4 ranks, with and without a span."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from dstrain.core.dist import free_port
from dstrain.techniques.bn_group import (
    GroupBatchNorm2d,
    apply_bn_group,
    grouped_locally,
    join_groups,
)
from dstrain.techniques.bn_refit import refit_bn
from dstrain.techniques.bn_span import apply_bn_span
from tests.conftest import spawn_ranks

MICRO = 8  # images per rank


def _net(span: int = 0, group: int = 1) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),  # as torchvision's ResNets: the layer's output must be its own
        nn.Conv2d(4, 3, 3, padding=1),
        nn.BatchNorm2d(3, momentum=None),  # the cumulative average too
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 5),
    ).double()
    for bn in (model[1], model[4]):  # non-trivial affine parameters
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
    apply_bn_span(model, span)
    apply_bn_group(model, group)
    return model


def _batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(world * MICRO, 2, 5, 5, generator=g, dtype=torch.float64) * 2 + 0.7
    return x, torch.randint(0, 5, (world * MICRO,), generator=g)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Two training forwards (the running statistics move twice) and one backward of the mean loss."""
    x = x.clone().requires_grad_(True)
    model.train()
    model(x)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    out = {name: p.grad.clone() for name, p in model.named_parameters()}
    out.update({name: b.clone() for name, b in model.named_buffers()})
    out["x.grad"], out["loss"] = x.grad.clone(), loss.detach()
    return out


def _worker(rank, world, group, span, channels_last, compiled, port, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _net(span, group)
        assert join_groups(model) == group
        if compiled:  # the group's collectives inside a compiled model (dynamo breaks around them)
            model.compile(dynamic=False)
        x, y = _batch(world)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        xr = x[mine]
        if channels_last:
            xr = xr.contiguous(memory_format=torch.channels_last)
        result = _step(model, xr, y[mine])
        # the data-parallel average of the parameter gradients (DeepSpeed's all-reduce)
        for name, _ in model.named_parameters():
            dist.all_reduce(result[name])
            result[name] /= world
        if world == 2:  # BF16 activations and parameters (DeepSpeed's bf16 engine), NHWC
            out[f"bf16-{rank}"] = _bf16_layer(rank, world)
        out[rank] = result
    finally:
        dist.destroy_process_group()


def _bf16_layer(rank: int, world: int) -> dict:
    """One group layer over the world in BF16: its output, input and weight gradients."""
    torch.manual_seed(1)
    x = torch.randn(world * MICRO, 4, 5, 5, dtype=torch.float64) * 3 + 1
    bn = nn.BatchNorm2d(4)
    nn.init.uniform_(bn.weight, 0.5, 1.5)
    apply_bn_group(bn, world)
    join_groups(bn)
    bn.to(torch.bfloat16).train()
    mine = x[rank * MICRO : (rank + 1) * MICRO].to(torch.bfloat16)
    mine = mine.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    y = bn(mine)
    (y.float() * torch.arange(1.0, 5.0).view(1, 4, 1, 1)).sum().backward()
    return {
        "y": y.detach(),
        "x.grad": mine.grad,
        "x": x.to(torch.bfloat16).double(),
        "w": bn.weight.detach().double(),
        "b": bn.bias.detach().double(),
    }


def _run(world, group, span=0, channels_last=False, compiled=False) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        spawn_ranks(_worker, world, world, group, span, channels_last, compiled, free_port(), out)
        return dict(out)


def _reference(world: int, group: int, span: int) -> list[dict]:
    """Each group's batch on one rank (a span of group x span images, or the group's whole batch);
    the loss is the mean over the group's images, as the group's ranks' averaged losses are."""
    x, y = _batch(world)
    refs = []
    for first in range(0, world, group):
        images = slice(first * MICRO, (first + group) * MICRO)
        xs, ys = x[images], y[images]
        if span:  # chunk j of the group = chunk j of every rank: reorder to consecutive groups
            k = MICRO // span
            order = torch.arange(group * MICRO).view(group, k, span).transpose(0, 1).flatten()
            xs, ys = xs[order], ys[order]
        model = _net(group * span if span else 0)
        ref = _step(model, xs, ys)
        if span:
            back = torch.empty_like(order)
            back[order] = torch.arange(len(order))
            ref["x.grad"] = ref["x.grad"][back]
        refs.append(ref)
    return refs


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,group,span,channels_last,compiled",
    [(2, 2, 0, False, True), (4, 2, 4, False, False), (4, 4, 0, True, False)],
)
def test_a_group_of_ranks_trains_as_one_rank_holding_its_batch(
    world, group, span, channels_last, compiled
):
    out = _run(world, group, span, channels_last, compiled)
    refs = _reference(world, group, span)
    for rank in range(world):
        ref, got = refs[rank // group], out[rank]
        # buffers (running statistics): this group's; x.grad: the group's ranks each back-propagate
        # their own mean loss, so a rank's input gradient is group x the group-mean loss's
        for name, _ in _net(span, group).named_buffers():
            torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-12)
        local = slice((rank % group) * MICRO, (rank % group + 1) * MICRO)
        torch.testing.assert_close(
            got["x.grad"], group * ref["x.grad"][local], rtol=1e-10, atol=1e-12
        )
    # parameter gradients: the average over the world of each group's mean-loss gradient
    for name, _ in _net().named_parameters():
        expected = sum(ref[name] for ref in refs) / len(refs)
        for rank in range(world):
            torch.testing.assert_close(out[rank][name], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_a_bf16_group_layer_keeps_bf16_and_nhwc_and_matches_fp64():
    out = _run(2, 2, 0, False, False)
    # the reference: FP64 BN over both ranks' images, at the BF16-rounded inputs and weights
    x = out["bf16-0"]["x"].clone().requires_grad_(True)
    ref_bn = nn.BatchNorm2d(4).double()
    ref_bn.weight.data, ref_bn.bias.data = out["bf16-0"]["w"], out["bf16-0"]["b"]
    y = ref_bn(x)
    (y * torch.arange(1.0, 5.0, dtype=torch.float64).view(1, 4, 1, 1)).sum().backward()
    for rank in range(2):
        got = out[f"bf16-{rank}"]
        assert got["y"].dtype == torch.bfloat16 and got["x.grad"].dtype == torch.bfloat16
        assert got["y"].is_contiguous(memory_format=torch.channels_last)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        torch.testing.assert_close(got["y"].double(), y[mine].detach(), rtol=0.02, atol=0.02)
        # each rank back-propagates its own sum: the input gradient is the whole batch's
        torch.testing.assert_close(got["x.grad"].double(), x.grad[mine], rtol=0.05, atol=0.02)


def test_without_a_process_group_a_layer_normalises_as_its_group_would():
    """The refit's local mode: chunks of group x span images, the statistics a K-rank group takes."""
    x, y = _batch(4)
    grouped = _net(span=4, group=2)
    reference = _net(span=8)
    with grouped_locally(grouped) as size:
        assert size == 2
        a = _step(grouped, x, y)
    b = _step(reference, x, y)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert all(not m.local for m in grouped.modules() if isinstance(m, GroupBatchNorm2d))


def test_the_refit_of_a_group_model_equals_the_refit_of_its_one_rank_twin():
    x, _ = _batch(4)
    grouped, twin = _net(span=4, group=2), _net(span=8)
    with grouped_locally(grouped):
        refit_bn(grouped, x.split(16), reduce=None)
    refit_bn(twin, x.split(16), reduce=None)
    for (name, a), (_, b) in zip(grouped.named_buffers(), twin.named_buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_group_layer_keeps_its_names_and_evaluates_as_an_ordinary_layer():
    plain, grouped = _net(), _net(span=2, group=4)
    assert plain.state_dict().keys() == grouped.state_dict().keys()
    x, _ = _batch(1)
    plain.eval(), grouped.eval()
    torch.testing.assert_close(plain(x), grouped(x), rtol=0, atol=0)
    assert "group=4" in repr(grouped[1]) and "span=2" in repr(grouped[1])
