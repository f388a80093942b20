"""What only a GPU shows, run when one is here (skipped otherwise): FP16 with loss scaling end to end,
the LAMB paths shipped, DALI's mixed (GPU) decode, NCCL and the 2D-Torus all-reduce on 2+ GPUs.

The CPU suite checks the same code on the CPU; its CPU-only expectations (fp16 refused, FusedLamb
falling back) are skipped or switched where a GPU is present. `./run.sh test` on a GPU node runs all.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY, decode_colour, run_cli

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.gpu,  # the GPU pass (-m gpu) runs every test here
]


def train(fake_fmnist, tmp_path, json_name: str, *extra: str):
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "--deepspeed_config",
            json_name,
            *TINY,
            "epochs=2",
            "log.every_steps=2",
            f"data.root={fake_fmnist}",
            f"run_dir={run_dir}",
            *extra,
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize(
    "json_name, precision",
    [("ds_configs/fp16.json", "autocast-float16"), ("ds_configs/fp16_native.json", "fp16")],
)
def test_fp16_trains_with_dynamic_loss_scaling(fake_fmnist, tmp_path, json_name, precision):
    proc, summary = train(fake_fmnist, tmp_path, json_name)
    assert summary["precision"] == precision
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]
    assert " scale " in proc.stdout  # the loss scale is logged with every step line


def test_the_shipped_lamb_json_runs_dstrains_lamb_on_the_gpu(fake_fmnist, tmp_path):
    proc, summary = train(fake_fmnist, tmp_path, "ds_configs/lamb_fp16.json", "optim.base_lr=0.01")
    assert "Lamb: dstrain's multi-tensor LAMB" in proc.stdout
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]


def lamb_reference(p, g, m, v, t, group: dict, deepspeed: bool):
    """One LAMB step of tensor ``p`` in FP64 (moments ``m``, ``v`` updated in place), as
    dstrain/techniques/lamb.py computes it, or (``deepspeed``) as DeepSpeed's fused_lamb_cuda_kernel.cu
    does: its trust ratio is taken on the update before bias correction, which is applied to the
    step size instead (lr * sqrt(1 - b2^t) / (1 - b1^t))."""
    b1, b2 = group["betas"]
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    c1, c2 = 1 - b1**t, 1 - b2**t
    if deepspeed:
        update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
        step_size = group["lr"] * c2**0.5 / c1
    else:
        update = (m / c1) / ((v / c2).sqrt() + group["eps"]) + group["weight_decay"] * p
        step_size = group["lr"]
    w_norm, u_norm = p.norm(), update.norm()
    ratio = 1.0
    if w_norm > 0 and u_norm > 0:
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
    return p - step_size * ratio * update


def test_fused_lamb_builds_on_the_gpu_or_says_why(caplog):
    """``"type": "FusedLamb"``: DeepSpeed's CUDA op where it builds, else dstrain's LAMB with the
    reason logged. Three steps of a layer against an FP64 reference of whichever runs, with the
    groups dstrain gives it: the weight with weight decay and the trust ratio clamped to
    [0.01, 10], the bias with neither (ratio 1: FusedLamb's clamp [1, 1])."""
    import logging

    from dstrain.techniques.optim import build_optimizer, parse_spec

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).cuda()
    spec = parse_spec({"type": "FusedLamb", "params": {"weight_decay": 0.01}})
    with caplog.at_level(logging.INFO, logger="dstrain"):
        optimizer = build_optimizer(model, spec, 0.01)
    deepspeed = type(optimizer).__name__ == "FusedLamb"
    if deepspeed:
        assert "FusedLamb: DeepSpeed's CUDA op;" in caplog.text
    else:  # the op did not build: dstrain's LAMB, and the log says why
        assert type(optimizer).__name__ == "LAMB", type(optimizer)
        assert "FusedLamb: DeepSpeed's CUDA op is not usable here (" in caplog.text
    common = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    groups = {  # what dstrain's parameter groups must give each tensor
        "weight": {**common, "weight_decay": 0.01, "min_coeff": 0.01, "max_coeff": 10.0},
        "bias": {**common, "weight_decay": 0.0, "min_coeff": 1.0, "max_coeff": 1.0},
    }
    expected = {k: v.detach().double().cpu() for k, v in model.named_parameters()}
    moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in expected.items()}
    gen = torch.Generator().manual_seed(1)
    for t in (1, 2, 3):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=gen).cuda()).square().mean().backward()
        for name, param in model.named_parameters():
            grad = param.grad.double().cpu()
            m, v = moments[name]
            expected[name] = lamb_reference(expected[name], grad, m, v, t, groups[name], deepspeed)
        optimizer.step()  # FusedLamb: the CUDA op runs
        for name, param in model.named_parameters():
            got = param.detach().double().cpu()
            torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_dali_mixed_decode_gives_gpu_batches_with_the_right_labels(jpeg_folder):
    pytest.importorskip("nvidia.dali", reason="needs DALI (on a GPU node: all of .gpu/dali-N)")
    from dstrain.data import Shard, build_data
    from dstrain.settings.config import DataConfig

    cfg = DataConfig(
        dataset="imagefolder",
        root=str(jpeg_folder),
        loader="dali",
        image_size=16,
        val_resize=20,
        num_workers=2,
    )
    data = build_data(cfg, Shard(0, 1, 4, 1, eval_batch=5), 3, 3, device="cuda")
    seen = []
    for x, y in data.val:
        assert x.is_cuda and y.is_cuda
        ids = decode_colour(x.cpu())
        assert [c for c, _ in ids] == y.tolist()
        seen += ids
    assert sorted(seen) == [(c, i) for c in range(3) for i in range(3)]


def _nccl_torus_worker(rank, world, port, grids, out):
    from tests.test_comm import _torus_worker

    torch.cuda.set_device(rank)
    _torus_worker(rank, world, port, grids, out, backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torus_all_reduce_over_nccl_equals_all_reduce():
    from tests.test_comm import _spawn

    out = _spawn(_nccl_torus_worker, 2, [(2, 1), (1, 2)])
    for (grid, rank), (err, _) in out.items():
        assert err < 1e-5, (grid, rank, err)
