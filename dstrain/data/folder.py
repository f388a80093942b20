"""ImageNet-style folders: the file scan shared by both loaders, and the torchvision loader.

``root/train/<class>/*.JPEG`` and ``root/val/<class>/*.JPEG``. Class indices
follow the sorted class-folder names (the torchvision ``ImageFolder`` rule), and
files are listed once, sorted, by :func:`scan_split`; the DALI and torchvision
loaders both read that list, so they agree on every label by construction.
Files whose extension is not an image extension are skipped and counted in the
log; a file that has an image extension but does not decode stops the run with
:class:`CorruptImageError`, naming the file.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dstrain.config import DataConfig
from dstrain.data.sharding import Shard, ShardedBatches
from dstrain.errors import ConfigError

log = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GRAY_MEAN, GRAY_STD = (0.5,), (0.5,)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class CorruptImageError(ConfigError):
    """An image file that does not decode. The message starts with ``corrupt image: <path>``."""


def corrupt_image_message(path: str, reason: str) -> str:
    return (
        f"corrupt image: {path} ({reason}). Replace or delete the file "
        "(`python -m dstrain.data.check ROOT` lists every undecodable file)."
    )


def decode_error(path: str) -> str | None:
    """None when PIL decodes the whole file, else the reason (the one decode check: the check tool
    and the DALI loader's culprit search both use it)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()
    except (OSError, ValueError, SyntaxError) as err:  # what PIL raises for bad or truncated files
        return str(err) or type(err).__name__
    return None


@dataclass
class ImageList:
    """One split of a folder data set: files, their labels, the class names."""

    files: list[str]
    labels: np.ndarray  # int64, one per file
    classes: list[str]

    def __len__(self) -> int:
        return len(self.files)


def scan_split(root: Path, split: str, classes: list[str] | None = None) -> ImageList:
    """List ``root/split/<class>/**`` image files; labels index the sorted class names."""
    folder = root / split
    if not folder.is_dir():
        raise ConfigError(
            f"data.root={str(root)!r}: missing {folder}/ (expected {root}/train/<class>/*.JPEG "
            f"and {root}/val/<class>/*.JPEG). Set data.root to an ImageNet-style folder."
        )
    found = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    if not found:
        raise ConfigError(f"{folder}: no class folders (expected {folder}/<class>/*.JPEG)")
    if classes is not None and found != classes:
        extra, missing = sorted(set(found) - set(classes)), sorted(set(classes) - set(found))
        raise ConfigError(
            f"{folder}: class folders differ from train/ (only here: {extra[:5]}, "
            f"missing here: {missing[:5]}); both splits need the same classes"
        )
    files, labels, skipped, empty = [], [], 0, []
    for label, name in enumerate(found):
        before = len(files)
        for dirpath, dirnames, filenames in sorted(os.walk(folder / name, followlinks=True)):
            dirnames.sort()
            for fname in sorted(filenames):
                if fname.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(os.path.join(dirpath, fname))
                    labels.append(label)
                else:
                    skipped += 1
        if len(files) == before:
            empty.append(name)
    if not files:
        raise ConfigError(
            f"{folder}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in its class folders"
        )
    if skipped:
        log.warning("%s: skipped %d files without an image extension", folder, skipped)
    if empty:
        log.warning(
            "%s: %d class folders hold no images (%s)", folder, len(empty), ", ".join(empty[:5])
        )
    return ImageList(files, np.asarray(labels, dtype=np.int64), found)


def scan_folder(root: str) -> tuple[ImageList, ImageList]:
    if not root:
        raise ConfigError(
            "data.dataset=imagefolder needs data.root=DIR (holding train/<class>/ and val/<class>/)"
        )
    base = Path(root)
    train = scan_split(base, "train")
    return train, scan_split(base, "val", train.classes)


def limited(images: ImageList, n: int) -> ImageList:
    """The first n images (0 = all)."""
    return ImageList(images.files[:n], images.labels[:n], images.classes) if n else images


def subset(images: ImageList, indices) -> ImageList:
    """The images at ``indices`` (a sorted index tensor or sequence), same classes."""
    idx = [int(i) for i in indices]
    return ImageList([images.files[i] for i in idx], images.labels[idx], images.classes)


# ---------------------------------------------------------------- torchvision loader
class ImageDataset(torch.utils.data.Dataset):
    """PIL decode + a torchvision transform; undecodable files raise CorruptImageError naming the file.

    A key ``(i, seed)`` runs the transform's random draws (torchvision's transforms use torch's
    global generator) from ``seed`` in a forked generator state: the crop and flip of an image are a
    function of that seed alone, whichever DataLoader worker or process runs it, and the caller's
    generator is left as it was."""

    def __init__(self, images: ImageList, transform):
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key):
        i, seed = key if isinstance(key, tuple) else (key, None)
        img, label = self._decode(i)
        if seed is None:
            return self.transform(img), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.transform(img), label

    def _decode(self, i: int):
        from PIL import Image

        path = self.images.files[i]
        try:
            with Image.open(path) as img:
                img = img.convert("RGB")
        except (
            OSError,
            ValueError,
            SyntaxError,
        ) as err:  # what PIL raises for bad or truncated files
            raise CorruptImageError(
                corrupt_image_message(path, str(err) or type(err).__name__)
            ) from None
        return img, int(self.images.labels[i])


def torchvision_transforms(cfg: DataConfig, channels: int):
    """(train transform, val transform) for the ``data`` section: RandomResizedCrop + flip, or resize + center
    crop."""
    import torchvision.transforms as T

    image_size, val_resize, area, aspect = (
        cfg.image_size,
        cfg.val_resize,
        cfg.random_area,
        cfg.random_aspect_ratio,
    )
    tail = ([T.Grayscale(num_output_channels=channels)] if channels != 3 else []) + [
        T.ToTensor(),
        T.Normalize(
            IMAGENET_MEAN if channels == 3 else GRAY_MEAN * channels,
            IMAGENET_STD if channels == 3 else GRAY_STD * channels,
        ),
    ]
    train = T.Compose(
        [
            T.RandomResizedCrop(image_size, scale=tuple(area), ratio=tuple(aspect)),
            T.RandomHorizontalFlip(),
        ]
        + tail
    )
    val = T.Compose([T.Resize(val_resize), T.CenterCrop(image_size)] + tail)
    return train, val


class ShardBatchSampler(ShardedBatches, torch.utils.data.Sampler):
    """Batches of ``(index, augmentation seed)`` keys from dstrain.data.sharding; owns the epoch (no
    reference back to the loader: a cycle would leave the DataLoader's workers to the garbage
    collector, whose shutdown waits 5 s). The seed of an image is a function of (seed, epoch, image
    index): a resumed run, any number of workers and any world size draw the same crops."""

    def __iter__(self):
        base = (self.shard.seed * 1_000_003 + self.epoch) * 2**24
        return iter(
            [[(i, base + i) for i in batch.tolist()] for batch in self.batches()[self.start :]]
        )


class TorchvisionLoader:
    """torchvision transforms in DataLoader workers, batches cut by dstrain.data.sharding.

    ``start_epoch(..., augment=False)`` swaps in the val transform; the DataLoader (and its
    persistent workers, which hold a copy of the data set) is rebuilt then.
    """

    def __init__(
        self,
        images: ImageList,
        shard: Shard,
        mode: str,
        cfg: DataConfig,
        *,
        augment: bool,
        channels: int,
        device,
        limit: int = 0,
    ):
        """``cfg`` (the ``data`` section) gives transforms, workers, prefetch and pinning."""
        self.images, self.mode = images, mode
        self.sampler = ShardBatchSampler(len(images), shard, mode, limit)
        self.train_tf, self.val_tf = torchvision_transforms(cfg, channels)
        self.num_workers, self.prefetch = cfg.num_workers, cfg.prefetch
        self.device = torch.device(device)
        self.pin_memory = cfg.pin_memory and self.device.type == "cuda"
        self.augment, self._loader = augment and mode == "train", None

    def start_epoch(
        self,
        epoch: int,
        *,
        accumulation: int | None = None,
        start: int = 0,
        augment: bool | None = None,
    ) -> None:
        """See :meth:`dstrain.data.sharding.ShardedBatches.start_epoch`."""
        self.sampler.start_epoch(epoch, accumulation=accumulation, start=start)
        if augment is not None and (augment and self.mode == "train") != self.augment:
            self.augment, self._loader = augment and self.mode == "train", None

    def __len__(self) -> int:
        return len(self.sampler)

    def _make_loader(self):
        dataset = ImageDataset(self.images, self.train_tf if self.augment else self.val_tf)
        workers = (
            dict(persistent_workers=True, prefetch_factor=self.prefetch)
            if self.num_workers > 0
            else {}
        )
        return torch.utils.data.DataLoader(
            dataset,
            batch_sampler=self.sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            # its workers' base seed from a generator of its own, not the trainer's global one
            generator=torch.Generator().manual_seed(0),
            **workers,
        )

    def __iter__(self):
        if self._loader is None:
            self._loader = self._make_loader()
        try:
            for x, y in self._loader:
                yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        except (
            CorruptImageError
        ) as err:  # from a worker: the message carries the worker's traceback
            raise CorruptImageError(first_corrupt_line(str(err))) from None


def first_corrupt_line(text: str) -> str:
    match = re.search(r"corrupt image: .*", text)
    return match.group(0) if match else text
