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
from dstrain.run import finished
from dstrain.run.finished import WEIGHTS
from dstrain.techniques.models import plain_model


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


def export(
    run_dir: Path, weights: str = "trained", tag: str = "", out: str = "", force=False
) -> dict:
    cfg = finished.config(run_dir)
    target = Path(out) if out else run_dir / "exported" / f"{weights}.pt"
    if target.exists() and not force:
        raise ConfigError(f"{target} exists; pass --force to replace it")
    source = finished.weights_file(run_dir, weights, tag)
    # loaded (strict) into the model outside dstrain would build: what a user's load will meet
    state = finished.load_weights(plain_model(cfg.model), source)
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
