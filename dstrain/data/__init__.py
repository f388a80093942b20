"""Data: one loader interface over Fashion-MNIST (in memory), image folders (DALI or torchvision), synthetic.

Every loader has ``start_epoch(epoch, accumulation=, start=, augment=)``
(called once per epoch by the trainer), ``len()`` (micro batches this rank
reads this epoch) and yields ``(images, labels)`` on the training device; which
images each rank reads is decided in one place,
:mod:`dstrain.data.sharding`. :func:`build_data` is the entry point.

``data.loader``
  auto         DALI for image folders when nvidia-dali is installed, else torchvision;
               the in-memory tensor loader for Fashion-MNIST
  dali         DALI pipelines (GPU decode when training on a GPU, CPU otherwise)
  torchvision  PIL + torchvision transforms in DataLoader workers (image folders);
               for Fashion-MNIST, the in-memory tensor loader
  synthetic    random device-resident batches with the data set's shape; reads no files

Batch-size ramp: the micro batch stays fixed and the ramp raises the number of
accumulation steps (dstrain/settings/ramp.py), so no loader or pipeline is rebuilt; each
epoch's index lists are cut again from the accumulation ``start_epoch`` passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dstrain.core.errors import ConfigError
from dstrain.data.fashion_mnist import (
    TensorLoader,
    idx_length,
    idx_paths,
    idx_root,
    load_fashion_mnist,
    missing_idx,
)
from dstrain.data.holdout import holdout_split
from dstrain.data.images import CorruptImageError, ImageList, limited, scan_images, subset
from dstrain.data.sharding import (
    Loader,
    Output,
    Shard,
    epoch_order,
    index_lists,
    polish_batches,
    val_range,
)
from dstrain.settings.config import DataConfig

__all__ = [
    "Data",
    "Shard",
    "build_data",
    "count_images",
    "resolve_loader",
    "epoch_order",
    "index_lists",
    "polish_batches",
    "val_range",
    "CorruptImageError",
]
log = logging.getLogger(__name__)
HOLDOUT_LOG = (
    "data: data.holdout: evaluating on %d held-out training images, training on the other %d; "
    "the validation/test set is not read"
)
FASHION_MNIST_SIDE = 28
FASHION_MNIST_CLASSES = 10


@dataclass
class Data:
    """The loaders of one run. ``polish(limit, batch)`` builds the polish loader on demand (Final Polishing)."""

    train: Loader
    val: Loader
    n_train: int
    n_val: int
    kind: str  # the loader actually used: tensor | dali | torchvision | synthetic
    polish: Callable[[int, int], Loader]  # (limit images, 0 = all; batch per rank) -> polish loader


def resolve_loader(cfg: DataConfig) -> str:
    """data.loader with ``auto`` resolved; a DALI request without DALI installed is an error."""
    from dstrain.data.dali import dali_available

    if cfg.loader == "auto":
        return (
            "dali"
            if cfg.dataset == "imagefolder" and dali_available()
            else ("tensor" if cfg.dataset == "fashion_mnist" else "torchvision")
        )
    if cfg.loader == "dali":
        if cfg.dataset == "fashion_mnist":
            raise ConfigError(
                "data.loader=dali reads image folders; Fashion-MNIST is served from memory. "
                "Use data.loader=auto (or torchvision) with data.dataset=fashion_mnist."
            )
        if not dali_available():
            raise ConfigError(
                "data.loader=dali but nvidia-dali is not installed: "
                "`pip install nvidia-dali-cuda130` (or set data.loader=torchvision)"
            )
    if cfg.loader == "torchvision" and cfg.dataset == "fashion_mnist":
        return "tensor"
    return cfg.loader


@dataclass(frozen=True)
class ImageCounts:
    """What a run reads, found without decoding anything: the run's start-up checks and
    ``python -m dstrain --check`` (dstrain/run/startup.py) count with it, and :func:`build_data` builds
    from it, so an image folder is scanned once."""

    kind: str  # the loader: tensor | dali | torchvision | synthetic
    n_train: int
    n_val: int
    source: str  # where the images come from, for the plan
    note: str = ""  # something the run would do first (a download)
    # image folders and shards: the (train, val) lists, limits and holdout applied
    images: tuple[ImageList, ImageList] | None = field(default=None, compare=False, repr=False)


def count_images(cfg: DataConfig, num_classes: int) -> ImageCounts:
    """The loader ``cfg`` resolves to and its image counts (limits and holdout applied), reading only
    directory listings, shard indexes and idx headers; a missing or unusable data root raises
    ConfigError."""
    kind = resolve_loader(cfg)
    return SOURCES[kind].count(cfg, kind, num_classes)


def build_data(
    cfg: DataConfig,
    shard: Shard,
    channels: int,
    num_classes: int,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    counts: ImageCounts | None = None,
) -> Data:
    """The train/val loaders for ``cfg``, sharded for this rank (see dstrain.data.sharding), from
    ``counts`` (:func:`count_images` of the same config; counted here when not given)."""
    counts = counts or count_images(cfg, num_classes)
    out = Output(channels, device, dtype, channels_last)
    return SOURCES[counts.kind].build(cfg, counts, shard, out, num_classes)


def _limits(cfg: DataConfig, n_train: int, n_val: int) -> tuple[int, int]:
    """(train, val) counts after data.limit_* and data.holdout."""
    n_train, n_val = min(n_train, cfg.limit_train or n_train), min(n_val, cfg.limit_val or n_val)
    if cfg.holdout:
        keep, held = holdout_split(n_train, cfg.holdout)  # its rule and message
        return len(keep), len(held)
    return n_train, n_val


def _synthetic_side(cfg: DataConfig) -> int:
    return FASHION_MNIST_SIDE if cfg.dataset == "fashion_mnist" else cfg.image_size


def _count_synthetic(cfg: DataConfig, kind: str, num_classes: int) -> ImageCounts:
    side = _synthetic_side(cfg)
    return ImageCounts(
        kind,
        cfg.synthetic_train_size,
        cfg.synthetic_val_size,
        f"random {side}x{side} batches, no files",
    )


def _synthetic(cfg: DataConfig, counts: ImageCounts, shard: Shard, out: Output, num_classes: int):
    from dstrain.data.synthetic import SyntheticLoader

    side, n_train = _synthetic_side(cfg), counts.n_train
    common = dict(shape=(out.channels, side, side), num_classes=num_classes, shard=shard, out=out)
    return Data(
        SyntheticLoader(n_train, mode="train", **common),
        SyntheticLoader(counts.n_val, mode="val", **common),
        n_train,
        counts.n_val,
        counts.kind,
        lambda limit, batch: SyntheticLoader(
            limit or n_train,
            mode="polish",
            **{**common, "shard": replace(shard, eval_batch=batch)},
        ),
    )


def _count_fashion_mnist(cfg: DataConfig, kind: str, num_classes: int) -> ImageCounts:
    if num_classes < FASHION_MNIST_CLASSES:
        raise ConfigError(
            f"model.num_classes={num_classes} but Fashion-MNIST has {FASHION_MNIST_CLASSES} "
            f"classes; set model.num_classes={FASHION_MNIST_CLASSES}"
        )
    base = idx_root(cfg.root)
    paths = {split: images for split, (images, _) in idx_paths(base).items()}
    if None in paths.values():
        if not cfg.download:
            raise missing_idx(base, " and data.download=false")
        note = f"no idx files in {base}: the run would first try a torchvision download"
        return ImageCounts(kind, *_limits(cfg, 60000, 10000), str(base), note)
    n_train, n_val = _limits(cfg, idx_length(paths["train"]), idx_length(paths["val"]))
    return ImageCounts(kind, n_train, n_val, str(paths["train"].parent))


def _fashion_mnist(
    cfg: DataConfig, counts: ImageCounts, shard: Shard, out: Output, num_classes: int
) -> Data:
    splits = load_fashion_mnist(cfg.root, cfg.download)
    (xt, yt), (xv, yv) = splits["train"], splits["val"]
    if cfg.limit_train:
        xt, yt = xt[: cfg.limit_train], yt[: cfg.limit_train]
    if cfg.limit_val:
        xv, yv = xv[: cfg.limit_val], yv[: cfg.limit_val]
    if cfg.holdout:
        keep, held = holdout_split(len(xt), cfg.holdout)
        (xt, yt), (xv, yv) = (xt[keep], yt[keep]), (xt[held], yt[held])
        log.info(HOLDOUT_LOG, len(xv), len(xt))
    return Data(
        TensorLoader(xt, yt, shard, "train", augment=cfg.augment, out=out),
        TensorLoader(xv, yv, shard, "val", out=out),
        len(xt),
        len(xv),
        "tensor",
        lambda limit, batch: TensorLoader(
            xt, yt, replace(shard, eval_batch=batch), "polish", out=out, limit=limit
        ),
    )


def scan_classes(cfg: DataConfig, num_classes: int):
    """:func:`scan_images`'s (train, val) for ``data.format``, refusing more class folders than
    the model has outputs (shards: a label outside them)."""
    train_images, val_images = scan_images(cfg.root, cfg.format, num_classes, cfg.val_labels)
    if len(train_images.classes) > num_classes:
        raise ConfigError(
            f"model.num_classes={num_classes} but {cfg.root}/train has "
            f"{len(train_images.classes)} class folders; set model.num_classes="
            f"{len(train_images.classes)}"
        )
    return train_images, val_images


def _count_folder(cfg: DataConfig, kind: str, num_classes: int) -> ImageCounts:
    """Image folders and shards: scanned once; the lists travel in the counts to the loaders."""
    train_images, val_images = scan_classes(cfg, num_classes)
    n_classes = len(train_images.classes)
    train_images, val_images = (
        limited(train_images, cfg.limit_train),
        limited(val_images, cfg.limit_val),
    )
    if cfg.holdout:
        keep, held = holdout_split(len(train_images), cfg.holdout)
        train_images, val_images = subset(train_images, keep), subset(train_images, held)
    source = f"{cfg.root} ({n_classes} classes" + (
        f", {cfg.format} shards)" if cfg.format != "folder" else ")"
    )
    return ImageCounts(
        kind, len(train_images), len(val_images), source, images=(train_images, val_images)
    )


def _folder(
    cfg: DataConfig, counts: ImageCounts, shard: Shard, out: Output, num_classes: int
) -> Data:
    train_images, val_images = counts.images
    kind = counts.kind
    if cfg.holdout:
        log.info(HOLDOUT_LOG, len(val_images), len(train_images))
    if kind == "dali":
        from dstrain.data.dali import DaliLoader as FolderLoader
    else:
        from dstrain.data.folder import TorchvisionLoader as FolderLoader

    def make(images: ImageList, mode: str, augment: bool, limit: int = 0, shard: Shard = shard):
        return FolderLoader(images, shard, mode, cfg, augment=augment, out=out, limit=limit)

    log.info(
        "data: %s loader, %d train / %d val images in %d classes from %s (%s)",
        kind,
        len(train_images),
        len(val_images),
        len(train_images.classes),
        cfg.root,
        cfg.format,
    )
    return Data(
        make(train_images, "train", cfg.augment),
        make(val_images, "val", False),
        len(train_images),
        len(val_images),
        kind,
        lambda limit, batch: make(
            train_images, "polish", False, limit, replace(shard, eval_batch=batch)
        ),
    )


@dataclass(frozen=True)
class Source:
    """How one loader kind counts its images and builds its loaders from the counts."""

    count: Callable[[DataConfig, str, int], ImageCounts]
    build: Callable[[DataConfig, ImageCounts, Shard, Output, int], Data]


# data.loader (resolved) -> its source; a new loader kind is one entry here
SOURCES = {
    "synthetic": Source(_count_synthetic, _synthetic),
    "tensor": Source(_count_fashion_mnist, _fashion_mnist),
    "dali": Source(_count_folder, _folder),
    "torchvision": Source(_count_folder, _folder),
}
