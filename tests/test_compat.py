"""Resume compatibility (dstrain/run/compat.py): the refused differences, the allowed ones, the world rule."""

import pytest

from dstrain.run import compat, ds_config
from dstrain.settings.config import load_config
from tests.conftest import REPO

pytestmark = pytest.mark.oldest


def fingerprint(overrides=(), json_name="fp32", world=1, edit=None):
    cfg = load_config("fashion_mnist", list(overrides))
    raw = ds_config.read_json(REPO / "ds_configs" / f"{json_name}.json")
    if edit:
        edit(raw)
    return compat.fingerprint(cfg, ds_config.parse(raw, f"{json_name}.json", True), world)


def set_param(key, value):
    def edit(raw):
        raw["optimizer"]["params"][key] = value

    return edit


REFUSED = [
    # name, (overrides, json, world, edit), text of the difference
    ("model width", (["model.width=8"], "fp32", 1, None), "model.width=16 there, 8 here"),
    ("optimizer type", ([], "lars_fp32", 1, None), "optimizer.type 'sgd' there, 'lars' here"),
    (
        "momentum 0 (no buffer)",
        ([], "fp32", 1, set_param("momentum", 0.0)),
        "optimizer state 'momentum buffer' there, 'none' here",
    ),
    (
        "BN/bias group",
        ([], "fp32", 1, set_param("exclude_bn_bias", False)),
        "optimizer.params.exclude_bn_bias True there, False here",
    ),
    ("precision", ([], "bf16", 1, None), "precision 'fp32' there, 'autocast-bfloat16' here"),
    (
        "dataset",
        (["data.dataset=imagefolder"], "fp32", 1, None),
        "data.dataset 'fashion_mnist' there",
    ),
    ("holdout", (["data.holdout=6000"], "fp32", 1, None), "data.holdout 0 there, 6000 here"),
    (
        "last batch",
        (["data.last_batch=fill"], "fp32", 1, None),
        "data.last_batch 'drop' there, 'fill' here (it decides where each epoch starts",
    ),
]
# the checkpoint after 2 epochs and part of the third
DONE = {"epochs_done": 2, "mid_epoch": True}


@pytest.mark.parametrize("name, now, text", REFUSED, ids=[c[0] for c in REFUSED])
def test_changes_a_checkpoint_depends_on_are_refused(name, now, text):
    saved = fingerprint()
    overrides, json_name, world, edit = now
    diff = compat.differences(saved, fingerprint(overrides, json_name, world, edit), **DONE)
    assert len(diff) == 1 and text in diff[0], diff


BATCH_AND_SEED = [
    # overrides, where the checkpoint stands, the refusal (None: allowed)
    (["batch.global_size=512"], DONE, "global batch 256 there, 512 here in epoch 1"),
    (["batch.ramp=[[2,512]]"], DONE, "global batch 256 there, 512 here in epoch 3"),
    (["batch.ramp=[[2,512]]"], {"epochs_done": 2, "mid_epoch": False}, None),  # not yet due
    (["batch.ramp=[[5,512]]"], DONE, None),
    (["seed=1"], DONE, "seed 0 there, 1 here (it orders the data of the epoch being continued"),
    (["seed=1"], {"epochs_done": 2, "mid_epoch": False}, None),  # at an epoch boundary
]


@pytest.mark.parametrize("overrides, done, text", BATCH_AND_SEED)
def test_batch_plan_and_seed_may_change_only_for_what_is_not_started(overrides, done, text):
    diff = compat.differences(fingerprint(), fingerprint(overrides), **done)
    assert (diff == []) if text is None else (len(diff) == 1 and text in diff[0]), diff


def test_with_fill_the_seed_may_not_change_at_an_epoch_boundary_either():
    """data.last_batch=fill: the last epoch done took the first images of the next epoch's order,
    which the seed draws; a new seed would read some of them twice and others never."""
    fill = ["data.last_batch=fill"]
    boundary = {"epochs_done": 2, "mid_epoch": False}
    diff = compat.differences(fingerprint(fill), fingerprint([*fill, "seed=1"]), **boundary)
    assert len(diff) == 1 and "the epoch to come, whose first images the last epoch took" in diff[0]
    assert compat.differences(fingerprint(fill), fingerprint(fill), **boundary) == []
    old = fingerprint()
    del old["data.last_batch"]  # a run from before the key: not compared
    assert compat.differences(old, fingerprint(), **boundary) == []


ALLOWED = [
    ("more epochs", ["epochs=40"], None),
    (
        "LR and schedule",
        ["optim.base_lr=0.3", "optim.warmup_epochs=3", "optim.label_smoothing=0.05"],
        None,
    ),
    (
        "logging, eval, checkpoints",
        ["log.every_steps=7", "eval_every_epochs=2", "checkpoint.keep_last=1"],
        None,
    ),
    (
        "micro batch, layout, compile, BN span",
        [
            "batch.micro_per_rank=64",
            "model.channels_last=true",
            "model.compile=true",
            "model.bn_span=32",
        ],
        None,
    ),
    ("momentum value", [], set_param("momentum", 0.8)),
    ("weight decay", [], set_param("weight_decay", 1e-4)),
]


@pytest.mark.parametrize("name, overrides, edit", ALLOWED, ids=[c[0] for c in ALLOWED])
def test_documented_changes_are_allowed(name, overrides, edit):
    now = fingerprint(overrides, "fp32", 1, edit)
    assert compat.differences(fingerprint(), now, **DONE) == []


def test_world_size_may_change_only_where_the_state_is_not_per_rank():
    one = fingerprint(world=1)
    assert compat.differences(one, fingerprint(world=4)) == []  # ZeRO 0, fp32: rank 0 holds it all
    zero1 = {**one, "zero_optimization.stage": 1}
    assert "world size 1 there, 4 here" in compat.differences(zero1, {**zero1, "world_size": 4})[0]
    bf16 = {**one, "precision": "bf16"}
    assert "world size 1 there, 2 here" in compat.differences(bf16, {**bf16, "world_size": 2})[0]


def test_every_difference_is_named_at_once():
    now = fingerprint(["seed=3", "model.width=8"], "lamb_fp32")
    diff = compat.differences(fingerprint(), now, **DONE)
    assert len(diff) == 4, diff  # model.width, optimizer type, its state layout, seed


def test_a_run_without_a_fingerprint_is_compared_on_the_model_only(tmp_path, caplog):
    (tmp_path / "meta.json").write_text('{"git_sha": "x"}')
    cfg = load_config("fashion_mnist", [])
    spec = ds_config.load(REPO / "ds_configs/lars_fp32.json", True)
    compat.check(tmp_path, cfg, spec, 1, {"epoch": 1})  # no error: nothing recorded to compare
    assert "only the model is compared" in caplog.text
