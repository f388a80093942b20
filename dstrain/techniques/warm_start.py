"""``init.weights``: a fresh run that starts from given weights (a fine-tune; timm's
``--initial-checkpoint``), not from a resume: the optimizer, the schedule and the step start anew.

The file is read as data (dstrain/core/safe_load.py: a foreign file runs no code) and may be any
of the state dicts users hold: ``python -m dstrain.export``'s, ``torch.save(model.state_dict())``
(torchvision's downloaded weights are one), a DeepSpeed ``mp_rank_00_model_states.pt`` (its
``module``), timm's and Lightning's checkpoints (``state_dict``/``model``), with DDP's ``module.``
or torch.compile's ``_orig_mod.`` prefix on every key. Each tensor whose name and shape the model
has is loaded (cast to the model's dtype); the others are named, and the model keeps its own
initialisation for what the file did not fill: a new classifier head of another class count is
the usual case. ``init.strict`` refuses any such difference instead. A file of which no tensor
fits is refused: it belongs to another network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dstrain.core.errors import ConfigError
from dstrain.core.safe_load import load_data

# where checkpoints of other trainers keep the model's state dict, in the order looked for
WRAPPER_KEYS = ("module", "state_dict", "model", "model_state_dict")
PREFIXES = ("module.", "_orig_mod.")  # DDP/DeepSpeed's and torch.compile's, on every key
SHOWN = 4  # names shown per kind of difference


def is_state_dict(obj: object) -> bool:
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def state_dict_of(obj: object) -> dict[str, torch.Tensor] | None:
    """The state dict ``obj`` is or wraps (see :data:`WRAPPER_KEYS`), prefixes stripped; None if
    it holds none."""
    if isinstance(obj, dict) and not is_state_dict(obj):
        obj = next((obj[k] for k in WRAPPER_KEYS if is_state_dict(obj.get(k))), None)
    if not is_state_dict(obj):
        return None
    for prefix in PREFIXES:
        if all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix) :]: v for k, v in obj.items()}
    return obj


def read_weights(path: str | Path, field: str = "init.weights") -> dict[str, torch.Tensor]:
    """The state dict in the file ``path``, read as data; refused in one line naming ``field`` and
    the file when there is none."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{field}={path}: a directory; name a weights file (a dstrain run's: "
            f"python -m dstrain.export --checkpoint {path})"
        )
    if not path.is_file():
        raise ConfigError(f"{field}={path}: no such file")
    try:
        state = state_dict_of(load_data(path))
    except ConfigError as err:  # code in its pickle, damage, not torch.save's format
        raise ConfigError(f"{field}: {err}") from None
    if state is None:
        raise ConfigError(
            f"{field}={path}: holds no state dict of tensors, so it is not weights; pass what "
            "torch.save(model.state_dict()) or python -m dstrain.export writes"
        )
    return state


@dataclass(frozen=True)
class Fit:
    """How a state dict fits a model: what loads, and what does not, by name."""

    loaded: tuple[str, ...]  # in the model and the file, same shape
    missing: tuple[str, ...]  # the model's, not in the file: they keep their initialisation
    unexpected: tuple[str, ...]  # the file's, not in the model
    mismatched: tuple[tuple[str, tuple, tuple], ...]  # (name, file's shape, model's shape)
    total: int  # tensors in the model's state dict

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def differences(self) -> str:
        """What did not load, in words ('' when everything did)."""

        def names(keys) -> str:
            more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
            return ", ".join(keys[:SHOWN]) + more

        parts = []
        if self.mismatched:
            shapes = [f"{k} (file {list(a)}, model {list(b)})" for k, a, b in self.mismatched]
            parts.append(f"shape differs: {names(shapes)}")
        if self.missing:
            parts.append(f"not in the file: {names(self.missing)}")
        if self.unexpected:
            parts.append(f"not in the model: {names(self.unexpected)}")
        return "; ".join(parts)


def fit(model: nn.Module, state: dict[str, torch.Tensor]) -> Fit:
    own = model.state_dict()
    shared = [k for k in own if k in state]
    return Fit(
        loaded=tuple(k for k in shared if state[k].shape == own[k].shape),
        missing=tuple(k for k in own if k not in state),
        unexpected=tuple(k for k in state if k not in own),
        mismatched=tuple(
            (k, tuple(state[k].shape), tuple(own[k].shape))
            for k in shared
            if state[k].shape != own[k].shape
        ),
        total=len(own),
    )


def check_fit(found: Fit, source: str, model_name: str, strict: bool) -> None:
    """Refuse a file no tensor of which fits the model, or, ``strict``, one that differs at all."""
    if not found.loaded:
        raise ConfigError(
            f"init.weights={source}: none of its tensors fits model.name={model_name} as the "
            f"config describes it ({found.differences()}); it holds another network's weights"
        )
    if strict and not found.complete:
        raise ConfigError(
            f"init.weights={source}: init.strict=true and the file does not fill "
            f"model.name={model_name} exactly ({found.differences()}); set init.strict=false to "
            "keep the model's own initialisation for these"
        )


def fitting(
    model: nn.Module, source: str | Path, model_name: str, strict: bool = False
) -> tuple[dict[str, torch.Tensor], Fit]:
    """Read ``source`` as data: the tensors of it that fit ``model`` (each cast to the model's
    dtype), for :func:`apply`, and how it fits; refused as :func:`check_fit` says."""
    state = read_weights(source)
    found = fit(model, state)
    check_fit(found, str(source), model_name, strict)
    own = model.state_dict()
    return {k: state[k].to(own[k].dtype) for k in found.loaded}, found


def apply(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """:func:`fitting`'s tensors into a model of the same description."""
    model.load_state_dict(tensors, strict=False)


def load(model: nn.Module, source: str | Path, model_name: str, strict: bool = False) -> Fit:
    """Read ``source`` as data and load what fits into ``model``."""
    tensors, found = fitting(model, source, model_name, strict)
    apply(model, tensors)
    return found


def describe(found: Fit, source: str | Path) -> str:
    """A warm start in words, for the run's log and ``--check``'s plan."""
    line = f"{source}: {len(found.loaded)} of the model's {found.total} tensors loaded"
    if found.complete:
        return line
    return f"{line}; not loaded (the model's own initialisation kept): {found.differences()}"
