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


def test_fused_lamb_builds_on_the_gpu_or_says_why():
    from dstrain.techniques.optim import build_optimizer, parse_spec

    model = torch.nn.Linear(4, 4).cuda()
    opt = build_optimizer(model, parse_spec({"type": "FusedLamb", "params": {}}), 0.01)
    if type(opt).__name__ == "FusedLamb":
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        opt.step()  # the CUDA op runs


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
