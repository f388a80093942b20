"""Read, check and complete the DeepSpeed JSON a user swaps to change precision/optimizer.

:func:`load` reads the file once into a :class:`DeepSpeedSpec`: the engine's
dict, the optimizer spec (dstrain/optim.py), our communication block
(dstrain/comm.py) and the precision name. Everything downstream takes the spec.

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
* the ``optimizer`` block is parsed by dstrain/optim.py (the trainer builds the
  optimizer itself) and the ``dstrain_communication`` block by dstrain/comm.py;
  both are removed from what DeepSpeed sees.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain import comm, optim
from dstrain.errors import ConfigError

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


def read_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"--deepspeed_config {path}: no such file. Shipped configs are in ds_configs/."
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

    def engine_config(self, micro: int, accumulation: int, world: int) -> dict:
        """The dict handed to deepspeed.initialize: the user's JSON plus the trainer-owned batch keys."""
        out = copy.deepcopy(self.engine)
        out.update(
            train_batch_size=micro * accumulation * world,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accumulation,
        )
        out.setdefault("steps_per_print", 10**9)  # the trainer prints its own progress
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
    if optimizer.layerwise and stage != 0:
        raise ConfigError(
            f"{path}: optimizer {optimizer.name} is layer-wise and needs zero_optimization.stage 0 "
            f"(stage {stage} hands it flat partitions, so per-layer norms are meaningless). "
            'Set "zero_optimization": {"stage": 0}.'
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
    return DeepSpeedSpec(str(path), engine, optimizer, communication, precision(cfg))


def load(path: str | Path, cuda_available: bool | None = None) -> DeepSpeedSpec:
    return parse(read_json(path), path, cuda_available)


def precision(cfg: dict) -> str:
    if cfg.get("fp16", {}).get("enabled", False):
        return "fp16"
    if cfg.get("bf16", {}).get("enabled", False):
        return "bf16"
    autocast = cfg.get("torch_autocast", {})
    if autocast.get("enabled", False):
        return "autocast-" + str(autocast.get("dtype", "bfloat16")).replace("torch.", "")
    return "fp32"
