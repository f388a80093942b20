"""``python -m dstrain.export``: a finished run's weights as a plain ``state_dict`` file.

    python -m dstrain.export --checkpoint RUN_DIR [--weights trained|ema|polished] [--tag T]
        [--out FILE] [--force]

The file holds the model's own keys with float32 tensors (BN's counters as they are), nothing of
DeepSpeed's, so the model's builder loads it alone, e.g. for a ``model.name=resnet50`` run:
``torchvision.models.resnet50(num_classes=N).load_state_dict(torch.load(FILE))``. ``trained``:
the checkpoint's module weights (the newest intact checkpoint, as ``resume=auto`` chooses, or
``--tag``); ``ema``: their average (``optim.ema``, the checkpoint's ``ema.pt``); ``polished``:
Final Polishing's refit (``RUN_DIR/polished/model.pt``). The weights are read as data and loaded
into the model the run's config describes (strict) before anything is written; the file is written
atomically, by default to ``RUN_DIR/exported/<weights>.pt``, and an existing one is kept unless
``--force``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dstrain.core.errors import ConfigError
from dstrain.core.files import atomic_write
from dstrain.core.safe_load import load_data
from dstrain.loop import checkpoint
from dstrain.settings.config import load_config
from dstrain.techniques.bn_refit import POLISHED_DIR
from dstrain.techniques.ema import EMA_FILE
from dstrain.techniques.models import plain_model

WEIGHTS = ("trained", "ema", "polished")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dstrain.export", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR", help="a dstrain run directory")
    p.add_argument(
        "--weights", choices=WEIGHTS, default="trained", help="which weights (default: trained)"
    )
    p.add_argument("--tag", default="", help="checkpoint tag (default: the newest intact one)")
    p.add_argument("--out", default="", help="the file (default: RUN_DIR/exported/<weights>.pt)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    return p.parse_args(argv)


def source_file(run_dir: Path, weights: str, tag: str) -> Path:
    """The file holding ``weights`` of the run in ``run_dir``; refused in one line when absent."""
    if weights == "polished":
        path = run_dir / POLISHED_DIR / "model.pt"
        if not path.is_file():
            raise ConfigError(
                f"--weights polished: {path} missing; polish the run first "
                f"(python -m dstrain.polish --checkpoint {run_dir})"
            )
        return path
    root = run_dir / "checkpoints"
    found, skipped = checkpoint.newest_intact(root, tag) if root.is_dir() else (None, [])
    if not found:
        if skipped:
            raise checkpoint.damaged_error(root, skipped, f"--checkpoint {run_dir}")
        raise ConfigError(f"--checkpoint {run_dir}: no complete checkpoint in {root}")
    path = root / found / (EMA_FILE if weights == "ema" else checkpoint.MODEL_FILE)
    if not path.is_file():
        raise ConfigError(
            f"--weights ema: {path.parent} has no {EMA_FILE} (the run trained without optim.ema)"
        )
    return path


def plain_state(path: Path) -> dict[str, torch.Tensor]:
    """The model's state dict in ``path`` (a DeepSpeed module-states file, an EMA file or a polished
    ``model.pt``), floating tensors as float32."""
    state = load_data(path)
    if isinstance(state, dict) and isinstance(state.get("module"), dict):
        state = state["module"]
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(v, torch.Tensor) for v in state.values())
    ):
        raise ConfigError(f"{path}: holds no state dict of tensors; not a dstrain weights file")
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def export(
    run_dir: Path, weights: str = "trained", tag: str = "", out: str = "", force=False
) -> dict:
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--checkpoint {run_dir}: no config.yaml; pass a dstrain run directory")
    cfg = load_config(str(run_dir / "config.yaml"))
    target = Path(out) if out else run_dir / "exported" / f"{weights}.pt"
    if target.exists() and not force:
        raise ConfigError(f"{target} exists; pass --force to replace it")
    source = source_file(run_dir, weights, tag)
    state = plain_state(source)
    result = plain_model(cfg.model).load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(
            f"{source}: does not load into model.name={cfg.model.name} as the run's config describes it "
            f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, lambda fh: torch.save(state, fh))
    return {
        "out": str(target),
        "from": str(source),
        "weights": weights,
        "model": cfg.model.name,
        "tensors": len(state),
        "values": sum(v.numel() for v in state.values()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        info = export(Path(args.checkpoint), args.weights, args.tag, args.out, args.force)
    except ConfigError as err:
        sys.stderr.write(f"dstrain.export: error: {err}\n")
        return err.exit_code
    print(json.dumps(info, indent=2))
    return 0
