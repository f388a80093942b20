"""SOAP (``"type": "SOAP"``: pytorch_optimizer's, the optimizers extra) checked against the paper's
step and built as the JSON says."""

from __future__ import annotations

import copy

import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.techniques.optim import apply_schedule, build_optimizer, parse_spec


def test_soaps_second_step_is_adam_in_the_eigenbasis_of_the_first_gradients_statistics():
    """Vyas et al.'s step, written out for a 4 x 4 matrix W (full rank: no eigenvalue repeats, so
    the eigenbases are unique up to sign) and a bias b (FP64): the first step
    only gathers L = (1 - beta_s) G1 G1^T, R = (1 - beta_s) G1^T G1 and their eigenbases QL, QR;
    the second is Adam's on the rotated gradient QL^T G2 QR with the moment mapped back
    (QL (M' / (sqrt(V) + eps)) QR^T, M' = QL^T M QR), then decoupled weight decay. The bias
    (1-D, no preconditioner) gets plain Adam, without weight decay."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    lr, wd, beta1, beta2, eps = 0.1, 0.01, 0.9, 0.95, 1e-8
    params = {"betas": [beta1, beta2], "shampoo_beta": 0.8, "weight_decay": wd, "eps": eps}
    opt = build_optimizer(lin, parse_spec({"type": "SOAP", "params": params}), lr)
    grads = [(torch.randn(4, 4).double(), torch.randn(4).double()) for _ in range(2)]
    for gw, gb in grads:
        lin.weight.grad, lin.bias.grad = gw.clone(), gb.clone()
        opt.step()
    g1, g2 = grads[0][0], grads[1][0]

    def basis(m):  # eigenvectors, the largest eigenvalue's first (the reference code's order)
        return torch.flip(torch.linalg.eigh(m)[1], dims=[1])

    ql, qr = basis(0.2 * g1 @ g1.T), basis(0.2 * g1.T @ g1)
    m, v = (1 - beta1) * g2, (1 - beta2) * (ql.T @ g2 @ qr) ** 2
    step = lr * (1 - beta2) ** 0.5 / (1 - beta1)  # bias corrections at step 1 of the moments
    w = (w0 - step * ql @ ((ql.T @ m @ qr) / (v.sqrt() + eps)) @ qr.T) * (1 - lr * wd)
    gb = grads[1][1]
    b = b0 - step * ((1 - beta1) * gb) / (((1 - beta2) * gb**2).sqrt() + eps)
    assert torch.allclose(lin.weight, w, rtol=1e-9, atol=1e-12), (lin.weight - w).abs().max()
    assert torch.allclose(lin.bias, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_json_builds_the_librarys_soap_with_dstrains_groups_and_schedule(channels_last):
    """Three steps of a conv net at a changing LR: the same parameters as pytorch_optimizer's SOAP
    built by hand on the groups dstrain promises (weights with decay; BN and biases without, at
    bn_bias_lr_factor x the LR). Filters keep their logical shape whatever the memory layout
    (the library's own data_format channels_last would permute them as if NHWC-shaped)."""
    from pytorch_optimizer import SOAP

    def net():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3),
            torch.nn.BatchNorm2d(4),
            torch.nn.Flatten(),
            torch.nn.Linear(4 * 25, 2),
        )
        return model.to(memory_format=torch.channels_last) if channels_last else model

    params = {"weight_decay": 0.01, "precondition_frequency": 2, "bn_bias_lr_factor": 0.5}
    ours = net()
    opt = build_optimizer(ours, parse_spec({"type": "SOAP", "params": params}), 0.01)
    ref = net()
    weights = [p for p in ref.parameters() if p.ndim > 1]
    rest = [p for p in ref.parameters() if p.ndim <= 1]
    by_hand = SOAP(
        [{"params": weights, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=0.01,
        precondition_frequency=2,
    )
    x = torch.randn(4, 3, 7, 7)
    for lr in (0.01, 0.02, 0.005, 0.01):
        for model, o in ((ours, opt), (ref, by_hand)):
            o.zero_grad()
            model(x).square().mean().backward()
        apply_schedule(opt, lr)
        by_hand.param_groups[0]["lr"], by_hand.param_groups[1]["lr"] = lr, 0.5 * lr
        opt.step()
        by_hand.step()
        for a, b in zip(ours.parameters(), ref.parameters()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    assert not torch.equal(ours[0].weight, net()[0].weight)  # it moved
    state = opt.state[ours[0].weight]
    assert [tuple(q.shape) for q in state["Q"]] == [(4, 4), (3, 3), (3, 3), (3, 3)]
    twin = copy.deepcopy(opt.state_dict())
    assert twin["state"] and twin["param_groups"][0]["step"] == 4


def test_soap_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    """Without its package, at start-up, naming the install; a parameter out of range."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pytorch_optimizer" else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"dstrain\[optimizers\]"):
        parse_spec({"type": "SOAP", "params": {}}, "x.json")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="precondition_frequency"):
        parse_spec({"type": "SOAP", "params": {"precondition_frequency": 0}}, "x.json")
