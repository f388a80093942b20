"""ImageNet-style folders: the file scan both loaders share, and the corrupt-image error.

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


def first_corrupt_line(text: str) -> str:
    match = re.search(r"corrupt image: .*", text)
    return match.group(0) if match else text
