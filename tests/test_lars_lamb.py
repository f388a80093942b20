"""LARS and LAMB against their formulas (hand-sized tensors) and LARS against timm's Lars."""

import math

import pytest
import torch

from dstrain.techniques.lamb import LAMB
from dstrain.techniques.lars import LARS
from dstrain.techniques.models import build_model
from dstrain.techniques.optim import param_groups


def _lars_reference(ws, gs_per_step, lr, m, wd, eta, eps, larc=False, exclude=False, **extra):
    """METHODS.md sec. 2, one tensor at a time in float64. ``extra``: ``lrs`` (one LR per step),
    ``trust_wd`` (the weight decay inside the trust ratio), ``clip`` (a cap on it), ``correct``
    (momentum x lr_t / lr_(t-1))."""
    ws = [w.double().clone() for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    lrs = extra.get("lrs") or [lr] * len(gs_per_step)
    trust_wd, clip = extra.get("trust_wd", wd), extra.get("clip", 0.0)
    for step, gs in enumerate(gs_per_step):
        lr = lrs[step]
        mom = m * lr / lrs[step - 1] if extra.get("correct") and step > 0 else m
        for k, (w, g) in enumerate(zip(ws, gs)):
            g = g.double()
            if exclude:
                trust, decay = 1.0, 0.0
            else:
                wn, gn = w.norm().item(), g.norm().item()
                trust = eta * wn / (gn + trust_wd * wn + eps) if wn > 0 and gn > 0 else 1.0
                if larc:
                    trust = min(trust / lr, 1.0)
                if clip:
                    trust = min(trust, clip)
                decay = wd
            vs[k] = mom * vs[k] + lr * trust * (g + decay * w)
            ws[k] = w - vs[k]
    return ws


def _run(opt_cls, ws, gs_per_step, group_extra=None, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = opt_cls([{"params": params, **(group_extra or {})}], **kw)
    for gs in gs_per_step:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


HAND_W = [torch.tensor([[1.0, -2.0], [0.5, 3.0]]), torch.tensor([0.3, -0.4, 1.2]), torch.zeros(2)]
HAND_G = [
    [
        torch.tensor([[0.1, 0.2], [-0.3, 0.05]]),
        torch.tensor([1.0, -1.0, 0.5]),
        torch.tensor([0.2, 0.1]),
    ],
    [
        torch.tensor([[-0.2, 0.1], [0.0, 0.4]]),
        torch.tensor([0.0, 0.0, 0.0]),
        torch.tensor([0.1, -0.3]),
    ],
    [
        torch.tensor([[0.3, -0.1], [0.2, 0.2]]),
        torch.tensor([0.2, 0.1, -0.7]),
        torch.tensor([0.0, 0.5]),
    ],
]


@pytest.mark.parametrize("larc", [False, True])
def test_lars_matches_the_formula_on_hand_sized_tensors(larc):
    kw = dict(
        lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-9, larc_clip=larc
    )
    got = _run(LARS, HAND_W, HAND_G, **kw)
    want = _lars_reference(HAND_W, HAND_G, lr=0.5, m=0.9, wd=0.01, eta=0.02, eps=1e-9, larc=larc)
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, atol=1e-6), (g, w)
    # zero weights (third tensor) and a zero gradient (second tensor, step 2) take trust 1
    assert not torch.equal(got[2], HAND_W[2])


def test_lars_trust_decay_cap_and_momentum_correction_match_the_formula():
    """The records' settings (issue 33): the trust ratio's own weight decay (Fujitsu: wd x peak LR),
    a cap on the ratio, and Goyal's momentum correction while the LR changes step by step."""
    lrs = [0.5, 0.8, 0.2]
    params = [torch.nn.Parameter(w.clone()) for w in HAND_W]
    opt = LARS(
        [{"params": params, "trust_weight_decay": 0.3}],
        lr=lrs[0],
        momentum=0.9,
        weight_decay=0.01,
        trust_coefficient=0.5,
        eps=1e-9,
        trust_clip=1.0,
        momentum_correction=True,
    )
    trusts = []
    for lr, gs in zip(lrs, HAND_G):
        opt.param_groups[0]["lr"] = lr
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        trusts.append(opt.trust_summary())
    settings = {"lrs": lrs, "trust_wd": 0.3, "clip": 1.0, "correct": True}
    fixed = {"lr": None, "m": 0.9, "wd": 0.01, "eta": 0.5, "eps": 1e-9}
    want = _lars_reference(HAND_W, HAND_G, **fixed, **settings)
    for g, w in zip(params, want):
        assert torch.allclose(g.detach().double(), w, atol=1e-6), (g, w)
    # without the three settings the same steps land elsewhere: each of them changes the result
    for off in ({"trust_wd": 0.01}, {"clip": 0.0}, {"correct": False}):
        other = _lars_reference(HAND_W, HAND_G, **fixed, **{**settings, **off})
        assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, other)), off
    # the logged trust ratios: the cap holds; a zero-norm tensor counts as trust 1
    assert all(t["trust_max"] <= 1.0 and t["trust_min"] > 0 for t in trusts), trusts


def test_lars_excluded_group_is_plain_momentum_sgd():
    got = _run(
        LARS,
        HAND_W,
        HAND_G,
        group_extra={"lars_exclude": True, "weight_decay": 0.0},
        lr=0.5,
        momentum=0.9,
    )
    want = _lars_reference(HAND_W, HAND_G, lr=0.5, m=0.9, wd=0.0, eta=0.001, eps=0.0, exclude=True)
    sgd = _run(torch.optim.SGD, HAND_W, HAND_G, lr=0.5, momentum=0.9)
    for g, w, s in zip(got, want, sgd):
        assert torch.allclose(g.double(), w, atol=1e-6) and torch.allclose(g, s, atol=1e-6)


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_lars_matches_timm_on_a_small_model_over_several_steps():
    timm_optim = pytest.importorskip("timm.optim")
    torch.manual_seed(0)
    ours_model = build_model("resnet_small", 10, in_channels=1, width=8, zero_init_residual=False)
    timm_model = build_model("resnet_small", 10, in_channels=1, width=8, zero_init_residual=False)
    timm_model.load_state_dict(ours_model.state_dict())
    ours = LARS(
        param_groups(ours_model, 5e-4, layerwise=True),
        lr=0.8,
        momentum=0.9,
        trust_coefficient=0.01,
        eps=1e-8,
    )
    timm_groups = param_groups(timm_model, 5e-4)  # timm skips adaptation where weight_decay == 0
    theirs = timm_optim.Lars(
        timm_groups, lr=0.8, momentum=0.9, trust_coeff=0.01, eps=1e-8, foreach=False
    )
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 10
    for _ in range(5):
        for model, opt in ((ours_model, ours), (timm_model, theirs)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for (name, a), (_, b) in zip(ours_model.named_parameters(), timm_model.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def _lamb_reference(ws, gs_per_step, lr, b1, b2, eps, wd, exclude=False, lo=0.0, hi=math.inf):
    """METHODS.md sec. 3 in float64, optional DeepSpeed-style ratio clamp."""
    ws = [w.double().clone() for w in ws]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, gs in enumerate(gs_per_step, start=1):
        for k, g in enumerate(gs):
            g = g.double()
            ms[k] = b1 * ms[k] + (1 - b1) * g
            vs[k] = b2 * vs[k] + (1 - b2) * g * g
            r = (ms[k] / (1 - b1**t)) / ((vs[k] / (1 - b2**t)).sqrt() + eps)
            if exclude:
                ratio = 1.0
            else:
                r = r + wd * ws[k]
                wn, rn = ws[k].norm().item(), r.norm().item()
                ratio = min(max(wn / rn, lo), hi) if wn > 0 and rn > 0 else 1.0
            ws[k] = ws[k] - lr * ratio * r
    return ws


@pytest.mark.parametrize("lo, hi", [(0.0, math.inf), (0.01, 10.0), (0.5, 0.6)])
def test_lamb_matches_the_formula(lo, hi):
    got = _run(
        LAMB,
        HAND_W,
        HAND_G,
        lr=0.1,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        min_coeff=lo,
        max_coeff=hi,
    )
    want = _lamb_reference(
        HAND_W, HAND_G, lr=0.1, b1=0.9, b2=0.999, eps=1e-6, wd=0.01, lo=lo, hi=hi
    )
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, atol=1e-6), (g, w)


def test_lamb_excluded_group_has_no_decay_and_no_adaptation():
    got = _run(
        LAMB, HAND_W, HAND_G, group_extra={"lars_exclude": True, "weight_decay": 0.0}, lr=0.1
    )
    want = _lamb_reference(HAND_W, HAND_G, lr=0.1, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, exclude=True)
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, atol=1e-6)


def test_lars_lowers_the_loss_of_a_small_problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = LARS(
        param_groups(model, 1e-4, layerwise=True), lr=0.5, momentum=0.9, trust_coefficient=0.05
    )
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_cpu_chunking_gives_the_same_step(monkeypatch):
    """Tiny chunks (one tensor or less each) must not change the result."""
    import dstrain.techniques.multitensor as mt

    whole_lars = _run(
        LARS, HAND_W, HAND_G, lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02
    )
    whole_lamb = _run(LAMB, HAND_W, HAND_G, lr=0.1, weight_decay=0.01)
    monkeypatch.setattr(mt, "CPU_CHUNK_VALUES", 3)
    assert mt.chunks([torch.zeros(4), torch.zeros(2), torch.zeros(1), torch.zeros(5)]) == [
        (0, 1),
        (1, 3),
        (3, 4),
    ]
    chunked_lars = _run(
        LARS, HAND_W, HAND_G, lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02
    )
    chunked_lamb = _run(LAMB, HAND_W, HAND_G, lr=0.1, weight_decay=0.01)
    for a, b in zip(whole_lars + whole_lamb, chunked_lars + chunked_lamb):
        assert torch.equal(a, b)


def test_lars_tensor_stats_give_each_tensors_trust_and_relative_step():
    """log.lars_tensors' numbers: per tensor, the trust ratio (None for the BN/bias group, which
    takes plain steps) and ||w_before - w_after|| / ||w_before||, checked against the weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = LARS(param_groups(model, 1e-4, layerwise=True), lr=2.0, momentum=0.9)
    assert opt.tensor_stats() == []  # off by default: nothing recorded, no copies
    opt.record_tensors = True
    before = {id(p): p.detach().clone() for p in model.parameters()}
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()
    stats = opt.tensor_stats()
    assert {id(p) for p, _, _ in stats} == set(before)
    for p, trust, ratio in stats:
        w0 = before[id(p)]
        step = (w0 - p.detach()).norm()
        want = step / w0.norm() if w0.norm() > 0 else step  # a zero tensor (BN bias): the step
        assert ratio == pytest.approx(want.item(), rel=1e-4)
        assert (trust is None) == (p.ndim <= 1)  # BN weight/bias and the Linear bias: excluded
    adapted = [t for p, t, _ in stats if p.ndim > 1]
    assert adapted and all(0 < t for t in adapted)


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_a_run_with_lars_tensors_logs_every_tensor_by_name(fake_fmnist, tmp_path):
    """log.lars_tensors through the trainer: per log step a trust ratio for every LARS-adapted
    weight and a relative step for every tensor, named as the model names them, and the three
    largest steps on the console; results/harness/lars_tensors.py reads the run back."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, TINY, run_cli
    from tests.test_e2e import tb_scalars

    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            *("--deepspeed_config", "ds_configs/lars_fp32.json"),
            *TINY,
            *("epochs=1", f"data.root={fake_fmnist}", f"run_dir={run_dir}"),
            *("log.lars_tensors=true", "log.every_steps=4"),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "largest relative steps: " in proc.stdout + proc.stderr
    scalars = tb_scalars(run_dir)
    trust = {t for t in scalars if t.startswith("lars_trust/")}
    step = {t for t in scalars if t.startswith("lars_step/")}
    assert "lars_trust/stem.0.weight" in trust and "lars_step/fc.bias" in step
    assert trust and {t.replace("lars_trust/", "lars_step/") for t in trust} < step  # BN/bias too
    assert all(len(scalars[t]) == 4 for t in step)  # 16 steps, every 4th logged
    out = tmp_path / "out"
    read = subprocess.run(
        [
            sys.executable,
            "results/harness/lars_tensors.py",
            str(run_dir),
            "--out",
            str(out),
            "--name",
            "r",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert read.returncode == 0, read.stderr[-2000:]
    assert json.loads((out / "r.json").read_text())["tensors"]["lars_adapted"] == len(trust)
