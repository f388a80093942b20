import dataclasses

import pytest

from dstrain.core.errors import ConfigError
from dstrain.settings.config import RECIPE_DIR, TrainConfig, help_lines, load_config, validate
from dstrain.settings.ramp import batch_arithmetic


def test_defaults_load_and_validate():
    cfg = load_config()
    validate(cfg, world_size=1)
    assert cfg.model.name == "resnet_small" and cfg.batch.global_size == 256


def test_yaml_then_overrides_win():
    cfg = load_config(
        "fashion_mnist", ["optim.warmup_epochs=0.5", "data.root=/x", "model.channels_last=true"]
    )
    assert (
        cfg.optim.warmup_epochs == 0.5 and cfg.data.root == "/x" and cfg.model.channels_last is True
    )
    assert cfg.name == "fashion_mnist"  # from the YAML


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
def test_every_shipped_recipe_validates(recipe):
    cfg = load_config(recipe)
    for world in (
        1,
        2,
    ):  # what CPU runs use; cluster recipes are also checked at their own scale below
        if world % cfg.model.bn_group:  # a BN group of 8 GPUs needs 8 ranks: one line says so
            with pytest.raises(ConfigError, match=f"model.bn_group={cfg.model.bn_group} does not"):
                validate(cfg, world_size=world)
            cfg.model.bn_group = 1
        validate(cfg, world_size=world)


@pytest.mark.parametrize(
    "recipe, worlds, overrides",
    [
        ("imagenet_resnet50", (32, 64), []),
        ("imagenet_resnet50_lars", (128, 256), []),
        ("imagenet_resnet50_fujitsu", (64, 256, 512), []),
        ("imagenet_resnet50_fujitsu", (2048,), ["batch.micro_per_rank=42"]),  # the record's layout
        ("imagenet_resnet50_mlperf_b3264", (8, 16), []),
        ("imagenet_resnet50_mlperf_b8192", (32, 64), []),
        ("imagenet_resnet50_mlperf_b32768", (128, 256), []),
        ("imagenet_resnet50_mlperf_b49152", (96, 192), []),
        ("imagenet_resnet50_mlperf_b65536", (256, 512), []),
        ("imagenet_resnet50_mlperf_b67840", (80, 160, 1280), []),
    ],
)
def test_imagenet_recipes_validate_at_cluster_scale(recipe, worlds, overrides):
    cfg = load_config(recipe, overrides)
    for world in worlds:
        validate(cfg, world_size=world)


def test_record_recipes_hold_the_published_budget():
    """The MLPerf rows' schedule length (warmup + the RCP row's decay, tests/test_records.py holds
    every value against rcps_resnet.json) and Fujitsu's v0.6 hyperparameters."""
    epochs = {3264: 40, 8192: 45, 32768: 75, 49152: 95, 65536: 91, 67840: 94}
    for batch, n in epochs.items():
        cfg = load_config(f"imagenet_resnet50_mlperf_b{batch}")
        assert (cfg.epochs, cfg.batch.global_size, cfg.optim.poly_power) == (n, batch, 2.0)
        assert cfg.optim.lr_scaling == "none" and cfg.optim.end_lr == 0.0001
        assert (
            cfg.optim.warmup_epochs + cfg.optim.decay_epochs
            <= n
            < cfg.optim.warmup_epochs + (cfg.optim.decay_epochs + 1)
        )
    f = load_config("imagenet_resnet50_fujitsu")
    assert (f.epochs, f.batch.global_size, f.model.bn_span) == (90, 86016, 42)
    assert (f.optim.base_lr, f.optim.warmup_epochs, f.optim.poly_power) == (13.0, 36, 2.2)
    assert f.polish.last_epochs_without_augmentation == 5 and f.optim.decay_epochs == 52
    # their kernel leaves the LR out of weight decay and they schedule it with the LR: a constant
    # coupled decay in dstrain's LARS terms (tests/test_records.py, step by step)
    assert not f.optim.wd_follows_lr and not f.model.zero_init_residual
    assert list(f.data.random_area) == [0.05, 0.9]


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.warmup_epoch=5", "optim.warmup_epoch"),
        ("nonsense=1", "nonsense"),
        ("data.rooot=/x", "data.rooot"),
    ],
)
def test_unknown_key_is_rejected_by_name(override, key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override, key",
    [
        ("epochs=ten", "epochs"),
        ("optim.warmup_epochs=abc", "optim.warmup_epochs"),
        ("model.channels_last=maybe", "model.channels_last"),
    ],
)
def test_wrong_type_is_rejected_by_name(override, key):
    with pytest.raises(ConfigError, match=f"bad value for '{key}'"):
        load_config(None, [override])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("epochs: 3\nmodel:\n  widht: 8\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: unknown config key 'model\.widht'"):
        load_config(str(bad))


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("epochs: [3\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(str(bad))


def test_override_without_equals():
    with pytest.raises(ConfigError, match="is not key=value"):
        load_config(None, ["epochs"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optim.warmup_epochs=10", "epochs=10"],
            "optim.warmup_epochs=10.0: must be >= 0 and shorter than epochs=10",
        ),
        (["optim.label_smoothing=1.0"], "optim.label_smoothing=1.0"),
        (["batch.global_size=255"], "not divisible by the world size 2"),
        (
            ["batch.global_size=256", "batch.micro_per_rank=48"],
            "does not divide the per-rank batch 128",
        ),
        (["model.name=resnet50"], "set model.in_channels=3"),
        (["data.hw_decoder_load=1.5"], "data.hw_decoder_load=1.5: must be a fraction in [0, 1]"),
    ],
)
def test_validate_names_the_field(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.decay=linear", "optim.decay='linear'"),
        ("data.dataset=imagenet", "data.dataset='imagenet'"),
        ("resume=latest", "resume='latest'"),
        ("data.loader=ffcv", "expected one of ['auto', 'dali'"),
        ("optim.lr_scaling=cubic", "optim.lr_scaling='cubic'"),
        ("optim.warmup=exp", "optim.warmup='exp'"),
        ("batch.ramp=[[2,4096.5]]", "batch.ramp[0][1]"),
        ("batch.ramp=[4096]", "batch.ramp"),
        ("optim.step_milestones=[a]", "optim.step_milestones[0]"),
    ],
)
def test_choices_and_typed_lists_are_checked_on_load(override, message):
    """Literal choices and typed lists: OmegaConf rejects them when the config is loaded, naming the key."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"bad value for '{override.split('=')[0]}" in str(err.value) and message in str(
        err.value
    )


@pytest.mark.parametrize(
    "global_size, micro, world, expected",
    [
        (256, 0, 1, (256, 1)),
        (256, 0, 2, (128, 1)),
        (256, 32, 2, (32, 4)),
        (4096, 128, 8, (128, 4)),
    ],
)
def test_batch_arithmetic(global_size, micro, world, expected):
    assert batch_arithmetic(global_size, micro, world) == expected


def test_every_field_has_a_help_text():
    lines = help_lines()
    assert len(lines) > 30
    for line in lines:
        key, _, text = line.partition(": ")
        assert text.strip(), f"{key} has no help text"
    assert any(line.startswith("optim.warmup_epochs ") and "(epochs" in line for line in lines)
    assert len(lines) == len([1 for _ in _leaves(TrainConfig)])


def _leaves(cls):
    for f in dataclasses.fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            yield from _leaves(type(sub))
        else:
            yield f
