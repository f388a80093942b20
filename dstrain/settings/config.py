"""Trainer configuration: typed sections, YAML recipes, ``key=value`` overrides.

Load order is ``defaults <- YAML recipe <- command-line overrides``. OmegaConf
rejects unknown keys and wrong types; :func:`validate` holds every cross-field
rule. Every field carries a one-line help text with its unit
(``python -m dstrain --help-config`` prints them all).

Batch arithmetic is owned here, not by the DeepSpeed JSON: ``batch.global_size``
and ``batch.micro_per_rank`` decide ``train_batch_size``,
``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``, which
the trainer writes into the DeepSpeed config it hands to the engine (solved by
``dstrain/settings/ramp.py``). A JSON that sets any of the three is rejected (see
``dstrain/run/ds_config.py``). Each section is read by the module that owns its
technique: ``optim`` by schedule.py, ``batch`` by ramp.py, ``data`` by data/,
``polish`` by bn_refit.py, ``init`` by warm_start.py, ``fault`` by fault.py, ``checkpoint`` by checkpoint.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dstrain.core.errors import ConfigError
from dstrain.core.jsonspec import setting
from dstrain.settings.ramp import batch_arithmetic, batch_plan

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
FASHION_MNIST_DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"


@dataclass
class DataConfig:
    dataset: Literal["fashion_mnist", "imagefolder"] = setting(
        "fashion_mnist",
        "data set: fashion_mnist (idx files) | imagefolder (root/{train,val}/<class>/*)",
    )
    loader: Literal["auto", "dali", "torchvision", "synthetic"] = setting(
        "auto",
        "auto (DALI for image folders when installed, else torchvision) | dali | torchvision "
        "| synthetic (random device batches of the data set's shape, no files read)",
    )
    root: str = setting(
        "", "data directory (path); empty = /usr/share/datasets/fashion-mnist for fashion_mnist"
    )
    format: Literal["folder", "wds", "recordio"] = setting(
        "folder",
        "imagefolder: how root holds the images: folder (train/<class>/*, val/<class>/*) | wds "
        "(train/*.tar, val/*.tar WebDataset shards with .idx indexes) | recordio (train/*.rec, "
        "val/*.rec MXNet RecordIO with .idx); convert with python -m dstrain.data.convert",
    )
    val_labels: str = setting(
        "",
        "imagefolder, format folder: val/ holds the images directly, labelled by this file "
        "(image-net.org's LOC_val_solution.csv, or one class name or index per line in sorted "
        "file-name order); empty = val/<class>/ folders (path)",
    )
    download: bool = setting(
        True, "fashion_mnist only: download with torchvision when root has no idx files (bool)"
    )
    augment: bool = setting(True, "apply training augmentation (bool)")
    last_batch: Literal["drop", "fill"] = setting(
        "drop",
        "an epoch's last, incomplete global batch: drop (N mod B images unseen each epoch) | fill "
        "(completed from the next epoch's order, which starts after them: every batch size sees "
        "epochs x N images; compare batch sizes with it)",
    )
    image_size: int = setting(
        224, "imagefolder/synthetic: training crop and val crop side (pixels)"
    )
    val_resize: int = setting(256, "imagefolder: shorter side before the val center crop (pixels)")
    random_area: list[float] = setting(
        [0.08, 1.0],
        "imagefolder: random-resized-crop area range (fraction of the image); "
        "Fujitsu used [0.05, 0.9]",
    )
    random_aspect_ratio: list[float] = setting(
        [0.75, 1.3333333], "imagefolder: random-resized-crop aspect-ratio range (w/h)"
    )
    num_workers: int = setting(
        4,
        "imagefolder: DALI CPU threads, or torchvision DataLoader worker processes, "
        "per rank (count)",
    )
    prefetch: int = setting(
        2,
        "imagefolder: batches prepared ahead (DALI prefetch queue depth / DataLoader "
        "prefetch_factor per worker) (batches)",
    )
    hw_decoder_load: float = setting(
        0.9,
        "DALI on a GPU: share of JPEGs decoded by the GPU's hardware JPEG decoder (A100, H100, "
        "H200), the rest by CUDA nvJPEG; ignored where there is none. DALI's own default is 0.65; "
        "0.9 measured 1.09-1.16x faster on an H100 (docs/data.md) (fraction 0-1)",
    )
    pin_memory: bool = setting(
        True, "torchvision loader: pin host memory for faster H2D copies (bool)"
    )
    holdout: int = setting(
        0,
        "hold out this many training images (a fixed split, the same for every seed) and "
        "evaluate on them instead of the validation/test set, for tuning; 0 = evaluate on the "
        "validation set (images)",
    )
    limit_train: int = setting(0, "use only the first N training images, 0 = all (images)")
    limit_val: int = setting(0, "use only the first N validation images, 0 = all (images)")
    synthetic_train_size: int = setting(12800, "synthetic: training images per epoch (images)")
    synthetic_val_size: int = setting(1280, "synthetic: validation images (images)")


@dataclass
class ModelConfig:
    name: str = setting(
        "resnet_small", "resnet_small, or a torchvision classification model name such as resnet50"
    )
    num_classes: int = setting(10, "output classes (count)")
    in_channels: int = setting(1, "input image channels (count); torchvision models need 3")
    width: int = setting(
        16, "resnet_small: channels of the first stage, doubled per stage (channels)"
    )
    blocks_per_stage: int = setting(
        1, "resnet_small: residual blocks in each of the 3 stages (count)"
    )
    zero_init_residual: bool = setting(
        True, "zero-init the last BN gamma of each residual block (Goyal et al.) (bool)"
    )
    bn_span: int = setting(
        0,
        "BN span (ghost batch norm): training-mode BatchNorm2d statistics over consecutive groups of "
        "this many images, as each GPU of a large run computes them (Goyal 32, Fujitsu 42); must "
        "divide the micro batch; 0 = the whole micro batch (images)",
    )
    bn_group: int = setting(
        1,
        "BN group: training-mode BatchNorm2d statistics reduced over groups of this many "
        "consecutive ranks (NVIDIA's MLPerf bn_group; with bn_span, K x the span); must divide "
        "the ranks; 1 = each rank alone, the world size = SyncBN (ranks)",
    )
    bn_group_across_nodes: bool = setting(
        False,
        "allow a BN group to straddle a node boundary (its collectives then cross the network "
        "every BN layer) (bool)",
    )
    channels_last: bool = setting(False, "train in NHWC memory format (bool)")
    compile: bool = setting(
        False,
        "torch.compile the model (model.compile_backend, inductor by default; in place: "
        "checkpoints keep their keys); "
        "the first steps pay the compilation, logged (bool)",
    )
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = setting(
        "default",
        "torch.compile mode with model.compile=true; reduce-overhead adds CUDA graphs, "
        "max-autotune searches kernels (longer compile)",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = setting(
        "inductor",
        "torch.compile backend with model.compile=true: inductor generates kernels (the fast "
        "one); aot_eager traces forward and backward and runs them eagerly, eager only traces: "
        "to tell a code-generation problem from a tracing one, at eager speed",
    )


@dataclass
class BatchConfig:
    global_size: int = setting(256, "images per optimizer step summed over all ranks (images)")
    micro_per_rank: int = setting(
        0, "images per forward/backward on one rank; 0 = global_size / world_size (images)"
    )
    eval_per_rank: int = setting(1000, "images per evaluation forward on one rank (images)")
    ramp: list[list[int]] = setting(
        [],
        "batch-size ramp: later [epoch, global_size] switches, e.g. [[5, 4096]] (epochs, images)",
    )
    follow_noise: bool = setting(
        False,
        "a batch ramp that follows the gradient noise scale: at an epoch's end where the measured "
        "B_noise (log.noise_scale) has passed the global batch, the batch grows by "
        "batch.noise_factor up to batch.noise_cap from the next epoch, the LR following the "
        "scaling rule (bool)",
    )
    noise_factor: float = setting(
        2.0,
        "batch.follow_noise: the growth at a switch, rounded down to whole micro batches on "
        "every rank (factor)",
    )
    noise_cap: int = setting(0, "batch.follow_noise: the largest global batch (images)")
    noise_rewarm_epochs: float = setting(
        0.0,
        "batch.follow_noise: after a switch the LR moves from the old batch's to the new one's "
        "over this many epochs; 0 = at the switch (epochs)",
    )


@dataclass
class EMAConfig:
    decay: float = setting(
        0.0,
        "EMA of the weights: e <- decay*e + (1-decay)*w after every every_steps optimizer steps, "
        "kept in FP32 beside the model and evaluated with it (timm's default 0.9998); 0 = off "
        "(fraction in [0, 1))",
    )
    warmup: bool = setting(
        False,
        "timm's decay warmup: decay_t = min(decay, 1 - (1 + t/warmup_gamma)^-warmup_power) at "
        "update t (bool)",
    )
    warmup_gamma: float = setting(1.0, "decay warmup: the gamma of timm's ModelEmaV3 (updates)")
    warmup_power: float = setting(
        2 / 3, "decay warmup: the power of timm's ModelEmaV3 (3/4 suits short runs) (dimensionless)"
    )
    every_steps: int = setting(
        1, "update the EMA after every N optimizer steps; decay applies per update (steps)"
    )
    device: Literal["model", "cpu"] = setting(
        "model",
        "where the FP32 EMA is kept: model (its device) or cpu (saves GPU memory, copies the "
        "weights to the host each update)",
    )


@dataclass
class OptimConfig:
    base_lr: float = setting(
        0.1,
        "the LR per lr_reference_batch images (0.1: Goyal's SGD), scaled to the global batch and "
        "scheduled; its one home: a DeepSpeed JSON that sets optimizer.params.lr is refused (LR)",
    )
    lr_reference_batch: int = setting(256, "optim.base_lr is the LR for this global batch (images)")
    lr_scaling: Literal["linear", "sqrt", "none"] = setting(
        "linear", "peak LR from the batch: linear (lr*B/ref) | sqrt (lr*sqrt(B/ref)) | none"
    )
    warmup_epochs: float = setting(0.0, "warmup length (epochs, fractions allowed)")
    warmup: Literal["linear", "gradual", "hybrid"] = setting(
        "linear",
        "warmup shape: linear (from 0) | gradual (from base LR, Goyal) | hybrid (exp, then linear)",
    )
    warmup_start_factor: float = setting(
        1e-3, "hybrid warmup: first LR as a fraction of the peak LR (fraction)"
    )
    hybrid_exp_fraction: float = setting(
        0.5, "hybrid warmup: part of the warmup that is exponential (fraction)"
    )
    decay: Literal["cosine", "poly", "step", "constant"] = setting(
        "cosine", "LR decay after warmup: cosine | poly | step | constant"
    )
    end_lr_factor: float = setting(
        0.0, "LR at the last step as a fraction of the peak LR (fraction)"
    )
    end_lr: float = setting(
        0.0,
        "cosine/poly: LR at the last step, absolute; > 0 replaces end_lr_factor (MLPerf's LARS "
        "rules ask for exactly 0.0001, which a factor of the peak cannot always give) (LR)",
    )
    poly_power: float = setting(2.0, "poly decay exponent (dimensionless)")
    decay_epochs: float = setting(
        0.0,
        "cosine/poly: the decay's length after warmup, the end LR held afterwards; 0 = until the "
        "last epoch (Fujitsu's MLPerf v0.6 code decays over 52 of the 54 epochs after warmup) (epochs)",
    )
    step_milestones: list[float] = setting(
        [], "step decay: epochs at which the LR is multiplied by step_gamma (epochs)"
    )
    step_gamma: float = setting(0.1, "step decay factor per milestone (fraction)")
    wd_follows_lr: bool = setting(
        False,
        "scale weight decay by lr/peak_lr every step. dstrain's optimizers already multiply the "
        "decay by the LR, so this makes it proportional to lr^2 (Fujitsu scheduled wd this way "
        "only because their LARS kernel leaves the LR out; their recipes here keep it false) (bool)",
    )
    label_smoothing: float = setting(
        0.0, "label smoothing s: target (1-s)*onehot + s/K (fraction in [0, 1))"
    )
    ema: EMAConfig = field(default_factory=EMAConfig)


@dataclass
class LogConfig:
    every_steps: int = setting(
        10, "console and TensorBoard step scalars every N optimizer steps (steps)"
    )
    tensorboard: bool = setting(True, "write TensorBoard events to RUN_DIR/tb (bool)")
    lars_tensors: bool = setting(
        False,
        "LARS diagnosis: every log step, each tensor's trust ratio and step size relative to its "
        "norm, ||step|| / ||w||, in TensorBoard (lars_trust/*, lars_step/*) and the largest step "
        "on the console; costs a copy of the parameters a step (bool)",
    )
    noise_scale: bool = setting(
        True,
        "measure the gradient noise scale B_noise = tr(Sigma)/|G|^2 (McCandlish et al. 2018), the "
        "batch past which more images per step stop paying, from each micro batch's gradient "
        "against the step's; logged with the batch in force (train/noise_scale, history, "
        "summary.json); needs two batch sizes: several ranks or accumulation (bool)",
    )
    noise_scale_every: int = setting(
        4, "measure the gradient noise scale on every Nth optimizer step (steps)"
    )
    noise_scale_decay: float = setting(
        0.95,
        "the moving averages of B_noise's two estimates keep this much per measured step (fraction)",
    )
    mlperf: bool = setting(
        False,
        "write RUN_DIR/mlperf.log: MLPerf Training :::MLLOG lines (ResNet rules, ruleset 4.0.0) "
        "through the mlperf-logging package, rank 0; a resumed attempt writes mlperf-N.log (bool)",
    )
    mlperf_division: Literal["open", "closed"] = setting(
        "open", "MLPerf log: submission_division, open | closed (the closed rules: LARS or SGD)"
    )
    mlperf_org: str = setting("dstrain", "MLPerf log: submission_org (text)")
    mlperf_platform: str = setting(
        "", "MLPerf log: submission_platform; empty = <ranks>x<device name> (text)"
    )
    mlperf_status: Literal["onprem", "cloud", "preview", "research"] = setting(
        "research", "MLPerf log: submission_status, onprem | cloud | preview | research"
    )
    mlflow: bool = setting(
        False,
        "MLflow: the TensorBoard scalars, the resolved config (params) and summary.json, rank 0; "
        "needs the tracking extra (pip install -e '.[tracking]' in a checkout) (bool)",
    )
    mlflow_uri: str = setting(
        "",
        "MLflow tracking URI; empty = a local file store in RUN_DIR/mlruns, no server (text)",
    )
    mlflow_experiment: str = setting("", "MLflow experiment; empty = the recipe name (text)")
    wandb: bool = setting(
        False,
        "Weights & Biases: the same as log.mlflow, offline unless wandb_mode=online; needs the "
        "tracking extra (bool)",
    )
    wandb_mode: Literal["offline", "online"] = setting(
        "offline",
        "W&B mode: offline (files in RUN_DIR/wandb, `wandb sync` them later; no network) | online",
    )
    wandb_project: str = setting("dstrain", "W&B project (text)")


@dataclass
class CheckpointConfig:
    every_epochs: int = setting(
        1, "save a checkpoint every N epochs, and always after the last; 0 = only the last (epochs)"
    )
    keep_last: int = setting(
        2, "complete checkpoints kept on disk, older ones deleted; 0 = keep all (count)"
    )


@dataclass
class PolishConfig:
    enabled: bool = setting(
        False,
        "after the last epoch refit BN statistics on un-augmented training images, evaluate "
        "before/after, save RUN_DIR/polished/ (bool)",
    )
    images: int = setting(
        10240,
        "polish set size: training images (val transform) the BN statistics are re-estimated "
        "from, rounded down to whole batches; 0 = the whole training set (images)",
    )
    batches: int = setting(
        0,
        "polish set size in refit batches over all ranks instead of images; 0 = use images (batches)",
    )
    batch_per_rank: int = setting(
        0,
        "images per refit forward on one rank; 0 = the last training micro batch x model.bn_group "
        "(a BN group's images, normalised together as in training) (images)",
    )
    last_epochs_without_augmentation: int = setting(
        0,
        "train the final K epochs on un-augmented images with normal "
        "optimizer steps (Fujitsu: 5 of 90) (epochs)",
    )


@dataclass
class InitConfig:
    weights: str = setting(
        "",
        "start a fresh run from these weights (a state dict file: python -m dstrain.export's, "
        "torchvision's, timm's, a DeepSpeed module-states file), read as data; tensors whose name "
        "or shape the model lacks keep their own initialisation and are listed (a fine-tune's new "
        "head); the optimizer, schedule and step start fresh; a resume's checkpoint wins; "
        "empty = none (path)",
    )
    strict: bool = setting(
        False, "init.weights must fill every tensor of the model and hold no other (bool)"
    )


@dataclass
class FaultConfig:
    collective_timeout_s: float = setting(
        600.0,
        "a collective (gradient all-reduce, barrier, eval sum) that waits longer "
        "than this fails the run on every rank, exit 4: a dead or stuck rank "
        "cannot hang the job; keep it above the longest checkpoint write (seconds)",
    )
    max_consecutive_skips: int = setting(
        50,
        "FP16: stop the run (exit 3) after this many optimizer steps in a row skipped "
        "for gradient overflow; 0 = never (steps)",
    )
    check_disk: bool = setting(
        True, "at start-up, refuse a run_dir whose file system cannot hold two checkpoints (bool)"
    )
    stall_timeout_s: float = setting(
        1800.0,
        "a phase of the loop (data, forward/backward, collective, optimizer, checkpoint, "
        "evaluation batch, polish) that does not end within this long prints every thread's "
        "stack and exits 6, keeping the last checkpoint; generous because the first step with "
        "model.compile and the first DALI pass take minutes; keep it above the longest checkpoint "
        "write and evaluation batch; 0 = off (seconds)",
    )
    signal_grace_s: float = setting(
        20.0,
        "after a SIGTERM/SIGINT the step in flight gets this long to finish before the run exits "
        "75 without a new checkpoint (a second signal 2 s or more after the first exits at once); "
        "DeepSpeed's launcher sends SIGKILL 30 s after forwarding SIGTERM, Slurm's default "
        "KillWait is 30 s, OpenPBS's kill_delay 10 s; 0 = no limit (seconds)",
    )


@dataclass
class TrainConfig:
    name: str = setting("run", "recipe name, used in the default run directory (text)")
    epochs: int = setting(10, "training epochs (epochs)")
    seed: Union[int, str] = setting(  # typing.Union: what OmegaConf reads (not int | str)
        0,
        "seed for weights, data order and augmentation; auto = drawn from the OS when the run "
        "first starts, kept in config.yaml (a resume continues it; MLPerf's result runs each need "
        "their own) (integer or auto)",
    )
    deterministic: bool = setting(
        False,
        "GPU: deterministic cuDNN kernels, no autotuning: bit-identical reruns and resumes, "
        "slower (true/false)",
    )
    deepspeed_config: str = setting(
        "ds_configs/fp32.json", "DeepSpeed JSON (path); --deepspeed_config overrides it"
    )
    run_dir: str = setting("", "output directory (path); empty = runs/<name>-<timestamp>")
    resume: Literal["", "auto"] = setting(
        "",
        "'' = fresh run (refuses a run_dir with checkpoints), 'auto' = newest complete checkpoint in run_dir",
    )
    eval_every_epochs: int = setting(
        1,
        "evaluate on the validation set every N epochs and after the last (with log.mlperf: "
        "only on that grid, MLPerf's rule) (epochs)",
    )
    eval_offset_epochs: int = setting(
        0,
        "evaluate after epochs offset+N, offset+2N, ... (N = eval_every_epochs) and the last; "
        "MLPerf's evaluation offset (0-3 for ResNet: the grid of epochs = offset mod 4) (epochs)",
    )
    target_top1: float = setting(
        0.0,
        "stop training after the first evaluation whose top-1 reaches this (MLPerf ResNet: "
        "0.759), recorded in summary.json and the MLPerf log; 0 = train all epochs (fraction)",
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    polish: PolishConfig = field(default_factory=PolishConfig)
    init: InitConfig = field(default_factory=InitConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)


HINTS = {("data.dataset", "synthetic"): " (synthetic data is data.loader=synthetic)"}


def _omegaconf_message(
    err: OmegaConfBaseException, source: str, value: Any = None, key: str = "?"
) -> str:
    key = getattr(err, "full_key", None) or key
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if (
        type(err).__name__ == "ConfigKeyError"
        or "not in struct" in first_line
        or "Key '" in first_line
    ):
        return (
            f"{source}: unknown config key '{key}'. "
            "Run `python -m dstrain --help-config` for the valid keys."
        )
    shown = f" ({key}={value!r})" if value is not None and "[" not in key else ""
    hint = HINTS.get((key, value), "") if isinstance(value, str) else ""
    return f"{source}: bad value for '{key}'{shown}: {first_line}{hint}"


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
            raise ConfigError(
                f"{path}: malformed YAML: {str(err).splitlines()[0]}. Fix the file's syntax."
            ) from None
        try:
            cfg = OmegaConf.merge(cfg, yaml_cfg)
        except OmegaConfBaseException as err:
            raise ConfigError(_omegaconf_message(err, str(path))) from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(
                f"command line: '{item}' is not key=value (example: optim.warmup_epochs=5)"
            )
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
            while isinstance(value, dict) and len(value) == 1:
                value = next(iter(value.values()))
            key = item.split("=", 1)[0]
            raise ConfigError(_omegaconf_message(err, f"override '{item}'", value, key)) from None
    return cfg  # a DictConfig typed as TrainConfig


def polish_batch(cfg: TrainConfig, micro: int) -> int:
    """Images per BN-refit forward on one rank: ``polish.batch_per_rank``, else a BN group's
    training batch (``micro`` x ``model.bn_group``), which the refit normalises together as the
    group's ranks did in training (dstrain/techniques/bn_group.py)."""
    return cfg.polish.batch_per_rank or micro * cfg.model.bn_group


def validate(cfg: TrainConfig, world_size: int, node_sizes: list[int] | None = None) -> None:
    """Every cross-field and range rule, with a message that says what to change.

    Types and choices (``Literal``) were already checked by OmegaConf when the config was loaded;
    the rules are grouped by section below, and every broken one is reported at once.
    ``node_sizes``: the ranks of each node in rank order, where known (the node rules).
    """
    sections = (
        _run_rules,
        _data_rules,
        _model_rules,
        _batch_rules,
        _optim_rules,
        _log_rules,
        _polish_rules,
    )
    problems = [msg for rules in sections for ok, msg in rules(cfg, world_size) if not ok]
    problems += [msg for ok, msg in _node_rules(cfg, node_sizes or []) if not ok]
    if len(problems) == 1:
        raise ConfigError(f"invalid config: {problems[0]}")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


Rules = Iterator[tuple[bool, str]]  # (rule holds, message when it does not)


def _run_rules(cfg: TrainConfig, world_size: int) -> Rules:
    yield cfg.epochs >= 1, f"epochs={cfg.epochs}: must be >= 1"
    yield (
        cfg.seed == "auto" or (isinstance(cfg.seed, int) and cfg.seed >= 0),
        f"seed={cfg.seed!r}: must be an integer >= 0, or auto (drawn when the run starts)",
    )
    yield cfg.eval_every_epochs >= 1, f"eval_every_epochs={cfg.eval_every_epochs}: must be >= 1"
    yield (
        0 <= cfg.eval_offset_epochs < cfg.epochs,
        f"eval_offset_epochs={cfg.eval_offset_epochs}: must be >= 0 and below epochs={cfg.epochs}",
    )
    yield (
        0 <= cfg.target_top1 < 1,
        f"target_top1={cfg.target_top1}: must be a fraction in [0, 1) (0 = off; MLPerf: 0.759)",
    )
    yield cfg.log.mlperf_org != "", "log.mlperf_org: must not be empty (MLPerf's submission_org)"
    yield from _mlperf_grid_rules(cfg)
    yield cfg.log.every_steps >= 1, f"log.every_steps={cfg.log.every_steps}: must be >= 1"
    ckpt, fault = cfg.checkpoint, cfg.fault
    yield ckpt.every_epochs >= 0, f"checkpoint.every_epochs={ckpt.every_epochs}: must be >= 0"
    yield ckpt.keep_last >= 0, f"checkpoint.keep_last={ckpt.keep_last}: must be >= 0"
    yield (
        fault.collective_timeout_s > 0,
        f"fault.collective_timeout_s={fault.collective_timeout_s}: must be > 0 (seconds)",
    )
    yield (
        fault.max_consecutive_skips >= 0,
        f"fault.max_consecutive_skips={fault.max_consecutive_skips}: must be >= 0",
    )
    for key in ("stall_timeout_s", "signal_grace_s"):
        value = getattr(fault, key)
        yield value >= 0, f"fault.{key}={value}: must be >= 0 (seconds; 0 = off)"


# MLPerf's ResNet rule (training_rules.adoc, v4.0: "Every 4 epochs with offset 0 or 1 or 2 or 3")
MLPERF_EVAL_EVERY, MLPERF_EVAL_OFFSETS = 4, range(4)


def evaluates_last_epoch(cfg: TrainConfig) -> bool:
    """Whether the last epoch is evaluated wherever it falls: yes, except in a run logged for
    MLPerf, whose rules evaluate on the grid alone (a hit off the grid is not a hit)."""
    return not cfg.log.mlperf


def on_eval_grid(epoch: int, every: int, offset: int = 0) -> bool:
    """Whether 1-based ``epoch`` is on the evaluation grid: offset+N, offset+2N, ...
    (eval_every_epochs N, eval_offset_epochs)."""
    return epoch > offset and (epoch - offset) % every == 0


def _mlperf_grid_rules(cfg: TrainConfig) -> Rules:
    """A closed-division MLPerf log evaluates on ResNet's grid only, the last epoch included."""
    if not (cfg.log.mlperf and cfg.log.mlperf_division == "closed"):
        return
    every, offset, epochs = cfg.eval_every_epochs, cfg.eval_offset_epochs, cfg.epochs
    # the offset that puts the last epoch on the grid (none below 4 epochs: the first evaluation
    # comes after offset + 4)
    fix = (
        f"eval_offset_epochs={epochs % 4}"
        if epochs >= MLPERF_EVAL_EVERY
        else f"epochs={MLPERF_EVAL_EVERY} eval_offset_epochs=0"
    )
    yield (
        every == MLPERF_EVAL_EVERY and offset in MLPERF_EVAL_OFFSETS,
        f"log.mlperf_division=closed: MLPerf's ResNet rules evaluate every 4 epochs with offset "
        f"0-3, not eval_every_epochs={every} and eval_offset_epochs={offset}; set "
        f"eval_every_epochs=4 {fix} (the last epoch on the grid)",
    )
    if every == MLPERF_EVAL_EVERY and offset in MLPERF_EVAL_OFFSETS:
        next_on_grid = max(epochs + (offset - epochs) % 4, offset + 4)
        yield (
            on_eval_grid(epochs, every, offset),
            f"log.mlperf_division=closed: epochs={epochs} ends off the evaluation grid (every 4 "
            f"epochs after eval_offset_epochs={offset}), so its last epochs would never be "
            f"evaluated; "
            + (
                f"set {fix}, or epochs={next_on_grid} (the next epoch on the grid)"
                if epochs >= MLPERF_EVAL_EVERY
                else f"set epochs={next_on_grid} (the first epoch on the grid)"
            ),
        )


def _data_rules(cfg: TrainConfig, world_size: int) -> Rules:
    data = cfg.data
    area, aspect = list(data.random_area), list(data.random_aspect_ratio)
    yield (
        len(area) == 2 and 0 < area[0] <= area[1] <= 1,
        f"data.random_area={area}: must be [min, max] with 0 < min <= max <= 1",
    )
    yield (
        len(aspect) == 2 and 0 < aspect[0] <= aspect[1],
        f"data.random_aspect_ratio={aspect}: must be [min, max] with 0 < min <= max",
    )
    yield (
        data.image_size >= 1 and data.val_resize >= data.image_size,
        f"data.image_size={data.image_size}, data.val_resize={data.val_resize}: "
        "need 1 <= image_size <= val_resize",
    )
    yield (
        data.num_workers >= 0 and data.prefetch >= 1,
        f"data.num_workers={data.num_workers}, data.prefetch={data.prefetch}: "
        "need num_workers >= 0, prefetch >= 1",
    )
    yield (
        0 <= data.hw_decoder_load <= 1,
        f"data.hw_decoder_load={data.hw_decoder_load}: must be a fraction in [0, 1]",
    )
    yield (
        data.limit_train >= 0 and data.limit_val >= 0,
        "data.limit_train/limit_val must be >= 0 (0 = all)",
    )
    yield data.holdout >= 0, f"data.holdout={data.holdout}: must be >= 0 (0 = no holdout)"
    yield (
        data.format == "folder" or data.dataset == "imagefolder",
        f"data.format={data.format}: shards hold image data sets; set data.dataset=imagefolder "
        "(Fashion-MNIST is read from its idx files)",
    )
    yield (
        not data.val_labels or (data.format == "folder" and data.dataset == "imagefolder"),
        f"data.val_labels={data.val_labels!r}: a flat val/ folder is for data.dataset=imagefolder "
        "with data.format=folder; shards carry their labels (convert a flat val/ folder with "
        "python -m dstrain.data.convert SRC DST --val-labels FILE, then drop data.val_labels)",
    )
    yield (
        not (data.holdout and data.loader == "synthetic"),
        f"data.holdout={data.holdout} with data.loader=synthetic: synthetic data has no training "
        "images to hold out; set data.holdout=0",
    )


def _model_rules(cfg: TrainConfig, world_size: int) -> Rules:
    model = cfg.model
    yield model.num_classes >= 2, f"model.num_classes={model.num_classes}: must be >= 2"
    yield model.in_channels >= 1, f"model.in_channels={model.in_channels}: must be >= 1"
    yield (
        model.compile_backend == "inductor" or model.compile_mode == "default",
        f"model.compile_mode={model.compile_mode} is inductor's; with "
        f"model.compile_backend={model.compile_backend} set model.compile_mode=default",
    )
    yield from _bn_span_rules(cfg, world_size)
    yield from _bn_group_rules(cfg, world_size)
    if model.name == "resnet_small":
        return
    import torchvision  # heavy: only for recipes that name a torchvision model

    if model.name not in torchvision.models.list_models(module=torchvision.models):
        yield (
            False,
            (
                f"model.name={model.name!r}: not resnet_small nor a torchvision classification model "
                "(e.g. resnet18, resnet50, wide_resnet50_2)"
            ),
        )
        return
    yield (
        model.in_channels == 3,
        f"model.name={model.name} takes 3 input channels but model.in_channels={model.in_channels}; "
        "set model.in_channels=3 (grayscale data is repeated to 3 channels)",
    )


def _bn_group_rules(cfg: TrainConfig, world_size: int) -> Rules:
    group = cfg.model.bn_group
    yield group >= 1, f"model.bn_group={group}: must be >= 1 (1 = each rank alone)"
    yield (
        group < 1 or world_size % group == 0,
        f"model.bn_group={group} does not divide the {world_size} rank(s): BN groups are "
        f"{group} consecutive ranks; choose a divisor of {world_size} "
        f"(e.g. {max(d for d in range(1, min(max(group, 1), world_size) + 1) if world_size % d == 0)})",
    )


def node_split(group: int, node_sizes: list[int]) -> int | None:
    """The first node boundary (after node i, 0-based) that a group of ``group`` consecutive ranks
    would straddle, or None (launchers number ranks node by node)."""
    boundary = 0
    for node, size in enumerate(node_sizes[:-1]):
        boundary += size
        if boundary % group:
            return node
    return None


def _node_rules(cfg: TrainConfig, node_sizes: list[int]) -> Rules:
    group = cfg.model.bn_group
    if group <= 1 or cfg.model.bn_group_across_nodes or len(node_sizes) < 2:
        return
    if sum(node_sizes) % group:
        return  # the group does not divide the ranks: _bn_group_rules says so
    node = node_split(group, node_sizes)
    yield (
        node is None,
        f"model.bn_group={group} would split a BN group across nodes {node} and "
        f"{(node or 0) + 1} (ranks per node: {node_sizes[:4]}{'...' if len(node_sizes) > 4 else ''}): "
        "every BN layer would then wait on the network; choose a group that divides the ranks "
        "of each node, or set model.bn_group_across_nodes=true to allow it",
    )


def _bn_span_rules(cfg: TrainConfig, world_size: int) -> Rules:
    span, batch = cfg.model.bn_span, cfg.batch
    if span == 0:
        return
    yield span >= 2, f"model.bn_span={span}: must be >= 2 images (or 0 = the whole micro batch)"
    if span < 2 or batch.micro_per_rank < 0 or batch.global_size < 1:
        return
    try:
        micro, _ = batch_arithmetic(batch.global_size, batch.micro_per_rank, world_size)
    except ConfigError:
        return  # reported by the batch rules
    yield (
        micro % span == 0,
        f"model.bn_span={span} does not divide the micro batch of {micro} images per rank "
        f"(batch.micro_per_rank={batch.micro_per_rank}, {world_size} rank(s)): choose a span that "
        f"divides it (e.g. {max(d for d in range(1, min(span, micro) + 1) if micro % d == 0)}) "
        "or a micro batch that is a multiple of the span",
    )


def _batch_rules(cfg: TrainConfig, world_size: int) -> Rules:
    batch = cfg.batch
    yield batch.global_size >= 1, f"batch.global_size={batch.global_size}: must be >= 1"
    yield (
        batch.micro_per_rank >= 0,
        f"batch.micro_per_rank={batch.micro_per_rank}: must be >= 0 (0 = global/world)",
    )
    yield batch.eval_per_rank >= 1, f"batch.eval_per_rank={batch.eval_per_rank}: must be >= 1"
    if batch.follow_noise:
        yield (
            not batch.ramp,
            "batch.follow_noise and batch.ramp: one ramp at a time (the fixed one, or the one "
            "that follows the noise scale); drop one",
        )
        yield (
            cfg.log.noise_scale,
            "batch.follow_noise needs the noise scale measured: set log.noise_scale=true",
        )
        yield (
            batch.noise_cap > batch.global_size,
            f"batch.noise_cap={batch.noise_cap}: batch.follow_noise needs a cap above "
            f"batch.global_size={batch.global_size}",
        )
        yield batch.noise_factor > 1, f"batch.noise_factor={batch.noise_factor}: must be > 1"
        yield (
            batch.noise_rewarm_epochs >= 0,
            f"batch.noise_rewarm_epochs={batch.noise_rewarm_epochs}: must be >= 0",
        )
        yield (
            not (cfg.log.mlperf and cfg.log.mlperf_division == "closed"),
            "batch.follow_noise with log.mlperf_division=closed: MLPerf's closed division fixes "
            "the batch schedule before the run; use the open division",
        )
    if batch.global_size >= 1 and batch.micro_per_rank >= 0:
        try:  # the ramp's own rules (dstrain/settings/ramp.py), with this world size
            batch_plan(batch.global_size, batch.micro_per_rank, batch.ramp, world_size, cfg.epochs)
        except ConfigError as err:
            yield False, str(err)


def _log_rules(cfg: TrainConfig, world_size: int) -> Rules:
    decay, every = cfg.log.noise_scale_decay, cfg.log.noise_scale_every
    yield 0 <= decay < 1, f"log.noise_scale_decay={decay}: must be in [0, 1)"
    yield every >= 1, f"log.noise_scale_every={every}: must be >= 1"


def _optim_rules(cfg: TrainConfig, world_size: int) -> Rules:
    optim = cfg.optim
    ema = optim.ema
    yield 0 <= ema.decay < 1, f"optim.ema.decay={ema.decay}: must be in [0, 1) (0 = no EMA)"
    yield ema.every_steps >= 1, f"optim.ema.every_steps={ema.every_steps}: must be >= 1"
    yield (
        ema.warmup_gamma > 0 and ema.warmup_power > 0,
        f"optim.ema.warmup_gamma={ema.warmup_gamma}, warmup_power={ema.warmup_power}: both must "
        "be > 0",
    )
    yield (
        optim.base_lr > 0,
        f"optim.base_lr={optim.base_lr}: must be > 0 (the LR per optim.lr_reference_batch images)",
    )
    yield (
        optim.lr_reference_batch >= 1,
        f"optim.lr_reference_batch={optim.lr_reference_batch}: must be >= 1",
    )
    yield (
        0 < optim.warmup_start_factor <= 1,
        f"optim.warmup_start_factor={optim.warmup_start_factor}: must be in (0, 1]",
    )
    yield (
        0 < optim.hybrid_exp_fraction < 1,
        f"optim.hybrid_exp_fraction={optim.hybrid_exp_fraction}: must be in (0, 1)",
    )
    yield (
        0 <= optim.warmup_epochs < cfg.epochs,
        f"optim.warmup_epochs={optim.warmup_epochs}: must be >= 0 and shorter than epochs={cfg.epochs}",
    )
    yield (
        0.0 <= optim.end_lr_factor <= 1.0,
        f"optim.end_lr_factor={optim.end_lr_factor}: must be in [0, 1]",
    )
    yield (
        optim.end_lr >= 0 and not (optim.end_lr > 0 and optim.end_lr_factor > 0),
        f"optim.end_lr={optim.end_lr}: must be >= 0, and only one of end_lr and end_lr_factor "
        f"(={optim.end_lr_factor}) may be set; set the other to 0",
    )
    yield (
        optim.decay_epochs == 0
        or (optim.decay_epochs > 0 and optim.warmup_epochs + optim.decay_epochs <= cfg.epochs),
        f"optim.decay_epochs={optim.decay_epochs}: warmup ({optim.warmup_epochs}) plus decay must "
        f"fit in epochs={cfg.epochs}; 0 = decay until the last epoch",
    )
    yield (
        0.0 <= optim.label_smoothing < 1.0,
        f"optim.label_smoothing={optim.label_smoothing}: must be in [0, 1)",
    )
    yield (
        list(optim.step_milestones) == sorted(optim.step_milestones),
        f"optim.step_milestones={list(optim.step_milestones)}: must be in increasing order",
    )


def _polish_rules(cfg: TrainConfig, world_size: int) -> Rules:
    polish = cfg.polish
    yield (
        min(polish.images, polish.batches, polish.batch_per_rank) >= 0,
        f"polish.images={polish.images}, polish.batches={polish.batches}, "
        f"polish.batch_per_rank={polish.batch_per_rank}: must be >= 0 (0 = default)",
    )
    yield (
        0 <= polish.last_epochs_without_augmentation <= cfg.epochs,
        f"polish.last_epochs_without_augmentation={polish.last_epochs_without_augmentation}: "
        f"must be in [0, epochs={cfg.epochs}]",
    )


def help_lines(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """``key (type, default): help`` for every field of a :func:`~dstrain.core.jsonspec.setting`
    dataclass (the trainer config, or a JSON block's), nested sections flattened."""
    lines = []
    for fld in dataclasses.fields(cls):
        if fld.default is not dataclasses.MISSING:
            default = fld.default
        elif fld.default_factory is not dataclasses.MISSING:
            default = fld.default_factory()
        else:
            lines.append(
                f"{prefix}{fld.name} ({fld.type}, required): {fld.metadata.get('help', '')}"
            )
            continue
        if dataclasses.is_dataclass(default):
            lines += help_lines(type(default), prefix + fld.name + ".")
        else:
            lines.append(
                f"{prefix}{fld.name} ({fld.type}, default {default!r}): {fld.metadata.get('help', '')}"
            )
    return lines
