"""Client optimizers built from the DeepSpeed JSON ``optimizer`` block.

:func:`parse_spec` reads the block once into an :class:`OptimizerSpec` (each
parameter typed and range-checked against its type's entry in :data:`OPTIMIZERS`, the one
table of what each type takes, how it is built and what it keeps); :func:`build_optimizer` builds it for a model.

The trainer builds the optimizer itself so that parameter groups can be chosen
by tensor shape: tensors with ``ndim <= 1`` (BN gamma/beta, biases) get no
weight decay (Goyal et al.). The result is handed to ``deepspeed.initialize``
as the client optimizer, so DeepSpeed's precision wrappers, clipping and
checkpointing apply as usual. Every implementation gets the groups of
:func:`param_groups`: DeepSpeed's FusedLamb, which cannot exclude a group from
its trust ratio, gets the BN/bias group's ratio clamp pinned to [1, 1]
(:func:`fused_lamb_groups`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from dstrain.core import jsonspec
from dstrain.core.errors import ConfigError
from dstrain.techniques.lamb import LAMB
from dstrain.techniques.lars import LARS, TRUST_DECAY
from dstrain.techniques.muon import ADJUST_LR, Muon, muon_groups

log = logging.getLogger(__name__)


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    exclude_bn_bias: bool = True,
    layerwise: bool = False,
    bn_bias_lr_factor: float = 1.0,
) -> list[dict]:
    """Two groups by tensor shape: ``ndim > 1`` (conv/FC weights) and ``ndim <= 1`` (BN, biases).

    The second gets no weight decay and, for layer-wise optimizers (``layerwise``),
    ``lars_exclude=True``: no trust ratio. Shape, not name: torchvision's downsample
    BN is called ``downsample.1``.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if (exclude_bn_bias and p.ndim <= 1) else decay).append(p)
    log.info(
        "param groups: %d tensors (%d values) with weight decay %.3g%s, %d BN/bias tensors (%d values) "
        "without",
        len(decay),
        sum(p.numel() for p in decay),
        weight_decay,
        " and layer-wise adaptation" if layerwise else "",
        len(no_decay),
        sum(p.numel() for p in no_decay),
    )
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
        if layerwise:
            groups[-1]["lars_exclude"] = True
        if bn_bias_lr_factor != 1.0:  # the records' BN/bias parameters step at the full LR
            groups[-1]["lr_factor"] = bn_bias_lr_factor
    return groups


# torch's own choice of implementation (foreach=None): multi-tensor on GPU, per-tensor on CPU,
# where bench/optimizer_step.py measures foreach SGD 2.9x slower on ResNet-50's parameters.
def _sgd(groups, lr, momentum, weight_decay, nesterov, dampening):
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, dampening=dampening)


def _adamw(groups, lr, betas, eps, weight_decay):
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)


def _adam(groups, lr, betas, eps, weight_decay):
    return torch.optim.Adam(groups, lr=lr, betas=tuple(betas), eps=eps)


# weight_decay is accepted by every builder but already set per group by param_groups().
def _lars(groups, lr, weight_decay, **params):
    return LARS(groups, lr=lr, **params)


def _muon(groups, lr, sgd_lr_factor, **params):
    """``"type": "Muon"``: convolution filters by Muon, the rest by Nesterov SGD (muon.py)."""
    groups = muon_groups(groups, sgd_lr_factor)
    filters = sum(len(g["params"]) for g in groups if g["muon"])
    others = sum(len(g["params"]) for g in groups if not g["muon"])
    log.info(
        "Muon: %d convolution filters as matrices, %d other tensors by Nesterov SGD at %g x the LR",
        filters,
        others,
        sgd_lr_factor,
    )
    if not filters:
        raise ValueError("the model has no convolution filters for Muon to step; use SGD or LARS")
    return Muon(groups, lr=lr, **params)


def _soap(groups, lr, betas, **params):
    """``"type": "SOAP"``: pytorch_optimizer's SOAP (Vyas et al. 2024, Adam in Shampoo's
    eigenbasis), pinned in pyproject.toml's ``optimizers`` extra. Tensors keep their logical shape
    (data_format channels_first whatever the memory layout: its channels_last means NHWC-shaped
    tensors, which torch's are not)."""
    from pytorch_optimizer import SOAP

    log.info(
        "SOAP: pytorch_optimizer %s (Adam in Shampoo's eigenbasis)", _version("pytorch_optimizer")
    )
    return SOAP(groups, lr=lr, betas=tuple(betas), data_format="channels_first", **params)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


class OpBuildError(RuntimeError):
    """A DeepSpeed CUDA op could not be built or loaded: a property of the machine, not of the config."""


def deepspeed_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19's op builder can parse it, or None if it already can.

    torch builds for Hopper/Blackwell list arch-specific targets such as ``9.0a`` or ``10.0f``;
    DeepSpeed reads each entry as ``int(minor)`` and fails on ``'0a'``. Its ops use no
    arch-specific instructions, so the plain ``9.0`` builds the same kernels."""
    if not value:
        return None
    entries = [e for e in value.replace(";", " ").split() if e]
    fixed = []
    for entry in entries:
        arch, ptx = (entry[:-4], "+PTX") if entry.upper().endswith("+PTX") else (entry, "")
        major, _, minor = arch.partition(".")
        minor = minor.rstrip("abcdefghijklmnopqrstuvwxyz")
        fixed.append(f"{major}.{minor}{ptx}" if minor else entry)
    out = ";".join(dict.fromkeys(fixed))
    return out if fixed != entries else None


@contextlib.contextmanager
def _parsable_arch_list():
    """Hand DeepSpeed's op builder an arch list it can parse, for the duration of the build."""
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = deepspeed_arch_list(old)
    if fixed is not None:
        log.info(
            "TORCH_CUDA_ARCH_LIST=%s: DeepSpeed's op builder cannot parse arch suffixes; "
            "building its ops for %s",
            old,
            fixed,
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    try:
        yield
    finally:
        if fixed is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old


def load_fused_lamb_op() -> None:
    """Build (or load the cached) DeepSpeed FusedLamb CUDA op; :class:`OpBuildError` says why not."""
    if not torch.cuda.is_available():
        raise OpBuildError("it is a CUDA op and no CUDA device is visible")
    # a compiler, CUDA toolkit or arch problem: reported with the op builder's own message
    try:
        from deepspeed.ops.op_builder import FusedLambBuilder

        builder = FusedLambBuilder()
        compatible = builder.is_compatible()
        if compatible:
            with _parsable_arch_list():
                builder.load()
    except Exception as err:
        raise OpBuildError(f"{type(err).__name__}: {err}") from err
    if not compatible:
        raise OpBuildError("DeepSpeed reports its FusedLamb op incompatible with this machine")


def _dstrain_lamb(groups, lr, **params):
    """dstrain's LAMB; the group weight decay set by param_groups() overrides the default."""
    return LAMB(groups, lr=lr, **params)


def _lamb(groups, lr, **params):
    """``"type": "Lamb"``: dstrain's multi-tensor LAMB on every device and memory layout.

    It honours the parameter groups (no trust ratio, no weight decay for BN/bias) and takes
    channels_last tensors; DeepSpeed's FusedLamb does neither (``"type": "FusedLamb"``)."""
    log.info("Lamb: dstrain's multi-tensor LAMB (dstrain/techniques/lamb.py)")
    return _dstrain_lamb(groups, lr, **params)


def _fused_lamb(groups, lr, **params):
    """``"type": "FusedLamb"``: DeepSpeed's CUDA op, where it builds; dstrain's LAMB where not."""
    try:
        load_fused_lamb_op()
    except OpBuildError as err:
        log.warning(
            "FusedLamb: DeepSpeed's CUDA op is not usable here (%s); falling back to dstrain's "
            "multi-tensor LAMB (same formula and ratio clamp; BN/bias tensors get no trust ratio)",
            err,
        )
        return _dstrain_lamb(groups, lr, **params)
    from deepspeed.ops.lamb import FusedLamb

    betas = tuple(params.pop("betas"))
    params.pop("weight_decay")  # set per group by param_groups()
    log.info(
        "FusedLamb: DeepSpeed's CUDA op; BN/bias tensors get ratio 1 through their group's clamp [1, 1]"
    )
    return FusedLamb(fused_lamb_groups(groups), lr=lr, betas=betas, **params)


def fused_lamb_groups(groups: list[dict]) -> list[dict]:
    """:func:`param_groups` in FusedLamb's terms. FusedLamb has no per-group switch for the trust ratio,
    but clamps it per group to [min_coeff, max_coeff]: a group clamped to [1, 1] gets ratio 1, which is
    what dstrain's LAMB gives a ``lars_exclude`` group (its weight decay is already 0)."""
    out = []
    for group in groups:
        group = dict(group)
        if group.pop("lars_exclude", False):
            group.update(min_coeff=1.0, max_coeff=1.0)
        out.append(group)
    return out


BETAS = jsonspec.Value(
    "pair", lambda b: all(0 <= x < 1 for x in b), "must be [beta1, beta2], each in [0, 1)"
)
S = jsonspec.setting
NUMBER, FRACTION, BOOL = jsonspec.non_negative(), jsonspec.fraction(), jsonspec.boolean()


# every parameter each optimizer type takes (OPTIMIZERS below): its JSON key, default, help, kind
# and range, declared once. weight_decay is set per parameter group by param_groups() (0 for
# BN/bias); the builders get the rest.
@dataclass(frozen=True)
class Common:
    weight_decay: float = S(0.0, "L2 weight decay of conv/FC weights", json=NUMBER)
    exclude_bn_bias: bool = S(
        True, "tensors with ndim <= 1 (BN, biases): no weight decay, no trust ratio", json=BOOL
    )
    bn_bias_lr_factor: float = S(
        1.0, "the BN/bias group's LR as a fraction of the scheduled LR", json=NUMBER
    )


@dataclass(frozen=True)
class SGDParams(Common):
    momentum: float = S(0.0, "momentum", json=FRACTION)
    nesterov: bool = S(False, "Nesterov momentum", json=BOOL)
    dampening: float = S(0.0, "momentum dampening", json=FRACTION)


@dataclass(frozen=True)
class AdamParams(Common):
    betas: tuple[float, float] = S((0.9, 0.999), "[beta1, beta2]", json=BETAS)
    eps: float = S(1e-8, "added to the denominator", json=NUMBER)


@dataclass(frozen=True)
class LARSParams(Common):
    momentum: float = S(0.9, "momentum", json=FRACTION)
    trust_coefficient: float = S(0.001, "eta of the trust ratio", json=jsonspec.positive())
    eps: float = S(0.0, "added to the trust ratio's denominator", json=NUMBER)
    larc_clip: bool = S(False, "LARC: the ratio clipped so the step is at most the LR's", json=BOOL)
    trust_clip: float = S(0.0, "cap on the trust ratio, 0 = none", json=NUMBER)
    trust_decay: str = S(
        "weight_decay",
        "the weight decay inside the trust ratio: weight_decay, or (Fujitsu) "
        "weight_decay_x_peak_lr",
        json=jsonspec.choice(*TRUST_DECAY),
    )
    momentum_correction: bool = S(
        False, "Goyal's momentum correction: momentum x lr_t / lr_(t-1)", json=BOOL
    )


@dataclass(frozen=True)
class MuonParams(Common):
    momentum: float = S(0.95, "Muon's momentum (of the filters)", json=FRACTION)
    nesterov: bool = S(True, "Nesterov momentum for the filters", json=BOOL)
    ns_steps: int = S(
        5,
        "Newton-Schulz iterations per step",
        json=jsonspec.integer(lambda v: 0 < v < 100, "must be in [1, 100)"),
    )
    adjust_lr: str = S(
        "original",
        "the filters' LR by their matrix shape: original (x sqrt(max(1, out/in))), "
        "match_rms_adamw, spectral_unclamped or none (torch's Muon's adjust_lr_fn)",
        json=jsonspec.choice(*ADJUST_LR),
    )
    sgd_momentum: float = S(
        0.9, "momentum of the SGD-stepped tensors (head, BN, biases)", json=FRACTION
    )
    sgd_nesterov: bool = S(True, "Nesterov momentum for the SGD-stepped tensors", json=BOOL)
    sgd_lr_factor: float = S(
        1.0, "the SGD-stepped tensors' LR as a fraction of the scheduled LR", json=NUMBER
    )


@dataclass(frozen=True)
class SOAPParams(Common):
    betas: tuple[float, float] = S((0.95, 0.95), "[beta1, beta2] of Adam's moments", json=BETAS)
    shampoo_beta: float = S(
        0.95,
        "decay of the preconditioner statistics (L = G G^T, R = G^T G per dimension)",
        json=FRACTION,
    )
    eps: float = S(1e-8, "added to the denominator", json=NUMBER)
    precondition_frequency: int = S(
        10,
        "steps between refreshes of the eigenbases (one power iteration and a QR each)",
        json=jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
    )
    max_precondition_dim: int = S(
        10000,
        "a dimension larger than this gets no preconditioner (identity)",
        json=jsonspec.integer(lambda v: v >= 1, "must be >= 1"),
    )
    merge_dims: bool = S(
        False,
        "merge a tensor's small dimensions (a filter's in x kh x kw) into one preconditioned "
        "dimension, up to max_precondition_dim",
        json=BOOL,
    )
    precondition_1d: bool = S(False, "precondition 1-D tensors too (BN, biases)", json=BOOL)
    correct_bias: bool = S(True, "Adam's bias correction of the moments", json=BOOL)
    normalize_gradient: bool = S(False, "the update divided by its RMS", json=BOOL)


@dataclass(frozen=True)
class LAMBParams(Common):
    betas: tuple[float, float] = S((0.9, 0.999), "[beta1, beta2]", json=BETAS)
    eps: float = S(1e-6, "added to the denominator", json=NUMBER)
    max_coeff: float = S(10.0, "upper clamp of the trust ratio", json=jsonspec.positive())
    min_coeff: float = S(0.01, "lower clamp of the trust ratio", json=NUMBER)
    bias_correction: bool = S(True, "Adam's bias correction of the moments", json=BOOL)


@dataclass(frozen=True)
class FusedLambParams(LAMBParams):
    eps: float = S(1e-8, "added to the denominator (DeepSpeed's FusedLamb default)", json=NUMBER)


def _moments(params: dict) -> str:
    return "first and second moments"


def _momentum(params: dict) -> str:
    return "momentum buffer" if params["momentum"] > 0 else "none"  # defaults filled in


def _muon_state(params: dict) -> str:
    return "momentum buffers (a matrix per filter)"


def _soap_state(params: dict) -> str:
    return "first and second moments, preconditioner statistics and eigenbases"


@dataclass(frozen=True)
class OptimizerType:
    """One JSON optimizer "type": what it takes, how it is built, what it keeps per tensor."""

    params: type  # its parameters: a dataclass of jsonspec settings (the JSON keys, types, ranges)
    build: Callable[..., torch.optim.Optimizer]  # builder(groups, lr=..., **params)
    # per-tensor norms (a trust ratio): ZeRO stage 0 only, and no ratio for the BN/bias group
    layerwise: bool = False
    # what it does with whole tensors beyond a layer-wise norm (Muon's filter matrices, SOAP's
    # per-dimension preconditioners), which ZeRO's flat partitions would break: ZeRO stage 0 only
    whole_tensors: str = ""
    # the package that implements it, when not torch or dstrain: (import name, pip's words)
    package: tuple[str, str] | None = None
    # what a checkpoint keeps per tensor, given the parameters: a resume must agree (compat.py)
    state: Callable[[dict], str] = _moments


# JSON "type" (lower-cased) -> everything dstrain knows about it. A new optimizer is one entry
# (with a shipped JSON that uses it; tests/test_optim.py and test_ds_config.py read this table).
OPTIMIZERS = {
    "sgd": OptimizerType(SGDParams, _sgd, state=_momentum),
    "adam": OptimizerType(AdamParams, _adam),
    "adamw": OptimizerType(AdamParams, _adamw),
    "lars": OptimizerType(LARSParams, _lars, layerwise=True, state=_momentum),
    "lamb": OptimizerType(LAMBParams, _lamb, layerwise=True),
    "fusedlamb": OptimizerType(FusedLambParams, _fused_lamb, layerwise=True),
    "muon": OptimizerType(
        MuonParams, _muon, whole_tensors="steps each filter as a matrix", state=_muon_state
    ),
    "soap": OptimizerType(
        SOAPParams,
        _soap,
        whole_tensors="preconditions each tensor along its dimensions",
        state=_soap_state,
        package=("pytorch_optimizer", "pip install 'dstrain[optimizers]' (pytorch_optimizer 4.1)"),
    ),
}
BLOCK_KEYS = ("type", "params")  # what the "optimizer" block holds
REMOVED_1BIT = {"onebitadam", "onebitlamb", "zerooneadam"}
DEFAULT_BLOCK = {"type": "SGD", "params": {"momentum": 0.9, "weight_decay": 5e-5}}
# the LR has one home, the trainer config (optim.base_lr): a JSON that sets it too is refused
LR_HOME = (
    "the LR has one home, the trainer config's optim.base_lr (the LR per optim.lr_reference_batch "
    "images, which the trainer scales and schedules)"
)


@dataclass(frozen=True)
class OptimizerSpec:
    """The JSON ``optimizer`` block, read once: what every later step (ZeRO check, build, resume) takes."""

    kind: str  # key of OPTIMIZERS: the JSON "type", lower-cased
    name: str  # the JSON "type" as written, for messages
    params: dict = field(default_factory=dict)  # builder keyword arguments (the LR is the config's)
    exclude_bn_bias: bool = (
        True  # tensors with ndim <= 1 get no weight decay (and no layer-wise trust ratio)
    )
    source: str = "optimizer"  # the JSON file, for messages

    @property
    def layerwise(self) -> bool:
        return OPTIMIZERS[self.kind].layerwise

    @property
    def whole_tensors(self) -> str:
        """What it does with each tensor whole (norms, matrices), which ZeRO's flat partitions
        would break; empty for element-wise optimizers."""
        entry = OPTIMIZERS[self.kind]
        return "is layer-wise (per-tensor norms)" if entry.layerwise else entry.whole_tensors

    @property
    def state_layout(self) -> str:
        """What the optimizer keeps per tensor (its checkpoint's layout)."""
        return OPTIMIZERS[self.kind].state(self.params)


def parse_spec(block: dict | None, source: str = "optimizer") -> OptimizerSpec:
    """Check a JSON ``optimizer`` block (None: the default SGD) and return its typed spec."""
    block = DEFAULT_BLOCK if block is None else block
    if not isinstance(block, dict) or "type" not in block:
        raise ConfigError(
            f"{source}: 'optimizer' must be an object with a 'type' (e.g. \"SGD\") and 'params'"
        )
    jsonspec.check_keys(block, BLOCK_KEYS, "optimizer", source, "dstrain does not read it")
    name = jsonspec.Value("text").read(block["type"], "optimizer.type", source)
    kind = name.lower()
    if kind in REMOVED_1BIT:
        raise ConfigError(
            f"{source}: optimizer type {name!r} (1-bit compressed communication) was removed "
            'in DeepSpeed 0.19; use "type": "Adam" or "Lamb" with a "dstrain_communication": '
            '{"compression": "sign"} block (ds_configs/comm_sign.json, docs/communication.md)'
        )
    if kind not in OPTIMIZERS:
        raise ConfigError(
            f"{source}: optimizer type {name!r} is not supported; "
            f"use one of {', '.join(sorted(OPTIMIZERS))} (case-insensitive)"
        )
    given = block.get("params", {})
    if isinstance(given, dict) and "lr" in given:
        raise ConfigError(
            f"{source}: optimizer.params.lr={given['lr']!r}: {LR_HOME}; delete lr from this file "
            f"and set optim.base_lr in the recipe or on the command line (e.g. "
            f"optim.base_lr={given['lr']})"
        )
    package = OPTIMIZERS[kind].package
    if package and importlib.util.find_spec(package[0]) is None:
        raise ConfigError(
            f"{source}: optimizer type {name!r} comes from the {package[0]} package, which is not "
            f"installed here: {package[1]}"
        )
    typed = jsonspec.read_into(
        OPTIMIZERS[kind].params,
        given,
        "optimizer.params",
        source,
        f"optimizer {name} takes no such parameter",
    )
    params = {f.name: getattr(typed, f.name) for f in fields(typed)}  # every one, defaults filled
    exclude = params.pop("exclude_bn_bias")
    return OptimizerSpec(kind, name, params, exclude, source)


def build_optimizer(
    model: torch.nn.Module, spec: OptimizerSpec, lr: float
) -> torch.optim.Optimizer:
    """The client optimizer for ``model``: parameter groups by shape, then the spec's builder, at
    ``lr`` (the schedule sets each step's LR; this is the one before the first)."""
    params = dict(spec.params)
    groups = param_groups(
        model,
        float(params["weight_decay"]),
        spec.exclude_bn_bias,
        layerwise=spec.layerwise,
        bn_bias_lr_factor=params.pop("bn_bias_lr_factor"),
    )
    try:
        return OPTIMIZERS[spec.kind].build(groups, lr=lr, **params)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{spec.source}: optimizer.params for {spec.name}: {err}") from None


def apply_schedule(
    optimizer: torch.optim.Optimizer,
    lr: float,
    wd_factor: float | None = None,
    peak_lr: float | None = None,
) -> None:
    """Set this step's LR on every group (times the group's ``lr_factor``); with ``wd_factor``, scale
    each group's initial weight decay; a LARS group with ``trust_decay: weight_decay_x_peak_lr``
    gets its trust-ratio weight decay, the initial weight decay times ``peak_lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_factor", 1.0)
        initial = group.setdefault("initial_weight_decay", group["weight_decay"])
        if wd_factor is not None:
            group["weight_decay"] = initial * wd_factor
        if group.get("trust_decay") == "weight_decay_x_peak_lr" and peak_lr is not None:
            group["trust_weight_decay"] = initial * peak_lr


class StepCounter:
    """Counts the client optimizer's real steps.

    A loss scaler skips the step on a gradient overflow without calling the client optimizer:
    DeepSpeed's fp16 engine and torch's GradScaler (DeepSpeed's ``torch_autocast`` float16)
    alike. Optimizer steps the trainer asked for minus those taken is the number skipped,
    with no host synchronisation and no reliance on either scaler's private state."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.taken = 0
        self.handle = optimizer.register_step_post_hook(self._count)

    def _count(self, optimizer, args, kwargs) -> None:
        self.taken += 1


@contextlib.contextmanager
def steps_suppressed(optimizer: torch.optim.Optimizer):
    """Make ``optimizer.step()`` a no-op inside the block.

    DeepSpeed's FP16/BF16 wrapper (no ZeRO) calls the client optimizer's step once
    with all-zero gradients during ``deepspeed.initialize``; with weight decay that
    moves the weights and seeds the momentum before training starts. Wrapping
    ``initialize`` in this block makes that call harmless.
    """

    def skipped_step(closure=None):
        log.debug("optimizer step suppressed (DeepSpeed initialize)")
        return None

    optimizer.step = skipped_step  # instance attribute shadows the class method
    try:
        yield optimizer
    finally:
        del optimizer.step
