"""Trainer configuration: typed sections, YAML recipes, ``key=value`` overrides.

Load order is ``defaults <- YAML recipe <- command-line overrides``. OmegaConf
rejects unknown keys and wrong types; :func:`validate` holds every cross-field
rule. Every field carries a one-line help text with its unit
(``python -m dstrain --help-config`` prints them all).

Batch arithmetic is owned here, not by the DeepSpeed JSON: ``batch.global_size``
and ``batch.micro_per_rank`` decide ``train_batch_size``,
``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``, which
the trainer writes into the DeepSpeed config it hands to the engine. A JSON that
sets any of the three is rejected (see ``dstrain/ds_config.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"
FASHION_MNIST_DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"


class ConfigError(Exception):
    """A user-facing configuration problem; the message names the key/file and the fix."""


def f(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    """A dataclass field with a help text (unit included) kept in its metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    dataset: str = f("fashion_mnist", "data set: fashion_mnist (idx files) | imagefolder (root/{train,val}/<class>/*)")
    loader: str = f("auto", "auto (DALI for image folders when installed, else torchvision) | dali | torchvision "
                            "| synthetic (random device batches of the data set's shape, no files read)")
    root: str = f("", "data directory (path); empty = /usr/share/datasets/fashion-mnist for fashion_mnist")
    download: bool = f(True, "fashion_mnist only: download with torchvision when root has no idx files (bool)")
    augment: bool = f(True, "apply training augmentation (bool)")
    image_size: int = f(224, "imagefolder/synthetic: training crop and val crop side (pixels)")
    val_resize: int = f(256, "imagefolder: shorter side before the val center crop (pixels)")
    random_area: list[float] = f([0.08, 1.0], "imagefolder: random-resized-crop area range (fraction of the image); "
                                       "Fujitsu used [0.05, 0.9]")
    random_aspect_ratio: list[float] = f([0.75, 1.3333333], "imagefolder: random-resized-crop aspect-ratio range (w/h)")
    num_workers: int = f(4, "imagefolder: DALI CPU threads, or torchvision DataLoader worker processes, "
                            "per rank (count)")
    prefetch: int = f(2, "imagefolder: batches prepared ahead (DALI prefetch queue depth / DataLoader "
                         "prefetch_factor per worker) (batches)")
    pin_memory: bool = f(True, "torchvision loader: pin host memory for faster H2D copies (bool)")
    limit_train: int = f(0, "use only the first N training images, 0 = all (images)")
    limit_val: int = f(0, "use only the first N validation images, 0 = all (images)")
    synthetic_train_size: int = f(12800, "synthetic: training images per epoch (images)")
    synthetic_val_size: int = f(1280, "synthetic: validation images (images)")


@dataclass
class ModelConfig:
    name: str = f("resnet_small", "resnet_small, or a torchvision classification model name such as resnet50")
    num_classes: int = f(10, "output classes (count)")
    in_channels: int = f(1, "input image channels (count); torchvision models need 3")
    width: int = f(16, "resnet_small: channels of the first stage, doubled per stage (channels)")
    blocks_per_stage: int = f(1, "resnet_small: residual blocks in each of the 3 stages (count)")
    zero_init_residual: bool = f(True, "zero-init the last BN gamma of each residual block (Goyal et al.) (bool)")
    channels_last: bool = f(False, "train in NHWC memory format (bool)")


@dataclass
class BatchConfig:
    global_size: int = f(256, "images per optimizer step summed over all ranks (images)")
    micro_per_rank: int = f(0, "images per forward/backward on one rank; 0 = global_size / world_size (images)")
    eval_per_rank: int = f(1000, "images per evaluation forward on one rank (images)")
    ramp: list = f([], "batch-size ramp: later [epoch, global_size] switches, e.g. [[5, 4096]] (epochs, images)")


@dataclass
class OptimConfig:
    base_lr: float = f(0.0, "LR per lr_reference_batch images; 0 = optimizer.params.lr of the DeepSpeed JSON (LR)")
    lr_reference_batch: int = f(256, "the JSON optimizer lr is the LR for this global batch (images)")
    lr_scaling: str = f("linear", "peak LR from the batch: linear (lr*B/ref) | sqrt (lr*sqrt(B/ref)) | none")
    warmup_epochs: float = f(0.0, "warmup length (epochs, fractions allowed)")
    warmup: str = f("linear", "warmup shape: linear (from 0) | gradual (from base LR, Goyal) | hybrid (exp, then linear)")
    warmup_start_factor: float = f(1e-3, "hybrid warmup: first LR as a fraction of the peak LR (fraction)")
    hybrid_exp_fraction: float = f(0.5, "hybrid warmup: part of the warmup that is exponential (fraction)")
    decay: str = f("cosine", "LR decay after warmup: cosine | poly | step | constant")
    end_lr_factor: float = f(0.0, "LR at the last step as a fraction of the peak LR (fraction)")
    poly_power: float = f(2.0, "poly decay exponent (dimensionless)")
    step_milestones: list = f([], "step decay: epochs at which the LR is multiplied by step_gamma (epochs)")
    step_gamma: float = f(0.1, "step decay factor per milestone (fraction)")
    wd_follows_lr: bool = f(False, "scale weight decay by lr/peak_lr every step (Fujitsu) (bool)")
    label_smoothing: float = f(0.0, "label smoothing s: target (1-s)*onehot + s/K (fraction in [0, 1))")


@dataclass
class LogConfig:
    every_steps: int = f(10, "console and TensorBoard step scalars every N optimizer steps (steps)")
    tensorboard: bool = f(True, "write TensorBoard events to RUN_DIR/tb (bool)")


@dataclass
class CheckpointConfig:
    every_epochs: int = f(1, "save a checkpoint every N epochs, and always after the last; 0 = only the last (epochs)")
    keep_last: int = f(2, "complete checkpoints kept on disk, older ones deleted; 0 = keep all (count)")


@dataclass
class PolishConfig:
    enabled: bool = f(False, "after the last epoch refit BN statistics on un-augmented training images, evaluate "
                             "before/after, save RUN_DIR/polished/ (bool)")
    images: int = f(10240, "polish set size: training images (val transform) the BN statistics are re-estimated "
                           "from, rounded down to whole batches; 0 = the whole training set (images)")
    batches: int = f(0, "polish set size in refit batches over all ranks instead of images; 0 = use images (batches)")
    batch_per_rank: int = f(0, "images per refit forward on one rank; 0 = the last training micro batch (images)")
    last_epochs_without_augmentation: int = f(0, "train the final K epochs on un-augmented images with normal "
                                                 "optimizer steps (Fujitsu: 5 of 90) (epochs)")


@dataclass
class FaultConfig:
    collective_timeout_s: float = f(600.0, "a collective (gradient all-reduce, barrier, eval sum) that waits longer "
                                           "than this fails the run on every rank, exit 4: a dead or stuck rank "
                                           "cannot hang the job; keep it above the longest checkpoint write (seconds)")
    max_consecutive_skips: int = f(50, "FP16: stop the run (exit 3) after this many optimizer steps in a row skipped "
                                       "for gradient overflow; 0 = never (steps)")
    check_disk: bool = f(True, "at start-up, refuse a run_dir whose file system cannot hold two checkpoints (bool)")


@dataclass
class TrainConfig:
    name: str = f("run", "recipe name, used in the default run directory (text)")
    epochs: int = f(10, "training epochs (epochs)")
    seed: int = f(0, "seed for weights, data order and augmentation (integer)")
    deepspeed_config: str = f("ds_configs/fp32.json", "DeepSpeed JSON (path); --deepspeed_config overrides it")
    run_dir: str = f("", "output directory (path); empty = runs/<name>-<timestamp>")
    resume: str = f("", "'' = fresh run (refuses a run_dir with checkpoints), 'auto' = newest complete checkpoint in run_dir")
    eval_every_epochs: int = f(1, "evaluate on the validation set every N epochs and after the last (epochs)")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    polish: PolishConfig = field(default_factory=PolishConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)


def _omegaconf_message(err: OmegaConfBaseException, source: str) -> str:
    key = getattr(err, "full_key", None) or "?"
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if type(err).__name__ == "ConfigKeyError" or "not in struct" in first_line or "Key '" in first_line:
        return (f"{source}: unknown config key '{key}'. "
                "Run `python -m dstrain --help-config` for the valid keys.")
    return f"{source}: bad value for '{key}': {first_line}"


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe is a YAML path or the name of a file in dstrain/recipes/."""
    path = Path(recipe)
    if path.is_file():
        return path
    named = RECIPE_DIR / (recipe if recipe.endswith(".yaml") else recipe + ".yaml")
    if named.is_file():
        return named
    known = ", ".join(sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
    raise ConfigError(f"--config {recipe}: no such file or recipe. Shipped recipes: {known}")


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults <- YAML recipe <- ``key=value`` overrides; returns a typed, unvalidated config."""
    cfg = OmegaConf.structured(TrainConfig)
    if recipe:
        path = resolve_recipe_path(recipe)
        try:
            yaml_cfg = OmegaConf.load(path)
        except Exception as err:  # yaml.YAMLError and friends
            raise ConfigError(f"{path}: malformed YAML: {str(err).splitlines()[0]}. Fix the file's syntax.") from None
        try:
            cfg = OmegaConf.merge(cfg, yaml_cfg)
        except OmegaConfBaseException as err:
            raise ConfigError(_omegaconf_message(err, str(path))) from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"command line: '{item}' is not key=value (example: optim.warmup_epochs=5)")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            raise ConfigError(_omegaconf_message(err, f"override '{item}'")) from None
    return cfg  # a DictConfig typed as TrainConfig


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Every cross-field rule, with a message that says what to change."""
    problems: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            problems.append(msg)

    d, m, b, o = cfg.data, cfg.model, cfg.batch, cfg.optim
    need(cfg.epochs >= 1, f"epochs={cfg.epochs}: must be >= 1")
    need(d.dataset in ("fashion_mnist", "imagefolder"), f"data.dataset={d.dataset!r}: use fashion_mnist or "
         "imagefolder" + (" (synthetic data is data.loader=synthetic)" if d.dataset == "synthetic" else ""))
    need(d.loader in ("auto", "dali", "torchvision", "synthetic"),
         f"data.loader={d.loader!r}: use auto, dali, torchvision or synthetic")
    area, aspect = list(d.random_area), list(d.random_aspect_ratio)
    need(len(area) == 2 and 0 < area[0] <= area[1] <= 1,
         f"data.random_area={area}: must be [min, max] with 0 < min <= max <= 1")
    need(len(aspect) == 2 and 0 < aspect[0] <= aspect[1],
         f"data.random_aspect_ratio={aspect}: must be [min, max] with 0 < min <= max")
    need(d.image_size >= 1 and d.val_resize >= d.image_size,
         f"data.image_size={d.image_size}, data.val_resize={d.val_resize}: need 1 <= image_size <= val_resize")
    need(d.num_workers >= 0 and d.prefetch >= 1,
         f"data.num_workers={d.num_workers}, data.prefetch={d.prefetch}: need num_workers >= 0, prefetch >= 1")
    need(d.limit_train >= 0 and d.limit_val >= 0, "data.limit_train/limit_val must be >= 0 (0 = all)")
    need(m.num_classes >= 2, f"model.num_classes={m.num_classes}: must be >= 2")
    need(m.in_channels >= 1, f"model.in_channels={m.in_channels}: must be >= 1")
    need(b.global_size >= 1, f"batch.global_size={b.global_size}: must be >= 1")
    need(b.micro_per_rank >= 0, f"batch.micro_per_rank={b.micro_per_rank}: must be >= 0 (0 = global/world)")
    need(b.eval_per_rank >= 1, f"batch.eval_per_rank={b.eval_per_rank}: must be >= 1")
    if b.global_size >= 1 and b.micro_per_rank >= 0:
        from dstrain.ramp import batch_plan
        try:
            batch_plan(b.global_size, b.micro_per_rank, b.ramp, world_size, cfg.epochs)
        except ConfigError as err:
            problems.append(str(err))
    need(o.base_lr >= 0, f"optim.base_lr={o.base_lr}: must be >= 0 (0 = take the JSON's optimizer lr)")
    need(o.lr_reference_batch >= 1, f"optim.lr_reference_batch={o.lr_reference_batch}: must be >= 1")
    need(o.lr_scaling in ("linear", "sqrt", "none"),
         f"optim.lr_scaling={o.lr_scaling!r}: use linear, sqrt or none")
    need(o.warmup in ("linear", "gradual", "hybrid"), f"optim.warmup={o.warmup!r}: use linear, gradual or hybrid")
    need(0 < o.warmup_start_factor <= 1, f"optim.warmup_start_factor={o.warmup_start_factor}: must be in (0, 1]")
    need(0 < o.hybrid_exp_fraction < 1, f"optim.hybrid_exp_fraction={o.hybrid_exp_fraction}: must be in (0, 1)")
    need(o.decay in ("cosine", "poly", "step", "constant"),
         f"optim.decay={o.decay!r}: use cosine, poly, step or constant")
    need(0 <= o.warmup_epochs < cfg.epochs,
         f"optim.warmup_epochs={o.warmup_epochs}: must be >= 0 and shorter than epochs={cfg.epochs}")
    need(0.0 <= o.end_lr_factor <= 1.0, f"optim.end_lr_factor={o.end_lr_factor}: must be in [0, 1]")
    need(0.0 <= o.label_smoothing < 1.0, f"optim.label_smoothing={o.label_smoothing}: must be in [0, 1)")
    need(list(o.step_milestones) == sorted(o.step_milestones),
         f"optim.step_milestones={list(o.step_milestones)}: must be in increasing order")
    need(cfg.log.every_steps >= 1, f"log.every_steps={cfg.log.every_steps}: must be >= 1")
    need(cfg.checkpoint.every_epochs >= 0, f"checkpoint.every_epochs={cfg.checkpoint.every_epochs}: must be >= 0")
    need(cfg.checkpoint.keep_last >= 0, f"checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 0")
    need(cfg.eval_every_epochs >= 1, f"eval_every_epochs={cfg.eval_every_epochs}: must be >= 1")
    need(cfg.resume in ("", "auto"), f"resume={cfg.resume!r}: use '' (fresh run) or 'auto'")
    fc = cfg.fault
    need(fc.collective_timeout_s > 0, f"fault.collective_timeout_s={fc.collective_timeout_s}: must be > 0 (seconds)")
    need(fc.max_consecutive_skips >= 0, f"fault.max_consecutive_skips={fc.max_consecutive_skips}: must be >= 0")
    pc = cfg.polish
    need(min(pc.images, pc.batches, pc.batch_per_rank) >= 0,
         f"polish.images={pc.images}, polish.batches={pc.batches}, polish.batch_per_rank={pc.batch_per_rank}: "
         "must be >= 0 (0 = default)")
    need(0 <= pc.last_epochs_without_augmentation <= cfg.epochs,
         f"polish.last_epochs_without_augmentation={pc.last_epochs_without_augmentation}: must be in "
         f"[0, epochs={cfg.epochs}]")
    if m.name != "resnet_small":
        import torchvision

        if m.name not in torchvision.models.list_models(module=torchvision.models):
            problems.append(f"model.name={m.name!r}: not resnet_small nor a torchvision classification model "
                            "(e.g. resnet18, resnet50, wide_resnet50_2)")
        elif m.in_channels != 3:
            problems.append(f"model.name={m.name} takes 3 input channels but model.in_channels={m.in_channels}; "
                            "set model.in_channels=3 (grayscale data is repeated to 3 channels)")
    if len(problems) == 1:
        raise ConfigError(f"invalid config: {problems[0]}")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def batch_arithmetic(global_size: int, micro_per_rank: int, world_size: int) -> tuple[int, int]:
    """Return (micro batch per rank, gradient accumulation steps) for a global batch.

    The single place where ``global = micro x accumulation x world`` is solved.
    """
    if global_size % world_size:
        raise ConfigError(
            f"batch.global_size={global_size} is not divisible by the world size {world_size}; "
            f"use a multiple of {world_size} (e.g. {max(world_size, global_size // world_size * world_size)})")
    per_rank = global_size // world_size
    micro = micro_per_rank or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"batch.micro_per_rank={micro} does not divide the per-rank batch {per_rank} "
            f"(batch.global_size={global_size} / world size {world_size}); pick a divisor of {per_rank} or 0")
    return micro, per_rank // micro


def help_lines(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """``key (type, default): help`` for every field, nested sections flattened."""
    lines = []
    for fld in dataclasses.fields(cls):
        default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
        if dataclasses.is_dataclass(default):
            lines += help_lines(type(default), prefix + fld.name + ".")
        else:
            lines.append(f"{prefix}{fld.name} ({fld.type}, default {default!r}): {fld.metadata.get('help', '')}")
    return lines
