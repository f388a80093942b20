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

import io
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dstrain.core.errors import ConfigError
from dstrain.data.shards import ShardStore, scan_shards

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


def decode_error(path) -> str | None:
    """None when PIL decodes the whole file (a path, or a shard sample's bytes as a file object),
    else the reason (the one decode check: the check tool and the DALI loader's culprit search
    both use it)."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()
    except (OSError, ValueError, SyntaxError) as err:  # what PIL raises for bad or truncated files
        return str(err) or type(err).__name__
    return None


@dataclass
class ImageList:
    """One split of an image data set: its samples (files, or with ``store`` samples in shards,
    dstrain/data/shards.py), their labels, the class names."""

    files: list[str]  # paths; with a store, each sample's name for messages (shard:member)
    labels: np.ndarray  # int64, one per file
    classes: list[str]
    store: ShardStore | None = None  # the bytes of shard samples; None: files are read from disk

    def __len__(self) -> int:
        return len(self.files)

    def source(self, i: int):
        """What PIL opens for sample ``i``: its path, or its bytes from the shard."""
        return self.files[i] if self.store is None else io.BytesIO(self.store.read(i))


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
        flat = any(
            e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in os.scandir(folder)
        )
        raise ConfigError(
            f"{folder}: no class folders (expected {folder}/<class>/*.JPEG)"
            + (
                "; it holds images directly (image-net.org's val layout): give their labels file "
                "(data.val_labels=FILE; python -m dstrain.data.convert ... --val-labels FILE)"
                if flat
                else ""
            )
        )
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


def scan_folder(root: str, val_labels: str = "") -> tuple[ImageList, ImageList]:
    """(train, val) of an image folder; with ``val_labels`` val/ holds its files directly."""
    if not root:
        raise ConfigError(
            "data.dataset=imagefolder needs data.root=DIR (holding train/<class>/ and val/<class>/)"
        )
    base = Path(root)
    train = scan_split(base, "train")
    if val_labels:
        return train, flat_split(base / "val", Path(val_labels), train.classes)
    return train, scan_split(base, "val", train.classes)


def scan_images(root: str, fmt: str, num_classes: int | None, val_labels: str = ""):
    """(train, val) of ``data.format``: a folder of class folders, or shards (wds, recordio).
    Shards' classes are ``num_classes`` indexes; None (shards without a classes.txt, read by
    ``python -m dstrain.data.check``): any label, named by the labels found, so the list grows
    with the data, never with a guess."""
    if fmt == "folder":
        return scan_folder(root, val_labels)
    if not root:
        raise ConfigError(f"data.format={fmt} needs data.root=DIR (holding train/ and val/ shards)")
    scanned = [scan_shards(Path(root) / split, fmt, num_classes) for split in ("train", "val")]
    if num_classes is None:  # the distinct labels found (data.check: it decodes, never trains)
        names = [str(c) for c in np.unique(np.concatenate([s.labels for s in scanned]))]
    else:
        names = [str(c) for c in range(num_classes)]
    return tuple(ImageList(s.names, s.labels, names, s.store) for s in scanned)


def flat_split(folder: Path, labels_file: Path, classes: list[str]) -> ImageList:
    """The validation set as image-net.org ships it: ``folder`` holds the image files directly,
    labelled by ``labels_file``: image-net.org's ``LOC_val_solution.csv`` (ImageId, then the class
    folder name first in PredictionString), or one label per line in sorted file-name order, each
    a class folder name or a class index (0-based, sorted class folder names)."""
    if not folder.is_dir():
        raise ConfigError(f"data.val_labels: {folder}/ does not exist (it holds the val images)")
    files = sorted(
        e.path
        for e in os.scandir(folder)
        if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
    )
    if not files:
        raise ConfigError(
            f"data.val_labels={str(labels_file)!r}: {folder}/ holds no image files directly; "
            "with class folders there, leave data.val_labels empty"
        )
    if not labels_file.is_file():
        raise ConfigError(f"data.val_labels={str(labels_file)!r}: no such file")
    by_name = {name: k for k, name in enumerate(classes)}
    lines = labels_file.read_text().splitlines()
    labels = []
    if lines and lines[0].replace(" ", "").lower().startswith("imageid,"):
        wanted = {}
        for n, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            image_id, _, prediction = line.partition(",")
            wanted[image_id.strip()] = (n, prediction.split()[0] if prediction.split() else "")
        for path in files:
            stem = Path(path).stem
            if stem not in wanted:
                raise ConfigError(
                    f"{labels_file}: no row for {path} (ImageId {stem}); the file lists "
                    f"{len(wanted)} images: use the labels file of this val/ folder"
                )
            n, name = wanted[stem]
            labels.append(_class_of(name, by_name, f"{labels_file}:{n}"))
        # both ways: a row whose image is gone (a copy that lost files) would shrink the set silently
        stems = {Path(path).stem for path in files}
        missing = sorted(
            (n, image_id) for image_id, (n, _) in wanted.items() if image_id not in stems
        )
        if missing:
            n, image_id = missing[0]
            raise ConfigError(
                f"{labels_file}:{n}: ImageId {image_id} has no image file in {folder}/ "
                f"({len(missing)} of its {len(wanted)} rows have none; the folder holds "
                f"{len(files)} images): the folder lost images, or the file belongs to another set"
            )
    else:
        rows = [(n, line.strip()) for n, line in enumerate(lines, start=1) if line.strip()]
        if len(rows) != len(files):
            raise ConfigError(
                f"{labels_file}: {len(rows)} labels for the {len(files)} image files in {folder}/; "
                "one label per line, in sorted file-name order, is needed"
            )
        labels = [_class_of(value, by_name, f"{labels_file}:{n}") for n, value in rows]
    return ImageList(files, np.asarray(labels, dtype=np.int64), classes)


def _class_of(value: str, by_name: dict[str, int], where: str) -> int:
    if value in by_name:
        return by_name[value]
    if value.isdigit() and int(value) < len(by_name):
        return int(value)
    raise ConfigError(
        f"{where}: {value!r} is neither a class folder of train/ nor a class index below "
        f"{len(by_name)}; labels are class folder names (e.g. {next(iter(by_name), '?')}) or "
        "0-based indices into their sorted list"
    )


def limited(images: ImageList, n: int) -> ImageList:
    """The first n images (0 = all)."""
    return subset(images, range(n)) if n and n < len(images) else images


def subset(images: ImageList, indices) -> ImageList:
    """The images at ``indices`` (a sorted index tensor or sequence), same classes."""
    idx = [int(i) for i in indices]
    store = images.store.take(idx) if images.store is not None else None
    return ImageList([images.files[i] for i in idx], images.labels[idx], images.classes, store)


def first_corrupt_line(text: str) -> str:
    match = re.search(r"corrupt image: .*", text)
    return match.group(0) if match else text
