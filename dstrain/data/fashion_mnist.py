"""Fashion-MNIST: the idx files held in memory, batches cut and augmented with tensor ops.

Small grayscale data goes through the same loader interface as the image-folder
loaders (``start_epoch``, ``len``, iteration yields device
batches) but not through DALI or torchvision: 60k 28x28 images fit in 47 MB, and
indexing a uint8 tensor plus a vectorised pad-crop-flip costs less than any
per-sample decode pipeline would.
"""

from __future__ import annotations

import gzip
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dstrain.config import FASHION_MNIST_DEFAULT_ROOT
from dstrain.data.sharding import Shard, ShardedBatches
from dstrain.errors import ConfigError

log = logging.getLogger(__name__)

FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# ---------------------------------------------------------------- Fashion-MNIST
def read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError("not an unsigned-byte idx file")
        shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
        arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
        return arr.reshape(shape)
    except (OSError, ValueError, struct.error, EOFError) as err:
        raise ConfigError(
            f"{path}: unreadable idx file ({err}). Reinstall dataset-fashion-mnist "
            "or point data.root at intact files."
        ) from None


def idx_length(path: Path) -> int:
    """The first dimension (images or labels) an idx file declares, read from its header only."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            head = fh.read(8)
        zero, dtype_code, ndim, length = struct.unpack(">HBBI", head)
        if zero != 0 or dtype_code != 0x08 or ndim < 1:
            raise ValueError("not an unsigned-byte idx file")
        return length
    except (OSError, ValueError, struct.error, EOFError) as err:
        raise ConfigError(
            f"{path}: unreadable idx file ({err}). Reinstall dataset-fashion-mnist "
            "or point data.root at intact files."
        ) from None


def find_idx(root: Path, stem: str) -> Path | None:
    for folder in (root, root / "FashionMNIST" / "raw"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def load_fashion_mnist(root: str, download: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{'train': (uint8 [N,1,28,28], int64 [N]), 'val': ...} from the idx files in root."""
    base = Path(root or FASHION_MNIST_DEFAULT_ROOT)
    if find_idx(base, IDX_FILES["train"][0]) is None and download:
        target = (
            base
            if (root and base.parent.exists())
            else Path.home() / ".cache" / "dstrain" / "fashion-mnist"
        )
        log.info(
            "no Fashion-MNIST idx files in %s; trying a torchvision download into %s", base, target
        )
        try:
            import torchvision

            torchvision.datasets.FashionMNIST(str(target), train=True, download=True)
            torchvision.datasets.FashionMNIST(str(target), train=False, download=True)
            base = target
        except Exception as err:  # no network, no permission...
            log.warning("download failed: %s", err)
    out = {}
    for split, (img_stem, lbl_stem) in IDX_FILES.items():
        img_path, lbl_path = find_idx(base, img_stem), find_idx(base, lbl_stem)
        if img_path is None or lbl_path is None:
            raise ConfigError(
                f"data.root={str(base)!r}: no Fashion-MNIST idx files ({img_stem}[.gz], {lbl_stem}[.gz]). "
                "Install them with `apt-get install dataset-fashion-mnist` or set data.root=DIR."
            )
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ConfigError(
                f"{img_path} / {lbl_path}: shapes {images.shape} / {labels.shape} do not match"
            )
        out[split] = (
            torch.from_numpy(images.copy()).unsqueeze(1),
            torch.from_numpy(labels.astype(np.int64)),
        )
    return out


class TensorLoader(ShardedBatches):
    """Batches from uint8 images held in memory; augmentation is vectorised over the batch.

    ``mode`` is train, val or polish (see dstrain/data/sharding.py). Training
    augmentation: random crop with 2-pixel zero padding and a horizontal flip,
    drawn from a generator seeded by (seed, epoch, rank), so that a resumed run
    sees the same images as an uninterrupted one.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        shard: Shard,
        mode: str,
        augment: bool,
        mean: float,
        std: float,
        channels: int,
        device: torch.device | str = "cpu",
        limit: int = 0,
    ):
        super().__init__(len(images), shard, mode, limit)
        self.images, self.labels = images, labels
        self.augment = augment and mode == "train"
        self.mean, self.std, self.channels, self.device = mean, std, channels, torch.device(device)

    def _set_augment(self, augment: bool) -> None:
        self.augment = augment and self.mode == "train"

    @staticmethod
    def _draw(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batch's random offsets and flips (drawn for skipped batches too: a resumed epoch
        continues the generator where the uninterrupted run would be)."""
        dy, dx = torch.randint(0, 5, (b,), generator=g), torch.randint(0, 5, (b,), generator=g)
        return dy, dx, torch.rand(b, generator=g)

    def _augment(self, x: torch.Tensor, draws: tuple) -> torch.Tensor:
        b, _, h, w = x.shape
        padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
        dy, dx, u = draws
        rows = (dy[:, None] + torch.arange(h))[:, :, None]  # [B, H, 1]
        cols = (dx[:, None] + torch.arange(w))[:, None, :]  # [B, 1, W]
        x = padded[torch.arange(b)[:, None, None], :, rows, cols]  # [B, H, W, C]
        x = x.permute(0, 3, 1, 2)
        flip = u < 0.5
        return torch.where(flip[:, None, None, None], x.flip(3), x)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.augment_seed())
        for k, idx in enumerate(self.batches()):
            draws = self._draw(len(idx), g) if self.augment else None
            if k < self.start:
                continue
            x = self.images[idx].float().div_(255)
            if self.augment:
                x = self._augment(x, draws)
            x = (x - self.mean) / self.std
            if self.channels != x.shape[1]:
                x = x.expand(-1, self.channels, -1, -1)
            yield (
                x.contiguous().to(self.device, non_blocking=True),
                self.labels[idx].to(self.device),
            )
