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
from omegaconf import OmegaConf
from torch import nn

from dstrain.core import dist
from dstrain.core.errors import ConfigError, RunStopped
from dstrain.core.logs import setup_logging
from dstrain.core.safe_load import load_data
from dstrain.loop import checkpoint
from dstrain.loop.evaluate import evaluate
from dstrain.run import ds_config, rundir
from dstrain.run.components import build_components
from dstrain.run.launch import adopt_mpi_env
from dstrain.run.outcome import ending_of
from dstrain.settings.config import PolishConfig, load_config, polish_batch, validate
from dstrain.settings.ramp import batch_plan
from dstrain.techniques.bn_refit import POLISHED_DIR, polish_model, save_polished, summarize
from dstrain.techniques.ema import EMA_FILE, POLISHED_EMA_DIR
from dstrain.techniques.models import input_dtype

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- standalone
class Autocast(nn.Module):
    """Runs a float32 model under autocast (bf16/fp16 recipes) without DeepSpeed."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device_type: str):
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def forward(self, x):
        if self.dtype == torch.float32:
            return self.module(x)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(x).float()


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
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="trainer config overrides, e.g. data.root=DIR",
    )
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    adopt_mpi_env()  # ranks started by mpirun: RANK before the log reads it
    setup_logging()
    dist.quiet_deepspeed()
    try:
        result = polish_run_dir(args)
    except (ConfigError, RunStopped) as err:  # how it ended: the same states and statuses as a run
        ending = ending_of(err)
        sys.stderr.write(
            f"dstrain.polish: error: {ending.message}\n"
        )  # one write: lines stay whole
        sys.stderr.flush()
        return ending.exit_code
    if dist.is_main():
        print(json.dumps(result, indent=2))
    return 0


def checkpoint_tag(run_dir: Path, tag: str, force: bool, weights: str = "trained") -> str:
    """The checkpoint to polish (``tag``, else the newest complete one); refuses what cannot be polished."""
    ckpt_root = run_dir / "checkpoints"
    failed = rundir.failed_start(run_dir)
    if failed is not None:
        raise ConfigError(
            f"--checkpoint {run_dir}: this run failed before its first checkpoint "
            f"({rundir.FAILED}: {failed.get('message', '?')}); there is nothing to polish"
        )
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--checkpoint {run_dir}: no config.yaml; pass a dstrain run directory")
    if tag and not (ckpt_root / tag / checkpoint.STATE_FILE).is_file():
        raise ConfigError(f"--checkpoint {run_dir}: no complete checkpoint {tag!r} in {ckpt_root}")
    # the choice resume=auto makes: the newest whose files are as written (or the one asked for)
    found, skipped = checkpoint.newest_intact(ckpt_root, tag) if ckpt_root.is_dir() else (None, [])
    if not found and skipped:
        raise checkpoint.damaged_error(ckpt_root, skipped, f"--checkpoint {run_dir}")
    if not found:
        raise ConfigError(f"--checkpoint {run_dir}: no complete checkpoint in {ckpt_root}")
    for damaged, why in skipped:
        log.warning("checkpoint %s skipped, damaged: %s; polishing %s", damaged, why, found)
    if weights == "ema" and not (ckpt_root / found / EMA_FILE).is_file():
        raise ConfigError(
            f"--weights ema: {ckpt_root / found} has no {EMA_FILE} (the run trained without "
            "optim.ema); polish its trained weights (--weights trained)"
        )
    out = run_dir / (POLISHED_EMA_DIR if weights == "ema" else POLISHED_DIR)
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it")
    return found


def load_weights(model: nn.Module, model_file: Path) -> None:
    """A DeepSpeed checkpoint's module weights (or an ``ema.pt``'s average), as float32, into
    ``model``."""
    state = load_data(model_file)["module"]  # as data: a foreign checkpoint runs no code
    try:
        model.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        )
    except RuntimeError as err:  # size mismatch / missing keys
        raise ConfigError(
            f"{model_file}: this checkpoint belongs to a different model than model.* describes "
            f"({str(err).splitlines()[-1].strip()[:160]}); drop the model.* overrides"
        ) from None


def polish_run_dir(args: argparse.Namespace) -> dict:
    """Polish a finished run's checkpoint: its own config, model and data, built as training builds them."""
    run_dir = Path(args.checkpoint)
    ckpt_root = run_dir / "checkpoints"
    tag = checkpoint_tag(run_dir, args.tag, args.force, args.weights)
    cfg = load_config(str(run_dir / "config.yaml"), args.overrides)
    dist.setup_env_for_single_process()
    world = dist.world_size()
    # a BN group is a training-time grouping of ranks: the refit normalises each group's images
    # together on any number of ranks (dstrain/techniques/bn_group.py), so it need not divide these
    validate(OmegaConf.merge(cfg, {"model": {"bn_group": 1}}), world)
    import torch.distributed as tdist

    if world > 1 and not tdist.is_initialized():
        dist.share_cpu_cores()
        tdist.init_process_group("nccl" if dist.use_gpu() else "gloo")
    if why := dist.rank_without_gpu():
        raise ConfigError(why)
    device = dist.device()
    precision = ds_config.precision(json.loads((run_dir / "ds_config.json").read_text()))
    last = batch_plan(
        cfg.batch.global_size, cfg.batch.micro_per_rank, cfg.batch.ramp, world, cfg.epochs
    )[-1]
    # float32 inputs and weights; the run's FP16/BF16 precision comes back as autocast (no DeepSpeed engine here)
    parts = build_components(cfg, "fp32", last, device, join_bn_groups=False)
    model = parts.model
    ema = args.weights == "ema"
    out_name = POLISHED_EMA_DIR if ema else POLISHED_DIR
    load_weights(model, ckpt_root / tag / (EMA_FILE if ema else "mp_rank_00_model_states.pt"))
    model.to(device).to(memory_format=parts.memory_format)
    amp_dtype = (
        input_dtype(precision) if device.type == "cuda" or precision == "bf16" else torch.float32
    )
    net = Autocast(model, amp_dtype, device.type)
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
    trainer_state = json.loads((ckpt_root / tag / checkpoint.STATE_FILE).read_text())
    info = {
        "checkpoint": str(ckpt_root / tag),
        "weights": args.weights,
        "world_size": world,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **summarize(before, after, trainer_state.get("train_time_s", 0.0)),
    }
    if dist.is_main():
        save_polished(run_dir, model, info, overwrite=args.force, name=out_name)
    dist.barrier()
    log.info(
        "polish: top-1 %.4f -> %.4f (%+.4f) -> %s",
        before["val_top1"],
        after["val_top1"],
        info["top1_gain"],
        run_dir / out_name,
    )
    return info


if __name__ == "__main__":
    sys.exit(main())
