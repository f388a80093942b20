"""Final Polishing (Kasagi et al., Fujitsu): re-estimate BN statistics on un-augmented training images.

A network trained on random-resized crops keeps BN running statistics of
augmented images; validation images (resize + center crop) produce different
activation statistics. :func:`refit_bn` replaces every BN layer's running
mean/variance with the exact statistics of its inputs over a polish set
(training images with the validation transform), weights untouched.

How the refit runs, and why it is exact:
  * the model is in eval mode except its BN layers, which are in train mode
    (they normalise with batch statistics, as in training) with momentum None;
  * a forward pre-hook on each BN layer accumulates, per channel, the count, the
    sum and the sum of squares of its inputs: per batch in FP32 around the batch
    mean, combined across batches and ranks in FP64. BN's own cumulative average
    would not do: it averages per-batch (unbiased) variances and so misses the
    spread of the batch means, and it weights a short last batch like a full one;
  * the sums are all-reduced, so each rank refits on its shard and the result is
    the refit over the union. Batches are cut from the polish set before they are
    dealt to ranks (dstrain/data/sharding.py), so every batch, and thus every
    batch-normalised activation, is the same on any number of ranks;
  * running_var uses the unbiased estimate, like BN's own running_var.

The seed recipe's other variant, training the last K epochs on un-augmented
images with normal optimizer steps, is :func:`augment_at` (called by the loop).

Standalone, on a finished run (also under ``deepspeed --num_gpus N``)::

    python -m dstrain.polish --checkpoint RUN_DIR [--images N | --batches N] [--batch B] [key=value ...]

writes ``RUN_DIR/polished/`` (``model.pt`` state dict + ``polish.json``) and prints top-1 before/after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script under the deepspeed launcher
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dstrain import checkpoint, dist, ds_config, rundir  # noqa: E402
from dstrain.components import build_components  # noqa: E402
from dstrain.config import PolishConfig, load_config, validate  # noqa: E402
from dstrain.errors import EXIT_CONFIG, ConfigError  # noqa: E402
from dstrain.evaluate import evaluate  # noqa: E402
from dstrain.files import atomic_write_text  # noqa: E402
from dstrain.launch import adopt_mpi_env  # noqa: E402
from dstrain.models import input_dtype  # noqa: E402
from dstrain.monitor import setup_logging  # noqa: E402
from dstrain.ramp import batch_plan  # noqa: E402

log = logging.getLogger(__name__)
BatchNorm = nn.modules.batchnorm._BatchNorm
POLISHED_DIR = "polished"


def augment_at(
    epoch: int, epochs: int, last_epochs_without_augmentation: int, augment: bool = True
) -> bool:
    """Whether epoch ``epoch`` (0-based) trains on augmented images: not in the last K epochs."""
    return augment and epoch < epochs - last_epochs_without_augmentation


def bn_layers(model: nn.Module) -> list[BatchNorm]:
    return [m for m in model.modules() if isinstance(m, BatchNorm) and m.track_running_stats]


@torch.no_grad()
def refit_bn(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    forward: Callable | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = dist.all_reduce_sum,
) -> int:
    """Replace every BN layer's running mean/var by the statistics of its inputs over ``batches``.

    ``batches`` yields model inputs; ``forward`` (default ``model``) runs one,
    e.g. a DeepSpeed engine that applies autocast. ``reduce`` sums a tensor
    across ranks in place (None: single process). Returns the number of images
    seen, over all ranks. Weights, and buffers other than BN's, are unchanged.
    """
    bns = bn_layers(model)
    if not bns:
        log.warning(
            "polish: the model has no BatchNorm layers with running statistics; nothing to refit"
        )
        return 0
    forward = forward or model
    device = bns[0].running_mean.device
    sums = {
        m: torch.zeros(3, m.num_features, dtype=torch.float64, device=device) for m in bns
    }  # n, sum x, sum x^2

    def accumulate(module: BatchNorm, inputs: tuple) -> None:
        x = inputs[0].float()  # FP16/BF16 activations: statistics in FP32
        dims = [d for d in range(x.ndim) if d != 1]
        n = x.numel() // x.shape[1]
        mean = x.mean(dims)
        # around the batch mean: no cancellation
        m2 = (x - mean.view(1, -1, *[1] * (x.ndim - 2))).square().sum(dims)
        acc, mean64 = sums[module], mean.double()
        acc[0] += n
        acc[1] += n * mean64
        acc[2] += m2.double() + n * mean64.square()

    was_training = model.training
    saved = [(m, m.momentum, m.training) for m in bns]
    previous = [
        (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in bns
    ]
    model.eval()
    for m in bns:
        m.train()
        m.momentum = None
        m.reset_running_stats()
    handles = [m.register_forward_pre_hook(accumulate) for m in bns]
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # images, batches (this rank)
    try:
        for x in batches:
            forward(x)
            counts += torch.tensor([len(x), 1.0], dtype=torch.float64, device=device)
    finally:
        for h in handles:
            h.remove()
        for m, momentum, training in saved:
            m.momentum = momentum
            m.train(training)
        model.train(was_training)
    flat = torch.cat([counts] + [sums[m].flatten() for m in bns])
    if reduce is not None:
        reduce(flat)  # the union of every rank's shard
    if flat[0] < 2:
        for m, (mean, var, tracked) in zip(bns, previous):  # leave the model as it was
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(tracked)
        raise ValueError(
            f"polish: {int(flat[0].item())} images in the polish set; at least 2 are needed"
        )
    set_statistics(bns, flat[2:], batches=int(flat[1].item()))
    return int(flat[0].item())


def set_statistics(bns: list[BatchNorm], sums: torch.Tensor, batches: int) -> None:
    """Running mean and unbiased variance of each layer from its (n, sum x, sum x^2) per channel."""
    offset = 0
    for m in bns:
        n, s1, s2 = sums[offset : offset + 3 * m.num_features].view(3, m.num_features)
        offset += 3 * m.num_features
        mean = s1 / n
        var = (s2 - n * mean.square()) / (n - 1).clamp(min=1)  # unbiased, as BN's running_var
        m.running_mean.copy_(mean)
        m.running_var.copy_(var.clamp(min=0))
        m.num_batches_tracked.fill_(batches)


# ---------------------------------------------------------------- the polish step of a run
def polish_model(
    model: nn.Module,
    forward: Callable,
    make_loader: Callable,
    evaluate_fn: Callable[[], dict],
    cfg: PolishConfig,
    *,
    batch_per_rank: int,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> dict:
    """Refit BN on the polish set (``cfg.images`` or ``cfg.batches``), then evaluate.

    ``make_loader(limit, batch)`` is ``Data.polish``; ``forward`` runs one batch (an engine or an
    autocast wrapper); ``evaluate_fn()`` evaluates the refit model."""
    limit = cfg.batches * batch_per_rank * dist.world_size() if cfg.batches else cfg.images
    loader = make_loader(limit, batch_per_rank)
    t0 = time.perf_counter()
    batches = (x.to(dtype=dtype, memory_format=memory_format) for x, _ in loader)
    n = refit_bn(model, batches, forward=forward)
    refit_s = time.perf_counter() - t0
    after = evaluate_fn()
    log.info(
        "polish: BN statistics of %d layers refit on %d training images (val transform, %d per forward) "
        "in %.1f s",
        len(bn_layers(model)),
        n,
        batch_per_rank,
        refit_s,
    )
    return {"images": n, "batch_per_rank": batch_per_rank, "refit_s": refit_s, **after}


def save_polished(run_dir: Path, model: nn.Module, info: dict, overwrite: bool = False) -> Path:
    """RUN_DIR/polished/{model.pt, polish.json}, written into polished.partial and renamed (rank 0 only)."""
    out, tmp = run_dir / POLISHED_DIR, run_dir / (POLISHED_DIR + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, tmp / "model.pt")
    atomic_write_text(tmp / "polish.json", json.dumps(info, indent=2) + "\n")
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists")
        old = run_dir / (POLISHED_DIR + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    return out


def summarize(before: dict, after: dict, train_time_s: float) -> dict:
    """The polish block of summary.json / polish.json."""
    keys = ("val_top1", "val_top5", "val_loss")
    return {
        "before": {k: before.get(k) for k in keys},
        "after": {k: after.get(k) for k in keys},
        "top1_gain": after["val_top1"] - before["val_top1"],
        "images": after["images"],
        "batch_per_rank": after["batch_per_rank"],
        "refit_s": after["refit_s"],
        "refit_fraction_of_training": after["refit_s"] / train_time_s if train_time_s else None,
    }


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
    p.add_argument("--force", action="store_true", help="replace an existing RUN_DIR/polished/")
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
    except ConfigError as err:
        sys.stderr.write(f"dstrain.polish: error: {err}\n")  # one write: ranks' lines stay whole
        sys.stderr.flush()
        return EXIT_CONFIG
    if dist.is_main():
        print(json.dumps(result, indent=2))
    return 0


def checkpoint_tag(run_dir: Path, tag: str, force: bool) -> str:
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
    found = tag or checkpoint.newest_complete(ckpt_root)
    if not found or not (ckpt_root / found / "mp_rank_00_model_states.pt").is_file():
        named = f" {tag!r}" if tag else ""
        raise ConfigError(f"--checkpoint {run_dir}: no complete checkpoint{named} in {ckpt_root}")
    if (run_dir / POLISHED_DIR).exists() and not force:
        raise ConfigError(f"{run_dir / POLISHED_DIR} exists; pass --force to replace it")
    return found


def load_weights(model: nn.Module, model_file: Path) -> None:
    """A DeepSpeed checkpoint's module weights, as float32, into ``model``."""
    state = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
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
    ckpt_root, tag = run_dir / "checkpoints", checkpoint_tag(run_dir, args.tag, args.force)
    cfg = load_config(str(run_dir / "config.yaml"), args.overrides)
    dist.setup_env_for_single_process()
    world = dist.world_size()
    validate(cfg, world)
    import torch.distributed as tdist

    if world > 1 and not tdist.is_initialized():
        tdist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if why := dist.rank_without_gpu():
        raise ConfigError(why)
    device = dist.device()
    precision = ds_config.precision(json.loads((run_dir / "ds_config.json").read_text()))
    last = batch_plan(
        cfg.batch.global_size, cfg.batch.micro_per_rank, cfg.batch.ramp, world, cfg.epochs
    )[-1]
    # float32 inputs and weights; the run's FP16/BF16 precision comes back as autocast (no DeepSpeed engine here)
    parts = build_components(cfg, "fp32", last, device)
    model = parts.model
    load_weights(model, ckpt_root / tag / "mp_rank_00_model_states.pt")
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
            batch_per_rank=args.batch or cfg.polish.batch_per_rank or last.micro,
            memory_format=parts.memory_format,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    trainer_state = json.loads((ckpt_root / tag / checkpoint.STATE_FILE).read_text())
    info = {
        "checkpoint": str(ckpt_root / tag),
        "world_size": world,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **summarize(before, after, trainer_state.get("train_time_s", 0.0)),
    }
    if dist.is_main():
        save_polished(run_dir, model, info, overwrite=args.force)
    dist.barrier()
    log.info(
        "polish: top-1 %.4f -> %.4f (%+.4f) -> %s",
        before["val_top1"],
        after["val_top1"],
        info["top1_gain"],
        run_dir / POLISHED_DIR,
    )
    return info


if __name__ == "__main__":
    sys.exit(main())
