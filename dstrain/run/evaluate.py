"""``python -m dstrain.evaluate``: the validation loss, top-1 and top-5 of given weights, nothing
trained (timm's ``validate.py``).

    python -m dstrain.evaluate --checkpoint RUN_DIR [--weights trained|ema|polished] [--tag T]
        [--out FILE] [key=value ...]
    python -m dstrain.evaluate --config RECIPE init.weights=FILE [--out FILE] [key=value ...]

A finished run's weights (the newest intact checkpoint, as ``resume=auto`` chooses, or ``--tag``;
their EMA; Final Polishing's refit) on the run's own validation data and transforms, in the
precision it trained in (FP16/BF16 as autocast over float32 weights; FP16 on a CPU computes in
float32); ``key=value`` changes the config (``data.root=DIR`` where the data moved,
``batch.eval_per_rank=N``). Or any state dict file (python -m dstrain.export's, torchvision's) on the
data and model a recipe describes, in its DeepSpeed JSON's precision. The weights are read as data
and must fill the model exactly. Under a launcher (``deepspeed --num_gpus N dstrain/evaluate.py``)
every rank evaluates its share of the images once, and the sums are exact as in training
(dstrain/loop/evaluate.py). The result is one JSON object on stdout (the log goes to stderr), and
with ``--out`` also written, atomically, to that file; nothing else is written.
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
from dstrain.core.files import atomic_write_text
from dstrain.loop.evaluate import evaluate
from dstrain.run import ds_config, finished
from dstrain.run.components import build_components
from dstrain.settings.config import TrainConfig, load_config
from dstrain.settings.ramp import BatchStage

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dstrain.evaluate", description=__doc__.split("\n\n")[0]
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="RUN_DIR", help="a dstrain run directory")
    source.add_argument(
        "--config",
        metavar="RECIPE",
        help="a recipe (name or YAML path) whose model and data evaluate init.weights=FILE",
    )
    p.add_argument(
        "--weights",
        choices=finished.WEIGHTS,
        default="trained",
        help="with --checkpoint: the trained weights, their EMA (optim.ema) or the polished ones",
    )
    p.add_argument("--tag", default="", help="checkpoint tag (default: the newest intact one)")
    p.add_argument("--out", default="", help="also write the result (JSON) to this file")
    finished.command_args(p, "config overrides, e.g. data.root=DIR or init.weights=FILE")
    return p.parse_intermixed_args(argv)


def what_to_evaluate(args: argparse.Namespace) -> tuple[TrainConfig, str, str]:
    """(config, precision, what the weights are in words) for ``args``; refused in one line."""
    if args.checkpoint:
        run_dir = Path(args.checkpoint)
        return finished.config(run_dir, args.overrides), finished.precision(run_dir), args.weights
    cfg = load_config(args.config, args.overrides)
    if not cfg.init.weights:
        raise ConfigError(
            f"--config {args.config}: name the weights to evaluate with init.weights=FILE "
            "(or evaluate a run: --checkpoint RUN_DIR)"
        )
    spec = ds_config.precision(ds_config.read_json(ds_config.locate(cfg.deepspeed_config)))
    return cfg, spec, "init.weights"


def evaluate_weights(args: argparse.Namespace) -> dict:
    cfg, precision, what = what_to_evaluate(args)
    # evaluation uses none of the training batch arithmetic: its rules are checked for one rank
    world = finished.join(cfg, world_for_rules=1)
    if args.checkpoint:
        source = finished.weights_file(Path(args.checkpoint), args.weights, args.tag)
        field, fix = "--weights", "drop the model.* overrides"
    else:
        source = Path(cfg.init.weights)
        field, fix = "init.weights", "set model.* to the network the file holds"
    device = dist.device()
    # one image per training batch: the training loader is built (the data's counts and its
    # holdout need it) but never read
    stage = BatchStage(epoch=0, global_size=world, micro=1, accumulation=1)
    parts = build_components(cfg, "fp32", stage, device, join_bn_groups=False)
    finished.load_weights(parts.model, source, field, fix)
    parts.model.to(device).to(memory_format=parts.memory_format)
    net = finished.autocast(parts.model, precision, device)
    log.info(
        "evaluating %s (%s, %s) on %d validation images, %d rank(s) on %s",
        source,
        cfg.model.name,
        precision,
        parts.data.n_val,
        world,
        device.type,
    )
    began = time.perf_counter()
    metrics = evaluate(net, parts.data.val, torch.float32, parts.memory_format)
    seconds = time.perf_counter() - began
    log.info(
        "top-1 %.4f, top-5 %.4f, loss %.4f over %d images in %.1f s",
        metrics["val_top1"],
        metrics["val_top5"],
        metrics["val_loss"],
        metrics["val_images"],
        seconds,
    )
    return {
        **metrics,
        "weights": what,
        "from": str(source),
        "model": cfg.model.name,
        "precision": precision,
        "world_size": world,
        "device": device.type,
        "seconds": round(seconds, 3),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the log to stderr: stdout is the result
    code, result = finished.run_command("evaluate", lambda: evaluate_weights(args), sys.stderr)
    if code:
        return code
    if dist.is_main():
        text = json.dumps(result, indent=2) + "\n"
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(args.out), text)
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
