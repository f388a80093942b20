"""Muon (``"type": "Muon"``, dstrain/techniques/muon.py) held to torch's own optimizers."""

from __future__ import annotations

import copy

import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.techniques.models import build_model
from dstrain.techniques.optim import apply_schedule, build_optimizer, parse_spec


def tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, bias=False),  # a wide filter matrix: 8 x 27
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 48, 1, bias=True),  # a tall one: 48 x 8 (Newton-Schulz transposes)
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(48, 5),  # the head: SGD
    )


def backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 3, 7, 7, generator=g), torch.randint(0, 5, (6,), generator=g)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("channels_last", [False, True])
def test_muon_steps_filters_as_torchs_muon_and_the_rest_as_torchs_nesterov_sgd(channels_last):
    """Three steps at a changing LR: every filter moves as torch.optim.Muon moves its flattened
    matrix [out, in x kh x kw] (same gradients), bit for bit in either memory layout; the head,
    BN and the bias as torch.optim.SGD(nesterov) at sgd_lr_factor x the LR; weight decay on the
    filters (decoupled, as torch's Muon) and on the head, not on BN and biases."""
    params = {"weight_decay": 0.01, "sgd_lr_factor": 0.5, "bn_bias_lr_factor": 0.1}
    ours = tiny_net()
    if channels_last:
        ours = ours.to(memory_format=torch.channels_last)
    opt = build_optimizer(ours, parse_spec({"type": "Muon", "params": params}), 0.1)
    ref = tiny_net()  # the same gradients: channels_last convolutions round differently
    if channels_last:
        ref = ref.to(memory_format=torch.channels_last)
    filters = [m.weight for m in ref if isinstance(m, torch.nn.Conv2d)]
    flat = [torch.nn.Parameter(f.detach().reshape(f.shape[0], -1).clone()) for f in filters]
    muon = torch.optim.Muon(flat, lr=0.1, momentum=0.95, nesterov=True, weight_decay=0.01)
    head = torch.optim.SGD([ref[6].weight], lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    bn_bias = [ref[1].weight, ref[1].bias, ref[3].bias, ref[6].bias]
    rest = torch.optim.SGD(bn_bias, lr=0.005, momentum=0.9, nesterov=True)
    for step, lr in enumerate([0.1, 0.2, 0.05]):
        backward(ours, step)
        apply_schedule(opt, lr)
        opt.step()
        backward(ref, step)
        for f, m in zip(filters, flat):
            m.grad = f.grad.reshape(m.shape)
        for o, factor in ((muon, 1.0), (head, 0.5), (rest, 0.05)):
            o.param_groups[0]["lr"] = lr * factor
            o.step()
        with torch.no_grad():
            for f, m in zip(filters, flat):
                f.copy_(m.reshape(f.shape))
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), (step, name, (a - b).abs().max().item())
    assert [g["muon"] for g in opt.param_groups] == [True, False, False]


def test_the_sgd_parts_lr_factor_is_the_product_of_its_two_factors():
    """sgd_lr_factor times the BN/bias group's bn_bias_lr_factor, also where the product is 1."""
    for bn, sgd in ((0.25, 4.0), (0.1, 1.0), (1.0, 3.0)):
        params = {"bn_bias_lr_factor": bn, "sgd_lr_factor": sgd}
        opt = build_optimizer(tiny_net(), parse_spec({"type": "Muon", "params": params}), 1.0)
        apply_schedule(opt, 2.0)
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs == pytest.approx([2.0, 2.0 * sgd, 2.0 * bn * sgd]), (bn, sgd, lrs)


def test_the_filters_update_is_orthogonal_and_the_lr_follows_the_matrix_shape():
    """One step from zero momentum on a square filter matrix: the update's singular values are
    near 1 (Newton-Schulz's quintic leaves them in about [0.7, 1.2]), whatever the gradient's
    scale; a tall matrix (out > in) steps sqrt(out/in) further (adjust_lr original)."""
    conv = torch.nn.Conv2d(4, 16, 2, bias=False)  # 16 x 16
    before = conv.weight.detach().clone()
    opt = build_optimizer(conv, parse_spec({"type": "Muon", "params": {"nesterov": False}}), 1.0)
    conv.weight.grad = 1e3 * torch.randn_like(conv.weight)
    opt.step()
    moved = (before - conv.weight.detach()).reshape(16, 16)
    s = torch.linalg.svdvals(moved)
    assert 0.6 < s.min() and s.max() < 1.25, s
    tall = torch.nn.Conv2d(4, 64, 1, bias=False)  # 64 x 4: the step x 4
    before = tall.weight.detach().clone()
    opt = build_optimizer(tall, parse_spec({"type": "Muon", "params": {"nesterov": False}}), 1.0)
    tall.weight.grad = torch.randn_like(tall.weight)
    opt.step()
    s = torch.linalg.svdvals((before - tall.weight.detach()).reshape(64, 4))
    assert 0.6 * 4 < s.min() and s.max() < 1.25 * 4, s


def test_muon_trains_resnet_small_and_its_state_round_trips():
    """A few steps on resnet_small lower the loss; the state dict restores the same next step."""
    model = build_model("resnet_small", 10, in_channels=1, width=8)
    spec = parse_spec({"type": "Muon", "params": {"weight_decay": 5e-5}})
    opt = build_optimizer(model, spec, 0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step(m, o) -> float:
        o.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        return loss.item()

    losses = [step(model, opt) for _ in range(8)]
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), losses
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer(twin, spec, 0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no shared buffers
    step(model, opt)
    step(twin, twin_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_muon_refuses_what_it_cannot_step():
    """One line each: a model without a convolution, a parameter out of range."""
    with pytest.raises(ConfigError, match="no convolution filters for Muon"):
        build_optimizer(torch.nn.Linear(3, 2), parse_spec({"type": "Muon", "params": {}}), 0.1)
    with pytest.raises(ConfigError, match="adjust_lr"):
        parse_spec({"type": "Muon", "params": {"adjust_lr": "rms"}}, "x.json")
    with pytest.raises(ConfigError, match="ns_steps"):
        parse_spec({"type": "Muon", "params": {"ns_steps": 0}}, "x.json")
