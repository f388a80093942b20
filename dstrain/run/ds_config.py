"""Read, check and complete the DeepSpeed JSON a user swaps to change precision/optimizer.

:func:`load` reads the file once into a :class:`DeepSpeedSpec`: the engine's
dict, the optimizer spec (dstrain/techniques/optim.py), our communication block
(dstrain/techniques/comm.py) and the precision name. Everything downstream takes the spec.

DeepSpeed 0.19 silently ignores unknown top-level keys, defaults
``gradient_clipping`` to 1.0 and has no notion of our trainer-owned batch and LR
schedule. This module closes those gaps before DeepSpeed sees the dict:

* top-level keys starting with ``_`` are documentation (``"_comment"``) and are
  stripped; any other unknown key is an error naming the key (and the closest
  known one);
* ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
  ``gradient_accumulation_steps`` are owned by the trainer config (``batch.*``)
  and rejected here, so batch arithmetic has one source;
* a ``scheduler`` block is rejected: the trainer sets the LR every step
  (``optim.*``) and two schedulers must never fight;
* ``fp16.enabled`` (DeepSpeed's native fp16 engine) without a CUDA device is
  rejected with the name of a config that runs on CPU, and on a GPU it is
  warned about: it measured 0.52x the speed of ``torch_autocast`` float16;
* a missing ``gradient_clipping`` is warned about (DeepSpeed would clip at 1.0);
* the ``optimizer`` block is parsed by dstrain/techniques/optim.py (the trainer builds the
  optimizer itself) and the ``dstrain_communication`` block by dstrain/techniques/comm.py;
  both are removed from what DeepSpeed sees;
* every value is typed where it is read (dstrain/core/jsonspec.py; the declarations are
  :data:`SCALARS`, :data:`DICT_BLOCKS`, :data:`READ_INSIDE` here, and dataclasses for the blocks
  dstrain uses as objects: each optimizer's parameters (``optim.OPTIMIZERS``) and
  ``comm.CommConfig``), unknown keys are refused in nested blocks too, blocks DeepSpeed would
  take unchecked and image training does not use (:data:`UNCHECKED`) are refused, and
  DeepSpeed's own config parser runs on the result (:func:`validate_engine`), its errors
  turned into one line naming the file.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.core import jsonspec
from dstrain.core.errors import ConfigError
from dstrain.techniques import comm, optim

log = logging.getLogger(__name__)

# Top-level keys DeepSpeed 0.19.8 reads (deepspeed/runtime/config.py and the
# sub-config parsers it calls). tests/test_ds_config.py checks each one still
# occurs in the installed DeepSpeed source.
DEEPSPEED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "steps_per_print",
        "dump_state",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "torch_autocast",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "wall_clock_breakdown",
        "memory_breakdown",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "flops_profiler",
        "activation_checkpointing",
        "aio",
        "data_types",
        "checkpoint",
        "data_efficiency",
        "compression_training",
        "autotuning",
        "pipeline",
        "disable_allgather",
        "timers",
        "compile",
        "use_data_before_expert_parallelism",
        "hybrid_engine",
        "dataloader_drop_last",
        "weight_quantization",
        "disable_python_gc",
        "managed_gradient_accumulation",
        "log_level",
        "tensor_parallel",
        "expert_parallel",
        "nebula",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "eigenvalue",
        "progressive_layer_drop",
        "sparse_attention",
        "quantize_training",
        "graph_harvesting",
    }
)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
CPU_CONFIGS = "ds_configs/fp32.json, ds_configs/bf16.json or ds_configs/fp16.json (torch_autocast)"

# The typed part of the JSON: every scalar DeepSpeed reads without checking its type (a string where
# a number belongs reached arithmetic deep inside the engine), and the blocks DeepSpeed reads as plain
# dicts (a misspelled key inside them was ignored: a torch_autocast typo trained in FP32).
COMM_DTYPE = jsonspec.choice("fp16", "bf16", "fp32", nullable=True)
SCALARS = {
    "gradient_clipping": jsonspec.non_negative(),
    "steps_per_print": jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
    "prescale_gradients": jsonspec.boolean(),
    "gradient_predivide_factor": jsonspec.positive(),
    "gradient_allreduce_op": jsonspec.choice("mean", "sum"),
    "communication_data_type": COMM_DTYPE,
    "seq_parallel_communication_data_type": COMM_DTYPE,
    "wall_clock_breakdown": jsonspec.boolean(),
    "memory_breakdown": jsonspec.boolean(),
    "dump_state": jsonspec.boolean(),
    "disable_allgather": jsonspec.boolean(),
    "zero_allow_untested_optimizer": jsonspec.boolean(),
    "zero_force_ds_cpu_optimizer": jsonspec.boolean(),
    "dataloader_drop_last": jsonspec.boolean(),
    "use_data_before_expert_parallelism": jsonspec.boolean(),
    "managed_gradient_accumulation": jsonspec.boolean(),
    "disable_python_gc": jsonspec.integer(),
    "log_level": jsonspec.choice("debug", "info", "warning", "error", "critical"),
    "mics_shard_size": jsonspec.integer(),
    "mics_hierarchical_params_gather": jsonspec.boolean(),
}
AUTOCAST_DTYPES = ("bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", "half", "torch.float16")
DICT_BLOCKS = {
    "torch_autocast": {
        "enabled": jsonspec.boolean(),
        "dtype": jsonspec.choice(*AUTOCAST_DTYPES),
        "lower_precision_safe_modules": jsonspec.Value("texts"),
    },
    "flops_profiler": {
        "enabled": jsonspec.boolean(),
        "recompute_fwd_factor": jsonspec.non_negative(),
        "profile_step": jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
        "module_depth": jsonspec.integer(),
        "top_modules": jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
        "detailed": jsonspec.boolean(),
        "output_file": jsonspec.Value("text", nullable=True),
    },
    "data_types": {"grad_accum_dtype": jsonspec.choice("fp32", "fp16", "bf16", nullable=True)},
    "timers": {
        "throughput": jsonspec.block(
            {"enabled": jsonspec.boolean(), "synchronized": jsonspec.boolean()}
        )
    },
}
# blocks DeepSpeed validates itself (pydantic, unknown keys forbidden): checked by validate_engine()
VALIDATED_BY_DEEPSPEED = frozenset(
    {
        "fp16",
        "bf16",
        "zero_optimization",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "comet",
        "compile",
        "hybrid_engine",
        "tensor_parallel",
        "weight_quantization",
    }
)
# DeepSpeed blocks read as plain dicts that image training has no use for: refused rather than handed
# over unchecked (DeepSpeed would ignore a misspelled key inside them)
UNCHECKED = {
    "activation_checkpointing": "for transformer layers; a ResNet has no checkpointed activations",
    "aio": "NVMe offload (ZeRO-Infinity), which the layer-wise optimizers cannot use",
    "autotuning": "the DeepSpeed autotuner launches its own experiments",
    "checkpoint": "dstrain writes checkpoints itself (checkpoint.* in the trainer config)",
    "data_efficiency": "curriculum learning for language models",
    "expert_parallel": "mixture-of-experts models",
    "pipeline": "pipeline parallelism for models split over GPUs",
}


# the checkout dstrain runs from (dstrain/run/ds_config.py -> its root): the recipes name their
# DeepSpeed JSON relative to it (ds_configs/fp32.json)
CHECKOUT = Path(__file__).resolve().parents[2]


def locate(path: str | Path) -> Path:
    """``path`` from the current folder, else, relative, from the checkout: a recipe's
    ``ds_configs/fp32.json`` when the ``dstrain`` command runs in another folder."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    shipped = CHECKOUT / path
    return shipped if shipped.is_file() else path


def read_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        here = Path.cwd().resolve()
        where = f" here ({here})" + ("" if here == CHECKOUT else f" or in {CHECKOUT}")
        where = "" if path.is_absolute() else where
        raise ConfigError(
            f"--deepspeed_config {path}: no such file{where}. Shipped configs are in "
            f"{CHECKOUT / 'ds_configs'}/."
        )
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path}:{err.lineno}:{err.colno}: malformed JSON: {err.msg}. "
            'Fix the syntax (JSON has no comments; use a "_comment" key).'
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object {{...}}")
    return data


@dataclass(frozen=True)
class DeepSpeedSpec:
    """One DeepSpeed JSON, read and checked once."""

    path: str
    engine: dict  # what DeepSpeed sees, before the trainer adds the batch keys
    optimizer: optim.OptimizerSpec  # the "optimizer" block (the trainer builds the optimizer)
    comm: comm.CommSpec | None  # the "dstrain_communication" block, or None: DeepSpeed's all-reduce
    precision: str  # fp32 | fp16 | bf16 | autocast-<dtype>

    @property
    def lossy_comm(self) -> bool:
        """Whether the gradient sync compresses (sign, PowerSGD): its average is not the gradient's."""
        return self.comm is not None and self.comm.config.compression != "none"

    def engine_config(self, micro: int, accumulation: int, world: int) -> dict:
        """The dict handed to deepspeed.initialize: the user's JSON plus the trainer-owned batch keys."""
        out = copy.deepcopy(self.engine)
        out.update(
            train_batch_size=micro * accumulation * world,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accumulation,
        )
        out.setdefault("steps_per_print", 10**9)  # the trainer prints its own progress
        if out.get("zero_optimization", {}).get("stage", 0):
            # dstrain's SGD is element-wise, so ZeRO's flat partitions change nothing for it (the
            # layer-wise LARS/LAMB are refused with ZeRO in parse); DeepSpeed asks to be told
            out.setdefault("zero_allow_untested_optimizer", True)
        # DeepSpeed's throughput timer waits for the device at every micro batch's forward and step
        # (get_accelerator().synchronize(), twice a step): the host then cannot queue the next step
        # while the GPU runs. The trainer measures images/s itself; a JSON may turn the timer back on.
        timers = out.setdefault("timers", {}).setdefault("throughput", {})
        timers.setdefault("enabled", False)
        return out


def parse(raw: dict, path: str | Path, cuda_available: bool | None = None) -> DeepSpeedSpec:
    """Validate a user JSON (its ``_``-prefixed keys are documentation) and return its spec."""
    cfg = {k: copy.deepcopy(v) for k, v in raw.items() if not k.startswith("_")}
    for key in cfg:
        if key not in DEEPSPEED_KEYS and key != comm.BLOCK:
            close = difflib.get_close_matches(key, DEEPSPEED_KEYS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"{path}: unknown top-level key '{key}' (DeepSpeed would silently ignore it).{hint}"
            )
    for key in BATCH_KEYS:
        if key in cfg:
            raise ConfigError(
                f"{path}: '{key}' is set, but batch sizes belong to the trainer config "
                "(batch.global_size, batch.micro_per_rank) so that they have one source. "
                f"Remove '{key}' from the JSON and set batch.global_size=... instead."
            )
    if "scheduler" in cfg:
        raise ConfigError(
            f"{path}: has a 'scheduler' block, but the trainer owns the LR schedule "
            "(optim.warmup_epochs, optim.decay, ...). Remove 'scheduler' from the JSON."
        )
    read_typed(cfg, str(path))
    native_fp16 = cfg.get("fp16", {}).get("enabled", False)
    if native_fp16:
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise ConfigError(
                f"{path}: fp16.enabled needs a CUDA GPU and none is visible. "
                f"On CPU use {CPU_CONFIGS}."
            )
        log.warning(
            "%s: fp16.enabled selects DeepSpeed's native fp16 engine, measured at 0.52x a bare "
            "PyTorch AMP loop on an H100; ds_configs/fp16.json (torch_autocast float16, FP32 "
            "master weights, dynamic loss scaling) ran at 0.96x",
            path,
        )
        if cfg.get("bf16", {}).get("enabled", False):
            raise ConfigError(f"{path}: fp16 and bf16 are both enabled; enable one of them.")
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage={stage!r}: use 0, 1, 2 or 3")
    optimizer = optim.parse_spec(cfg.get("optimizer"), str(path))
    if optimizer.whole_tensors and stage != 0:
        raise ConfigError(
            f"{path}: optimizer {optimizer.name} {optimizer.whole_tensors} and needs "
            f"zero_optimization.stage 0 (stage {stage} hands it flat partitions of the "
            'tensors). Set "zero_optimization": {"stage": 0}.'
        )
    # every problem with the block is reported before anything starts
    communication = comm.parse(cfg, str(path))
    if "gradient_clipping" not in cfg:
        log.warning(
            "%s sets no gradient_clipping: DeepSpeed 0.19 then clips at 1.0. "
            'Set "gradient_clipping": 0.0 to disable clipping explicitly.',
            path,
        )
    engine = {k: v for k, v in cfg.items() if k not in ("optimizer", comm.BLOCK)}
    spec = DeepSpeedSpec(str(path), engine, optimizer, communication, precision(cfg))
    validate_engine(spec)
    return spec


# inside the blocks DeepSpeed validates: the keys dstrain reads itself, and the precision blocks whole
# (pydantic would take "16" for 16 and say nothing; a config is written in one way)
READ_INSIDE = {
    "fp16": {
        "enabled": jsonspec.boolean(),
        "auto_cast": jsonspec.boolean(),
        "loss_scale": jsonspec.non_negative(),
        "initial_scale_power": jsonspec.integer(lambda v: 0 <= v < 64, "must be in [0, 64)"),
        "loss_scale_window": jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
        "hysteresis": jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
        "consecutive_hysteresis": jsonspec.boolean(),
        "min_loss_scale": jsonspec.positive(),
        "fp16_master_weights_and_grads": jsonspec.boolean(),
    },
    "bf16": {
        "enabled": jsonspec.boolean(),
        "immediate_grad_update": jsonspec.boolean(),
        "check_grad_overflow": jsonspec.boolean(),
        "bf16_master_weights_and_grads": jsonspec.boolean(),
        "bf16_optimizer_states": jsonspec.boolean(),
    },
    "zero_optimization": {"stage": jsonspec.integer()},
}
WHOLE = ("fp16", "bf16")  # declared whole above: an undeclared key inside is refused by dstrain


def read_typed(cfg: dict, source: str) -> None:
    """Type every scalar and dict block of ``cfg`` in place (see SCALARS, DICT_BLOCKS); refuse UNCHECKED."""
    for key, why in UNCHECKED.items():
        if key in cfg:
            raise ConfigError(
                f"{source}: '{key}' is a DeepSpeed block dstrain does not check ({why}); DeepSpeed "
                "would silently ignore a misspelled key inside it. Remove it from the JSON"
            )
    for key, value in SCALARS.items():
        if key in cfg:
            cfg[key] = value.read(cfg[key], key, source)
    for key, fields in DICT_BLOCKS.items():
        if key in cfg:
            cfg[key] = jsonspec.read_block(cfg[key], fields, key, source)
    for key in VALIDATED_BY_DEEPSPEED & cfg.keys():
        block = cfg[key]
        if not isinstance(block, dict):
            raise ConfigError(
                f"{source}: {key} must be a JSON object {{...}}, got {jsonspec.shown(block)}"
            )
        if key in WHOLE:
            cfg[key] = jsonspec.read_block(
                block, READ_INSIDE[key], key, source, "DeepSpeed refuses it"
            )
            continue
        for name, value in READ_INSIDE.get(key, {}).items():
            if name in block:
                block[name] = value.read(block[name], f"{key}.{name}", source)


def validate_engine(spec: DeepSpeedSpec) -> None:
    """Let DeepSpeed's own config parser check what it will be given, now, before anything starts.

    Its blocks with pydantic models (fp16, bf16, zero_optimization, the monitors, ...) refuse unknown
    keys and wrong types there; an error becomes one line naming the file, the key and the fix."""
    import deepspeed  # noqa: F401  (deepspeed.runtime.config needs the package initialised)
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)  # it logs its world size and every setting at INFO
    try:
        DeepSpeedConfig(spec.engine_config(micro=1, accumulation=1, world=1))
    except Exception as err:  # pydantic's ValidationError, DeepSpeedConfigError, assertions
        raise ConfigError(deepspeed_error(err, spec.path)) from None
    finally:
        ds_logger.setLevel(level)


def deepspeed_error(err: Exception, source: str) -> str:
    """DeepSpeed's config error as one line: ``file: key: what is wrong, got value``."""
    errors = getattr(err, "errors", None)
    if callable(errors):  # pydantic: the first problem, with its location in the JSON
        first = errors()[0]
        block = MODEL_BLOCKS.get(getattr(err, "title", ""), "")
        loc = ".".join(str(part) for part in first.get("loc", ()))
        key = loc if not block or loc.startswith(block + ".") else f"{block}.{loc}"
        given = jsonspec.shown(first.get("input"))
        if first.get("type") == "extra_forbidden":
            return str(
                jsonspec.unknown_key(
                    key.split(".")[-1],
                    known_fields(err),
                    ".".join(key.split(".")[:-1]),
                    source,
                    "DeepSpeed refuses it",
                )
            )
        return f"{source}: {key}: {first.get('msg', 'invalid')}, got {given} (DeepSpeed's check)"
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{source}: DeepSpeed refuses this configuration: {text}"


# pydantic model title -> the JSON block it parses (monitors name their block in the location)
MODEL_BLOCKS = {
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedZeroConfig": "zero_optimization",
    "CompileConfig": "compile",
    "HybridEngineConfig": "hybrid_engine",
    "TPTrainingConfig": "tensor_parallel",
    "WeightQuantConfig": "weight_quantization",
}


def known_fields(err: Exception) -> list[str]:
    """The field names (and aliases) of the pydantic model that raised ``err``, for a did-you-mean.

    Only ZeRO's: fp16 and bf16 are declared whole in READ_INSIDE, so an unknown key there is refused
    by dstrain before DeepSpeed sees it; other models' errors name the key without a suggestion."""
    if getattr(err, "title", "") != "DeepSpeedZeroConfig":
        return []
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return [info.alias or name for name, info in DeepSpeedZeroConfig.model_fields.items()]


def load(path: str | Path, cuda_available: bool | None = None) -> DeepSpeedSpec:
    found = locate(path)
    return parse(read_json(found), path if found == Path(path) else str(found), cuda_available)


def precision(cfg: dict) -> str:
    if cfg.get("fp16", {}).get("enabled", False):
        return "fp16"
    if cfg.get("bf16", {}).get("enabled", False):
        return "bf16"
    autocast = cfg.get("torch_autocast", {})
    if autocast.get("enabled", False):
        dtype = str(autocast.get("dtype", "bfloat16")).replace("torch.", "")
        return "autocast-" + {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(
            dtype, dtype
        )
    return "fp32"


def help_lines() -> list[str]:
    """The JSON side of ``--help-config``: what dstrain reads from the DeepSpeed JSON beyond
    DeepSpeed's own keys: each optimizer type's parameters and the dstrain_communication block."""
    from dstrain.settings.config import help_lines as lines_of
    from dstrain.techniques.comm import CommConfig
    from dstrain.techniques.optim import OPTIMIZERS

    lines = []
    for kind, entry in OPTIMIZERS.items():
        what = (
            " (layer-wise: ZeRO stage 0)"
            if entry.layerwise
            else f" ({entry.whole_tensors}: ZeRO stage 0)"
            if entry.whole_tensors
            else ""
        )
        lines.append(f'"optimizer": {{"type": "{kind}" (any case){what}, "params": {{...}}}}')
        lines += ["  " + line for line in lines_of(entry.params, "optimizer.params.")]
    return lines + lines_of(CommConfig, "dstrain_communication.")
