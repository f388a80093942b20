import re
from pathlib import Path

import deepspeed
import pytest

from dstrain import ds_config
from dstrain.errors import ConfigError

pytestmark = pytest.mark.oldest  # ./run.sh test-oldest runs this module on torch 2.11

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "ds_configs").glob("*.json"))


def test_configs_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"fp32", "bf16", "fp16", "fp16_native"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_json_parses_validates_and_documents_itself(path):
    raw = ds_config.read_json(path)
    assert raw.get("_comment"), f"{path.name} needs a _comment saying what it sets"
    assert "gradient_clipping" in raw, (
        f"{path.name} must set gradient_clipping (DeepSpeed defaults to 1.0)"
    )
    spec = ds_config.parse(raw, path, cuda_available=True)
    assert not any(k.startswith("_") for k in spec.engine)
    engine_cfg = spec.engine_config(micro=32, accumulation=2, world=4)
    assert engine_cfg["train_batch_size"] == 256 and "optimizer" not in engine_cfg
    assert (
        engine_cfg["gradient_accumulation_steps"] == 2
        and engine_cfg["train_micro_batch_size_per_gpu"] == 32
    )
    assert spec.optimizer.lr == raw.get("optimizer", {"params": {"lr": 0.1}})["params"]["lr"]
    assert spec.precision == ds_config.precision(raw)


def test_precision_names():
    assert ds_config.precision(ds_config.read_json(REPO / "ds_configs/fp32.json")) == "fp32"
    assert (
        ds_config.precision(ds_config.read_json(REPO / "ds_configs/bf16.json"))
        == "autocast-bfloat16"
    )
    for name in ("fp16", "lars_fp16", "lamb_fp16", "fp16_comm_fp16"):  # FP16 through autocast
        raw = ds_config.read_json(REPO / f"ds_configs/{name}.json")
        assert ds_config.precision(raw) == "autocast-float16", name
    native = ds_config.read_json(REPO / "ds_configs/fp16_native.json")
    assert ds_config.precision(native) == "fp16"


def test_native_fp16_without_gpu_names_a_cpu_config():
    raw = ds_config.read_json(REPO / "ds_configs/fp16_native.json")
    with pytest.raises(ConfigError, match=r"fp16.enabled needs a CUDA GPU.*ds_configs/fp32.json"):
        ds_config.parse(raw, "fp16_native.json", cuda_available=False)


def test_native_fp16_engine_is_warned_about_with_its_measured_cost(caplog):
    raw = ds_config.read_json(REPO / "ds_configs/fp16_native.json")
    with caplog.at_level("WARNING"):
        ds_config.parse(raw, "fp16_native.json", cuda_available=True)
    assert "native fp16 engine, measured at 0.52x" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        ds_config.load(REPO / "ds_configs/fp16.json", cuda_available=False)  # autocast: CPU too
    assert "native" not in caplog.text


def test_unknown_top_level_key_is_named_with_a_suggestion():
    with pytest.raises(
        ConfigError,
        match=r"unknown top-level key 'gradient_cliping'.*Did you mean 'gradient_clipping'",
    ):
        ds_config.parse({"gradient_cliping": 1.0}, "x.json")


@pytest.mark.parametrize("key", ds_config.BATCH_KEYS)
def test_batch_keys_belong_to_the_trainer(key):
    with pytest.raises(
        ConfigError, match=f"'{key}' is set, but batch sizes belong to the trainer config"
    ):
        ds_config.parse({key: 8, "gradient_clipping": 0.0}, "x.json")


def test_scheduler_block_is_rejected():
    with pytest.raises(ConfigError, match="trainer owns the LR schedule"):
        ds_config.parse({"scheduler": {"type": "WarmupLR"}, "gradient_clipping": 0.0}, "x.json")


def test_malformed_json_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "gradient_clipping": 0.0,\n  "fp16": {"enabled": tru}\n}\n')
    with pytest.raises(ConfigError, match=r"bad.json:3:\d+: malformed JSON"):
        ds_config.read_json(bad)


def test_missing_json_file():
    with pytest.raises(ConfigError, match="no such file"):
        ds_config.read_json("ds_configs/nope.json")


def test_missing_gradient_clipping_is_warned(caplog):
    ds_config.parse({}, "x.json")
    assert "clips at 1.0" in caplog.text


def test_known_keys_exist_in_the_installed_deepspeed():
    """Guards DEEPSPEED_KEYS against typos and against keys a new DeepSpeed dropped."""
    src = "\n".join(
        p.read_text(errors="ignore") for p in Path(deepspeed.__file__).parent.rglob("*.py")
    )
    quoted = set(re.findall(r"[\"']([a-z_0-9]+)[\"']", src))
    missing = sorted(k for k in ds_config.DEEPSPEED_KEYS if k not in quoted)
    assert not missing, f"not found in deepspeed {deepspeed.__version__}: {missing}"


@pytest.mark.parametrize("kind", ["LARS", "Lamb"])
def test_layerwise_optimizers_need_zero_stage_0(kind):
    cfg = {
        "optimizer": {"type": kind, "params": {"lr": 1}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.0,
    }
    with pytest.raises(
        ConfigError, match=f"optimizer {kind} is layer-wise and needs zero_optimization.stage 0"
    ):
        ds_config.parse(cfg, "x.json")
