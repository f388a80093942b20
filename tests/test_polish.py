"""Final Polishing: BN refit exactness, untouched weights, cross-rank equality, the K-epochs mode."""

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dstrain.core.dist import free_port
from dstrain.data import Shard
from dstrain.data.fashion_mnist import TensorLoader
from dstrain.techniques.bn_refit import bn_layers, refit_bn
from dstrain.techniques.models import build_model
from dstrain.techniques.schedule import augment_at
from tests.conftest import TINY, deepspeed_launcher, rank_env, run_cli, spawn_ranks

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def small_model(seed: int = 0) -> nn.Module:
    """resnet_small (BatchNorm2d) plus a BatchNorm1d head, with non-trivial BN affine parameters."""
    torch.manual_seed(seed)
    body = build_model(
        "resnet_small", 5, in_channels=1, width=4, blocks_per_stage=1, zero_init_residual=False
    )
    body.fc = nn.Sequential(
        nn.Linear(body.fc.in_features, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5)
    )
    for m in bn_layers(body):
        nn.init.uniform_(m.weight, 0.5, 1.5)
        nn.init.uniform_(m.bias, -0.5, 0.5)
        m.running_mean.fill_(3.0)  # stale statistics the refit must replace
        m.running_var.fill_(7.0)
    return body


def batches(sizes=(8, 8, 8, 5), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 1, 12, 12, generator=g) * 2 + 0.5 for n in sizes]


def reference_stats(model: nn.Module, xs, forward=None) -> dict:
    """Each BN layer's inputs over all batches (BN layers normalising with batch statistics), in float64.
    (The pass updates the model's running statistics with BN's own momentum.)"""
    seen = {m: [] for m in bn_layers(model)}
    hooks = [
        m.register_forward_pre_hook(lambda mod, inp: seen[mod].append(inp[0].detach().double()))
        for m in seen
    ]
    model.eval()
    for m in seen:
        m.train()
    with torch.no_grad():
        for x in xs:
            (forward or model)(x)
    for h in hooks:
        h.remove()
    out = {}
    for m, parts in seen.items():
        flat = torch.cat(
            [p.transpose(0, 1).reshape(p.shape[1], -1) for p in parts], dim=1
        )  # [C, all elements]
        out[m] = (flat.mean(1), flat.var(1, unbiased=True))
    return out


def test_refit_equals_the_statistics_of_each_layers_inputs_over_the_polish_set():
    model, xs = small_model(), batches()
    n = refit_bn(model, iter(xs), reduce=None)
    assert n == 29
    ref = reference_stats(
        small_model(), xs
    )  # same weights: an independent pass, stats from raw inputs
    for m, (mean, var) in zip(bn_layers(model), ref.values()):
        assert torch.allclose(m.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
        assert torch.allclose(m.running_var.double(), var, rtol=1e-5, atol=1e-6)
        assert int(m.num_batches_tracked) == 4


def test_refit_changes_nothing_but_bn_statistics():
    model = small_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momenta = [m.momentum for m in bn_layers(model)]
    refit_bn(model, iter(batches()), reduce=None)
    after = model.state_dict()
    for key, value in before.items():
        if key.rsplit(".", 1)[-1] in BN_BUFFERS:
            continue
        assert torch.equal(value, after[key]), key  # bit for bit
    assert any(not torch.equal(before[k], after[k]) for k in before if k.endswith("running_var"))
    assert model.training and [m.momentum for m in bn_layers(model)] == momenta


def test_the_naive_cumulative_average_is_not_exact():
    """Why refit_bn sums moments itself: BN's momentum=None average of per-batch variances misses the
    spread of batch means (here the batches have different means)."""
    xs = [torch.randn(8, 1, 12, 12) + shift for shift in (-2.0, 0.0, 3.0)]
    model = small_model()
    refit_bn(model, iter(xs), reduce=None)
    naive = small_model()
    for m in bn_layers(naive):
        m.momentum = None
        m.reset_running_stats()
    naive.eval()
    for m in bn_layers(naive):
        m.train()
    with torch.no_grad():
        for x in xs:
            naive(x)
    first = bn_layers(model)[0], bn_layers(naive)[0]
    assert not torch.allclose(first[0].running_var, first[1].running_var, rtol=1e-3)


def test_bf16_autocast_forward_accumulates_in_fp32():
    model, xs = small_model(), batches()

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    refit_bn(model, iter(xs), forward=forward, reduce=None)
    refit = [(m.running_mean.clone(), m.running_var.clone()) for m in bn_layers(model)]
    for (mean, var), (ref_mean, ref_var) in zip(
        refit, reference_stats(model, xs, forward).values()
    ):
        assert torch.allclose(
            mean.double(), ref_mean, rtol=1e-5, atol=1e-6
        )  # bf16 activations, FP32/FP64 sums
        assert torch.allclose(var.double(), ref_var, rtol=1e-5, atol=1e-6)


def test_model_without_batchnorm_is_a_warned_no_op(caplog):
    model = nn.Sequential(nn.Flatten(), nn.Linear(144, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="dstrain"):
        assert refit_bn(model, iter(batches()), reduce=None) == 0
    assert "no BatchNorm layers" in caplog.text
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_empty_polish_set_is_an_error_and_leaves_the_statistics():
    model = small_model()
    with pytest.raises(ValueError, match="0 images in the polish set"):
        refit_bn(model, iter([]), reduce=None)
    assert all(
        float(m.running_mean[0]) == 3.0 and float(m.running_var[0]) == 7.0 for m in bn_layers(model)
    )


def _rank_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    images = (torch.rand(60, 1, 12, 12, generator=torch.Generator().manual_seed(3)) * 255).to(
        torch.uint8
    )
    loader = TensorLoader(
        images,
        torch.zeros(60, dtype=torch.long),
        Shard(rank, world, 4, 1, eval_batch=7, seed=4),
        "polish",
        norm=(0.3, 0.3),
    )
    model = small_model()
    n = refit_bn(model, (x for x, _ in loader))
    out[rank] = (n, {k: v.clone() for k, v in model.state_dict().items()})
    dist.destroy_process_group()


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize("world", [2, 3])
def test_refit_across_ranks_equals_one_process(world):
    """Uneven shards (8 batches of 7 over 3 ranks: 2, 3, 3) still give the single-process refit."""
    images = (torch.rand(60, 1, 12, 12, generator=torch.Generator().manual_seed(3)) * 255).to(
        torch.uint8
    )
    single = TensorLoader(
        images,
        torch.zeros(60, dtype=torch.long),
        Shard(0, 1, 4, 1, eval_batch=7, seed=4),
        "polish",
        norm=(0.3, 0.3),
    )
    ref = small_model()
    assert refit_bn(ref, (x for x, _ in single), reduce=None) == 56  # 8 whole batches of 7
    out = mp.Manager().dict()
    spawn_ranks(_rank_worker, world, world, free_port(), out)
    for rank in range(world):
        n, state = out[rank]
        assert n == 56
        for key, value in ref.state_dict().items():
            assert torch.allclose(value.double(), state[key].double(), rtol=1e-6, atol=1e-7), key


@pytest.mark.parametrize(
    "epoch, epochs, k, expected",
    [
        (0, 5, 0, True),
        (4, 5, 0, True),
        (2, 5, 2, True),
        (3, 5, 2, False),
        (4, 5, 2, False),
        (0, 5, 5, False),
    ],
)
def test_augment_at_table(epoch, epochs, k, expected):
    assert augment_at(epoch, epochs, k) is expected
    assert augment_at(epoch, epochs, k, augment=False) is False


def test_start_epoch_without_augment_gives_the_plain_images():
    images = (torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 255).to(
        torch.uint8
    )
    loader = TensorLoader(
        images,
        torch.zeros(16, dtype=torch.long),
        Shard(0, 1, 16, 1),
        "train",
        augment=True,
        norm=(0.0, 1.0),
    )
    augmented, _ = next(iter(loader))
    loader.start_epoch(0, augment=False)
    plain, _ = next(iter(loader))
    order = torch.cat(list(loader.batches()))
    assert torch.allclose(plain, images[order].float() / 255)
    assert not torch.allclose(augmented, plain)


# ---------------------------------------------------------------- through the trainer and the launcher
POLISH_RUN = [
    *TINY,
    "epochs=2",
    "data.augment=true",
    "polish.batch_per_rank=50",
    "polish.images=300",
]


@pytest.fixture(scope="module")
def polished_run(fake_fmnist, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One rank trains POLISH_RUN (its last epoch un-augmented) and polishes after it; on a GPU
    node on cuda:0. Both tests below read it (one pytest-xdist worker: SHARES_RUN)."""
    run_dir = tmp_path_factory.mktemp("polish") / "run"
    proc = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/fp32.json",
            *POLISH_RUN,
            "polish.enabled=true",
            "polish.last_epochs_without_augmentation=1",
            f"data.root={fake_fmnist}",
            f"run_dir={run_dir}",
        ]
    )
    return run_dir, proc


SHARES_RUN = pytest.mark.xdist_group("polished_run")


@SHARES_RUN
@pytest.mark.slow
@pytest.mark.gpu  # 1 rank: trains and refits BN on cuda:0 on a GPU node, saves from there
def test_trainer_polishes_after_the_last_epoch_and_keeps_the_checkpoint(polished_run):
    run_dir, proc = polished_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [h["augment"] for h in summary["history"]] == [
        1,
        0,
    ]  # the last epoch without augmentation
    assert "epoch 2/2: un-augmented training images" in proc.stdout
    p = summary["polish"]
    assert p["images"] == 300 and p["before"]["val_top1"] == summary["final_top1"]
    assert p["after"]["val_top1"] == pytest.approx(p["before"]["val_top1"] + p["top1_gain"])
    assert 0 < p["refit_fraction_of_training"] < 1
    polished = torch.load(run_dir / "polished" / "model.pt")
    unpolished = torch.load(
        run_dir / "checkpoints" / "epoch0002" / "mp_rank_00_model_states.pt", weights_only=True
    )["module"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch0002"
    changed = [k for k in polished if not torch.equal(polished[k], unpolished[k].contiguous())]
    assert changed and all(k.rsplit(".", 1)[-1] in BN_BUFFERS for k in changed)
    from tests.test_e2e import tb_scalars

    assert {"polish/val_top1_before", "polish/val_top1_after"} <= set(tb_scalars(run_dir))


@SHARES_RUN
@pytest.mark.slow
@pytest.mark.gpu  # trained on cuda:0 on a GPU node, its checkpoint then polished on CPU ranks
def test_standalone_polish_two_ranks_equals_one(polished_run, fake_fmnist, tmp_path):
    run_dir, proc = polished_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {}
    for ranks in (1, 2):
        copy = tmp_path / f"copy{ranks}"
        shutil.copytree(run_dir, copy)
        shutil.rmtree(copy / "polished")  # the trainer's polish: the command writes its own
        args = [
            "--checkpoint",
            str(copy),
            "--images",
            "250",
            "--batch",
            "50",
            f"data.root={fake_fmnist}",
        ]
        if ranks == 1:  # on the devices the 2 ranks get (a 1-GPU node: both on the CPU)
            cmd = run_cli(args, module="dstrain.polish", env=rank_env(2))
        else:
            cmd = run_cli(args, launcher=deepspeed_launcher(2), script="dstrain/polish.py")
        assert cmd.returncode == 0, cmd.stdout[-3000:] + cmd.stderr[-3000:]
        info = json.loads((copy / "polished" / "polish.json").read_text())
        assert info["images"] == 250 and info["world_size"] == ranks
        results[ranks] = (info, torch.load(copy / "polished" / "model.pt"))
    (one, w1), (two, w2) = results[1], results[2]
    for when in ("before", "after"):  # top-1 identical; the loss up to the order of the FP sums
        assert one[when]["val_top1"] == two[when]["val_top1"]
        assert one[when]["val_loss"] == pytest.approx(two[when]["val_loss"], rel=1e-6)
    for key in w1:
        assert torch.allclose(w1[key].double(), w2[key].double(), rtol=1e-6, atol=1e-7), key
    again = run_cli(
        ["--checkpoint", str(tmp_path / "copy1"), f"data.root={fake_fmnist}"],
        module="dstrain.polish",
    )
    assert again.returncode == 2 and "pass --force" in again.stderr  # never overwritten silently
