"""The records' recipes against the records' own formulas (issue 33; docs/large-batch.md).

For every optimizer step of a recipe: the LR the trainer sets, the weight decay its LARS step
applies (the coefficient of ``lr * trust * w``) and the weight decay inside its trust ratio, each
equal to what the record's code computes for that step, written out here from that code:

* Fujitsu, MLPerf v0.6 (mlcommons/training_results_v0.6, Fujitsu/.../mxnet: fit.py, explorer.py,
  src/operator/mxnet_op.h): 15 updates per epoch; LR 13 k/540 for the 540 warmup updates, then
  13 [(1 - e)(1 - p)^2.2 + e] with e = 0.0025 and p = min(1, (k - 540) / 780); the kernel adds
  ``wd' c_wd(t) s w`` to the velocity with wd' = wd x lr0 = 6.5e-4 and c_wd the LR's shape, i.e. a
  coupled L2 of wd x lr_t per step, and uses the constant wd' in the trust ratio's denominator.
* The MLPerf TF2 reference (mlcommons/training, image_classification/tensorflow2, lars_util.py):
  linear warmup from 0 to the bracket's LR, then poly power 2 to an absolute 1e-4 over the
  remaining steps; constant coupled weight decay, also in the trust ratio.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstrain.run import ds_config
from dstrain.settings.config import load_config
from dstrain.techniques.optim import apply_schedule, build_optimizer
from dstrain.techniques.schedule import LRSchedule
from tests.conftest import REPO


def steps_of(recipe: str, updates_per_epoch: int, json: str | None = None, overrides=()):
    """(update k, LR, decay coefficient, trust-ratio weight decay) for every step of ``recipe``,
    as the trainer sets them (Trainer.set_lr) on an optimizer built from its DeepSpeed JSON."""
    cfg = load_config(recipe, list(overrides))
    spec = ds_config.load(str(REPO / (json or cfg.deepspeed_config)), cuda_available=True)
    schedule = LRSchedule.from_config(cfg.optim, cfg.epochs)
    optimizer = build_optimizer(torch.nn.Linear(4, 3), spec.optimizer, schedule.base_lr)
    weights = optimizer.param_groups[0]  # the conv/FC group (the bias is in the excluded one)
    total = cfg.epochs * updates_per_epoch
    out = []
    for k in range(1, total + 1):
        lr, wd_factor = schedule.at(k / updates_per_epoch, cfg.batch.global_size)
        apply_schedule(optimizer, lr, wd_factor, schedule.peak(cfg.batch.global_size))
        trust_wd = weights.get("trust_weight_decay", weights["weight_decay"])
        out.append((k, weights["lr"], weights["weight_decay"], trust_wd))
    excluded = optimizer.param_groups[1]
    assert excluded["lars_exclude"] and excluded["weight_decay"] == 0 and excluded["lr"] == lr
    return cfg, out


def fujitsu_lr(k: int, peak: float, per_epoch: int) -> float:
    warmup, decay = 36 * per_epoch, 52 * per_epoch
    if k <= warmup:
        return peak * k / warmup
    p = min(1.0, (k - warmup) / decay)
    return peak * ((1 - 0.0025) * (1 - p) ** 2.2 + 0.0025)


@pytest.mark.parametrize(
    "recipe, peak, per_epoch",
    [("imagenet_resnet50_fujitsu", 13.0, 15), ("fashion_mnist_fujitsu", 10.0, 14)],
)
def test_fujitsu_recipes_follow_fujitsus_code_step_by_step(recipe, peak, per_epoch):
    cfg, steps = steps_of(recipe, per_epoch)
    assert not cfg.model.zero_init_residual  # their initialiser sets every BN gamma to 1
    wd = 5e-5
    for k, lr, decay, trust_wd in steps:
        want = fujitsu_lr(k, peak, per_epoch)
        assert lr == pytest.approx(want, rel=1e-9), k
        # the velocity gets lr * s * (g + decay * w): Fujitsu's kernel adds wd x lr0 x c_wd(t) x s x w
        # with c_wd = lr_t / lr0, i.e. wd x lr_t x s x w: equal when decay = wd at every step
        assert lr * decay == pytest.approx(wd * lr0_shape(want, peak) * peak, rel=1e-9), k
        assert trust_wd == pytest.approx(wd * peak, rel=1e-12), k  # 6.5e-4 at 13.0: bound 3.85
    # the last 2 epochs hold the end LR, as Fujitsu's 780-update decay does
    assert {round(lr, 12) for k, lr, _, _ in steps[-2 * per_epoch :]} == {round(peak * 0.0025, 12)}


def lr0_shape(lr: float, peak: float) -> float:
    """c_wd(t) in Fujitsu's explorer.py: the LR's shape, lr_t / lr0."""
    return lr / peak


def test_wd_following_the_lr_would_have_been_the_lr_squared_dose():
    """What the recipes did before issue 33: wd_follows_lr with a LARS that already multiplies the
    decay by the LR gave a decay of wd x lr_t^2 / lr0: 64% of Fujitsu's dose over 90 epochs."""
    _, steps = steps_of("imagenet_resnet50_fujitsu", 15)
    fujitsu = sum(lr * decay for _, lr, decay, _ in steps)  # the step's coupled decay, lr x wd_t
    _, following = steps_of("imagenet_resnet50_fujitsu", 15, overrides=["optim.wd_follows_lr=true"])
    squared = sum(lr * decay for _, lr, decay, _ in following)  # as the optimizer was set
    assert squared / fujitsu == pytest.approx(0.64, abs=0.01)
    assert all(d == pytest.approx(5e-5 * lr / 13.0) for _, lr, d, _ in following)


def rcp_rows() -> dict:
    """MLCommons' reference convergence points for ResNet (ruleset 4.0.0), as the mlperf-logging
    package ships them: batch -> hyperparameters."""
    import json

    from mlperf_logging import rcp_checker

    path = Path(rcp_checker.__file__).parent / "training_4.0.0" / "rcps_resnet.json"
    return {row["BS"]: row["Hyperparams"] for row in json.loads(path.read_text()).values()}


MLPERF_BATCHES = (3264, 8192, 32768, 49152, 65536, 67840)


@pytest.mark.parametrize("batch", MLPERF_BATCHES)
def test_mlperf_rows_take_the_rcp_row_of_their_batch(batch):
    """Each imagenet_resnet50_mlperf_b* recipe with its JSON runs the RCP row's schedule step by
    step: linear warmup from 0 to the row's LR over its warmup epochs, poly power 2 to exactly
    1e-4 over the row's decay steps, the end LR held after; the row's momentum, weight decay and BN
    span; epsilon 0; MLPerf's target and evaluation period."""
    import importlib.util

    if importlib.util.find_spec("mlperf_logging") is None:
        pytest.skip("needs mlperf-logging (requirements.txt)")
    row = rcp_rows()[batch]
    recipe = f"imagenet_resnet50_mlperf_b{batch}"
    per_epoch = 1281167 // batch  # dstrain drops the last partial batch
    cfg, steps = steps_of(recipe, per_epoch)
    spec = ds_config.load(str(REPO / cfg.deepspeed_config), cuda_available=True)
    params = spec.optimizer.params
    assert spec.optimizer.kind == "lars" and params["eps"] == 0.0
    assert params["momentum"] == row["opt_momentum"]
    assert params["weight_decay"] == row["opt_weight_decay"]
    assert cfg.optim.base_lr == row["opt_base_learning_rate"] and "lr" not in params
    assert cfg.optim.warmup_epochs == row["opt_learning_rate_warmup_epochs"]
    # the span as MLPerf logs it: the images one BN layer normalises over, across a BN group
    span = (cfg.model.bn_span or cfg.batch.micro_per_rank) * cfg.model.bn_group
    assert span == row["model_bn_span"]
    assert (cfg.target_top1, cfg.eval_every_epochs, cfg.log.mlperf) == (0.759, 4, True)
    assert cfg.log.mlperf_division == "closed" and cfg.optim.poly_power == 2.0
    assert round(cfg.optim.decay_epochs * per_epoch) == row["opt_learning_rate_decay_steps"]
    peak, warmup = row["opt_base_learning_rate"], row["opt_learning_rate_warmup_epochs"] * per_epoch
    decay = row["opt_learning_rate_decay_steps"]
    for k, lr, wd, trust_wd in steps:
        if k <= warmup:
            want = peak * k / warmup
        else:  # PolynomialDecay(peak, decay_steps, end 1e-4, power 2), then held
            p = min(1.0, (k - warmup) / decay)
            want = (peak - 1e-4) * (1 - p) ** 2 + 1e-4
        assert lr == pytest.approx(want, rel=1e-6, abs=1e-12), k
        assert wd == trust_wd == row["opt_weight_decay"]  # constant, coupled, also in the ratio
    assert steps[-1][1] == 1e-4  # exactly: the closed rules compare with ==
