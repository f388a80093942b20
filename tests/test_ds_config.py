import json
import re
from pathlib import Path

import deepspeed
import pytest

from dstrain.core.errors import ConfigError
from dstrain.run import ds_config

pytestmark = pytest.mark.oldest  # ./run.sh test-oldest runs this module on torch 2.11

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "ds_configs").glob("*.json"))


def test_configs_are_shipped_and_the_docs_name_only_shipped_files():
    """The four precisions ship; every JSON a doc names in backticks (README's swap table,
    ds_configs/README.md; ``{a,b}`` and ``*`` expanded) exists. What each file sets is checked from
    the file itself (its _comment, its parsed spec: the next test), not from its name or the prose."""
    stems = {p.stem for p in SHIPPED}
    assert {"fp32", "bf16", "fp16", "fp16_native"} <= stems
    for doc in (REPO / "README.md", REPO / "ds_configs" / "README.md"):
        for name in re.findall(r"`(?:ds_configs/)?([\w{},*]+)\.json`", doc.read_text()):
            braces = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
            names = (
                {braces[1] + part + braces[3] for part in braces[2].split(",")}
                if braces
                else {name}
            )
            for one in names:
                match = [s for s in stems if s.startswith(one[:-1])] if one.endswith("*") else [one]
                assert match and set(match) <= stems, f"{doc.name} names {one}.json, not shipped"


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
    assert "lr" not in raw.get("optimizer", {}).get("params", {})  # optim.base_lr's (issue 53)
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


def keys_deepspeed_config_reads() -> set[str]:
    """Every key DeepSpeed's config parser can read: the string literals and string constants named
    in deepspeed/runtime/config.py (``DeepSpeedConfig``) and in each DeepSpeed function or class it
    calls to read a block (``get_monitor_config``, ``DeepSpeedZeroConfig``, ...), one level deep.
    A key found only elsewhere in DeepSpeed (a kernel, a launcher) is not a config key."""
    import ast
    import importlib
    import inspect
    import textwrap

    def literals(tree):
        return {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }

    def names(tree):
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        }

    def constants(module, tree):
        return {v for m in names(tree) if isinstance(v := getattr(module, m, None), str)}

    config = importlib.import_module("deepspeed.runtime.config")
    tree = ast.parse(inspect.getsource(config))
    read = literals(tree) | constants(config, tree)
    for name in names(tree):
        reader = getattr(config, name, None)
        if not (inspect.isfunction(reader) or inspect.isclass(reader)):
            continue
        if not reader.__module__.startswith("deepspeed") or reader.__module__ == config.__name__:
            continue
        sub = ast.parse(textwrap.dedent(inspect.getsource(reader)))
        read |= literals(sub) | constants(importlib.import_module(reader.__module__), sub)
    return read


def test_known_keys_exist_in_the_installed_deepspeed():
    """Guards DEEPSPEED_KEYS against typos and against keys a new DeepSpeed no longer reads."""
    read = keys_deepspeed_config_reads()
    missing = sorted(k for k in ds_config.DEEPSPEED_KEYS if k not in read)
    assert not missing, (
        f"deepspeed {deepspeed.__version__}'s config parser reads none of: {missing}"
    )
    # the check is narrower than "somewhere in DeepSpeed's sources": these are there, but no config
    # key, and a misspelt key is not read either
    for not_a_key in ("nccl", "cpu_adam", "train_batch_sizes", "tensorbord"):
        assert not_a_key not in read, not_a_key


@pytest.mark.parametrize(
    "kind, what",
    [
        ("LARS", "is layer-wise"),
        ("Lamb", "is layer-wise"),
        ("Muon", "steps each filter as a matrix"),
        ("SOAP", "preconditions each tensor along its dimensions"),
    ],
)
def test_whole_tensor_optimizers_need_zero_stage_0(kind, what):
    cfg = {
        "optimizer": {"type": kind, "params": {}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.0,
    }
    with pytest.raises(
        ConfigError, match=rf"optimizer {kind} {what}.* and needs zero_optimization.stage 0"
    ):
        ds_config.parse(cfg, "x.json")


def _leaves(block: dict, path: str = ""):
    """(dotted path, value) of every typed value in a JSON block (documentation keys skipped)."""
    for key, value in block.items():
        if key.startswith("_"):
            continue
        where = f"{path}.{key}" if path else key
        if isinstance(value, dict):
            yield from _leaves(value, where)
        else:
            yield where, value


def _set(block: dict, path: str, value) -> dict:
    import copy

    out = copy.deepcopy(block)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


MUTATIONS = [
    (path.stem, leaf)
    for path in SHIPPED
    for leaf, value in _leaves(ds_config.read_json(path))
    if not isinstance(value, str)  # numbers, bools, lists: each written as a string instead
]


@pytest.mark.parametrize("name, leaf", MUTATIONS, ids=[f"{n}:{p}" for n, p in MUTATIONS])
def test_every_value_of_every_shipped_json_is_typed(name, leaf):
    """Each number, bool and list the shipped configs set, written as a JSON string, is refused where the
    JSON is read, in one line naming the file and the key (was: a traceback where it was used)."""
    path = REPO / "ds_configs" / f"{name}.json"
    raw = ds_config.read_json(path)
    value = dict(_leaves(raw))[leaf]
    wrong = json_text(value)
    with pytest.raises(ConfigError) as err:
        ds_config.parse(_set(raw, leaf, wrong), path, cuda_available=True)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    assert leaf in message and "must be" in message, message
    assert "\n" not in message


def json_text(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


BASE = {"gradient_clipping": 0.0}
BAD_JSON = [
    # name, JSON (on top of BASE), the error line must match
    (
        "clipping auto",
        {"gradient_clipping": "auto"},
        'gradient_clipping must be a number, got "auto"',
    ),
    ("clipping negative", {"gradient_clipping": -1}, "gradient_clipping=-1: must be >= 0"),
    ("steps_per_print float", {"steps_per_print": 1.5}, "steps_per_print must be an integer"),
    ("prescale as 1", {"prescale_gradients": 1}, "prescale_gradients must be true or false, got 1"),
    ("predivide 0", {"gradient_predivide_factor": 0}, "gradient_predivide_factor=0: must be > 0"),
    ("comm dtype", {"communication_data_type": "int8"}, "communication_data_type must be one of"),
    ("allreduce op", {"gradient_allreduce_op": "max"}, "gradient_allreduce_op must be one of"),
    (
        "the LR in the JSON (its home is optim.base_lr)",
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},
        r"optimizer.params.lr=0.1: the LR has one home, the trainer config's optim.base_lr",
    ),
    (
        "momentum as string",
        {"optimizer": {"type": "LARS", "params": {"momentum": "10"}}},
        'optimizer.params.momentum must be a number, got "10"',
    ),
    (
        "trust coefficient 0",
        {"optimizer": {"type": "LARS", "params": {"trust_coefficient": 0}}},
        "optimizer.params.trust_coefficient=0: must be > 0",
    ),
    (
        "eps negative",
        {"optimizer": {"type": "Lamb", "params": {"eps": -1e-6}}},
        "optimizer.params.eps=-1e-06: must be >= 0",
    ),
    (
        "max_coeff string",
        {"optimizer": {"type": "Lamb", "params": {"max_coeff": "10"}}},
        "optimizer.params.max_coeff must be a number",
    ),
    (
        "betas out of range",
        {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}},
        r"optimizer.params.betas=\[0.9, 1.5\]: must be \[beta1, beta2\]",
    ),
    (
        "betas not a pair",
        {"optimizer": {"type": "Adam", "params": {"betas": 0.9}}},
        "optimizer.params.betas must be a list of two numbers, got 0.9",
    ),
    (
        "weight decay as string",
        {"optimizer": {"type": "SGD", "params": {"weight_decay": "5e-5"}}},
        "optimizer.params.weight_decay must be a number",
    ),
    (
        "exclude_bn_bias as string",
        {"optimizer": {"type": "SGD", "params": {"exclude_bn_bias": "false"}}},
        'optimizer.params.exclude_bn_bias must be true or false, got "false"',
    ),
    (
        "optimizer param typo",
        {"optimizer": {"type": "LARS", "params": {"trust_coeficient": 0.1}}},
        "unknown key 'optimizer.params.trust_coeficient'.*Did you mean 'trust_coefficient'",
    ),
    (
        "param of another optimizer",
        {"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}},
        "unknown key 'optimizer.params.betas' .optimizer SGD takes no such parameter",
    ),
    (
        "optimizer block typo",
        {"optimizer": {"type": "Lamb", "param": {}}},
        "unknown key 'optimizer.param'.*Did you mean 'params'",
    ),
    (
        "optimizer type not a string",
        {"optimizer": {"type": 3, "params": {}}},
        "optimizer.type must be a string, got 3",
    ),
    (
        "torch_autocast typo",
        {"torch_autocast": {"enabeld": True, "dtype": "bfloat16"}},
        "unknown key 'torch_autocast.enabeld'.*Did you mean 'enabled'",
    ),
    (
        "torch_autocast enabled as string",
        {"torch_autocast": {"enabled": "true"}},
        'torch_autocast.enabled must be true or false, got "true"',
    ),
    (
        "torch_autocast dtype",
        {"torch_autocast": {"enabled": True, "dtype": "float8"}},
        'torch_autocast.dtype must be one of .*got "float8"',
    ),
    (
        "torch_autocast not an object",
        {"torch_autocast": True},
        "torch_autocast must be a JSON object",
    ),
    (
        "fp16 typo",
        {"fp16": {"enabled": False, "loss_scale_windw": 100}},
        "unknown key 'fp16.loss_scale_windw'.*Did you mean 'loss_scale_window'",
    ),
    (
        "fp16 scale power as string",
        {"fp16": {"enabled": False, "initial_scale_power": "16"}},
        'fp16.initial_scale_power must be an integer, got "16"',
    ),
    (
        "fp16 window 0",
        {"fp16": {"enabled": False, "loss_scale_window": 0}},
        "fp16.loss_scale_window=0: must be >= 1",
    ),
    ("bf16 enabled as string", {"bf16": {"enabled": "yes"}}, "bf16.enabled must be true or false"),
    (
        "bf16 typo",
        {"bf16": {"enabled": False, "immediate_grad_updates": True}},
        "unknown key 'bf16.immediate_grad_updates'.*Did you mean 'immediate_grad_update'",
    ),
    (
        "zero typo (DeepSpeed's model)",
        {"zero_optimization": {"stage": 0, "reduce_bucket_sise": 5}},
        "unknown key 'zero_optimization.reduce_bucket_sise' .DeepSpeed refuses it.*reduce_bucket_size",
    ),
    (
        "zero value (DeepSpeed's model)",
        {"zero_optimization": {"stage": 0, "reduce_bucket_size": "lots"}},
        'zero_optimization.reduce_bucket_size: .*got "lots" .DeepSpeed\'s check',
    ),
    (
        "zero stage as string",
        {"zero_optimization": {"stage": "1"}},
        "zero_optimization.stage must be an integer",
    ),
    (
        "tensorboard typo (DeepSpeed's model)",
        {"tensorboard": {"enabled": False, "output_pat": "tb"}},
        "unknown key 'tensorboard.output_pat'",
    ),
    (
        "flops_profiler typo",
        {"flops_profiler": {"enabled": False, "profile_stp": 3}},
        "unknown key 'flops_profiler.profile_stp'.*Did you mean 'profile_step'",
    ),
    (
        "timers nested typo",
        {"timers": {"throughput": {"enabled": True, "synchronised": False}}},
        "unknown key 'timers.throughput.synchronised'.*Did you mean 'synchronized'",
    ),
    (
        "an unchecked DeepSpeed block",
        {"activation_checkpointing": {"partition_activations": True}},
        "'activation_checkpointing' is a DeepSpeed block dstrain does not check",
    ),
    (
        "comm block typo",
        {"dstrain_communication": {"compresion": "sign"}},
        "unknown key 'dstrain_communication.compresion'.*Did you mean 'compression'",
    ),
    (
        "comm value type",
        {"dstrain_communication": {"bucket_mb": "big"}},
        'dstrain_communication.bucket_mb must be a number, got "big"',
    ),
    (
        "a block DeepSpeed removed",
        {"sparse_attention": {"mode": "fixed"}},
        "DeepSpeed refuses this configuration: .*Sparse Attention has been removed",
    ),
]


@pytest.mark.parametrize("name, block, match", BAD_JSON, ids=[c[0] for c in BAD_JSON])
def test_bad_json_values_and_nested_keys_give_one_line_naming_file_and_key(
    name, block, match, evidence
):
    with pytest.raises(ConfigError, match=match) as err:
        ds_config.parse({**BASE, **block}, "ds_configs/x.json", cuda_available=True)
    assert str(err.value).startswith("ds_configs/x.json: ") and "\n" not in str(err.value)
    evidence(
        "bad input: JSON value",
        f"{name}: `{json.dumps(block)}`",
        exit=err.value.exit_code,
        seen=f"dstrain: error: {err.value}",
        disk="nothing written (read before anything starts; in-process: ds_config.parse)",
    )
