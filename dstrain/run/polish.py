"""``python -m dstrain.polish``: Final Polishing of a finished run (the technique: dstrain/techniques/bn_refit.py).

Standalone, on a finished run (also under ``deepspeed --num_gpus N``)::

    python -m dstrain.polish --checkpoint RUN_DIR [--weights trained|ema] [--images N | --batches N]
        [--batch B] [key=value ...]

refits BN on un-augmented training images (:func:`dstrain.techniques.bn_refit.refit_bn`), writes
``RUN_DIR/polished/`` (``model.pt`` state dict + ``polish.json``) and prints top-1 before/after;
``--weights ema`` refits the checkpoint's EMA of the weights (``optim.ema``, its ``ema.pt``)
instead, into ``RUN_DIR/polished_ema/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.loop import checkpoint
from dstrain.loop.evaluate import evaluate
from dstrain.run import finished
from dstrain.run.components import build_components
from dstrain.settings.config import PolishConfig, polish_batch
from dstrain.settings.ramp import batch_plan
from dstrain.techniques.bn_refit import POLISHED_DIR, polish_model, save_polished, summarize
from dstrain.techniques.ema import POLISHED_EMA_DIR

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dstrain.polish", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR", help="a dstrain run directory")
    p.add_argument("--tag", default="", help="checkpoint tag (default: the newest complete one)")
    p.add_argument(
        "--images",
        type=int,
        default=None,
        help="polish set size (default: the run's polish.images)",
    )
    p.add_argument(
        "--batches", type=int, default=None, help="polish set size in batches over all ranks"
    )
    p.add_argument("--batch", type=int, default=None, help="images per refit forward on one rank")
    p.add_argument(
        "--weights",
        choices=("trained", "ema"),
        default="trained",
        help="the trained weights (-> RUN_DIR/polished/) or their EMA, optim.ema "
        "(the checkpoint's ema.pt -> RUN_DIR/polished_ema/)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing RUN_DIR/polished/ (polished_ema/)"
    )
    finished.command_args(p, "trainer config overrides, e.g. data.root=DIR")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, result = finished.run_command("polish", lambda: polish_run_dir(args))
    if code:
        return code
    if dist.is_main():
        print(json.dumps(result, indent=2))
    return 0


def out_dir(run_dir: Path, weights: str, force: bool) -> Path:
    """Where the refit goes (RUN_DIR/polished/ or polished_ema/); an existing one is kept unless
    ``force``."""
    out = run_dir / (POLISHED_EMA_DIR if weights == "ema" else POLISHED_DIR)
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it")
    return out


def polish_run_dir(args: argparse.Namespace) -> dict:
    """Polish a finished run's checkpoint: its own config, model and data, built as training builds them."""
    run_dir = Path(args.checkpoint)
    cfg = finished.config(run_dir, args.overrides)
    out = out_dir(run_dir, args.weights, args.force)
    world = finished.join(cfg)
    source = finished.weights_file(run_dir, args.weights, args.tag)
    device = dist.device()
    last = batch_plan(
        cfg.batch.global_size, cfg.batch.micro_per_rank, cfg.batch.ramp, world, cfg.epochs
    )[-1]
    # float32 inputs and weights; the run's FP16/BF16 precision comes back as autocast (no DeepSpeed engine here)
    parts = build_components(cfg, "fp32", last, device, join_bn_groups=False)
    model = parts.model
    finished.load_weights(model, source)
    model.to(device).to(memory_format=parts.memory_format)
    net = finished.autocast(model, finished.precision(run_dir), device)
    settings = PolishConfig(
        images=cfg.polish.images if args.images is None else args.images,
        batches=cfg.polish.batches if args.batches is None else args.batches,
    )

    def evaluate_fn() -> dict:
        return evaluate(net, parts.data.val, torch.float32, parts.memory_format)

    before = evaluate_fn()
    try:
        after = polish_model(
            model,
            net,
            parts.data.polish,
            evaluate_fn,
            settings,
            batch_per_rank=args.batch or polish_batch(cfg, last.micro),
            memory_format=parts.memory_format,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    trainer_state = json.loads((source.parent / checkpoint.STATE_FILE).read_text())
    info = {
        "checkpoint": str(source.parent),
        "weights": args.weights,
        "world_size": world,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **summarize(before, after, trainer_state.get("train_time_s", 0.0)),
    }
    if dist.is_main():
        save_polished(run_dir, model, info, overwrite=args.force, name=out.name)
    dist.barrier()
    log.info(
        "polish: top-1 %.4f -> %.4f (%+.4f) -> %s",
        before["val_top1"],
        after["val_top1"],
        info["top1_gain"],
        out,
    )
    return info


if __name__ == "__main__":
    sys.exit(main())
