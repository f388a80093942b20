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

from dstrain.core.errors import ConfigError
from dstrain.data.sharding import Output, Shard, ShardedBatches
from dstrain.settings.config import FASHION_MNIST_DEFAULT_ROOT

log = logging.getLogger(__name__)

FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# ---------------------------------------------------------------- Fashion-MNIST
def _read_idx(path: Path, header_only: bool) -> tuple[tuple[int, ...], bytes]:
    """(shape, the file's bytes or its header only) of an unsigned-byte idx file, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            head = fh.read(4)
            zero, dtype_code, ndim = struct.unpack(">HBB", head)
            if zero != 0 or dtype_code != 0x08 or ndim < 1:
                raise ValueError("not an unsigned-byte idx file")
            dims = fh.read(4 * ndim)
            shape = struct.unpack(">" + "I" * ndim, dims)
            return shape, b"" if header_only else head + dims + fh.read()
    except (OSError, ValueError, struct.error, EOFError) as err:
        raise ConfigError(
            f"{path}: unreadable idx file ({err}). Reinstall dataset-fashion-mnist "
            "or point data.root at intact files."
        ) from None


def read_idx(path: Path) -> np.ndarray:
    shape, data = _read_idx(path, header_only=False)
    try:
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(shape)).reshape(shape)
    except ValueError as err:  # fewer values than the header declares
        raise ConfigError(
            f"{path}: unreadable idx file ({err}). Reinstall dataset-fashion-mnist "
            "or point data.root at intact files."
        ) from None


def idx_length(path: Path) -> int:
    """The first dimension (images or labels) an idx file declares, read from its header only."""
    return _read_idx(path, header_only=True)[0][0]


def find_idx(root: Path, stem: str) -> Path | None:
    for folder in (root, root / "FashionMNIST" / "raw"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def idx_root(root: str) -> Path:
    """The folder ``data.root`` names, or the Debian package's."""
    return Path(root or FASHION_MNIST_DEFAULT_ROOT)


def idx_paths(base: Path) -> dict[str, tuple[Path | None, Path | None]]:
    """{split: (images file, labels file)} found under ``base`` (None where missing)."""
    return {split: (find_idx(base, i), find_idx(base, lb)) for split, (i, lb) in IDX_FILES.items()}


def missing_idx(base: Path, why: str = "") -> ConfigError:
    """The one message for a data root without the idx files (``why``: what else was tried)."""
    img, lbl = IDX_FILES["train"]
    return ConfigError(
        f"data.root={str(base)!r}: no Fashion-MNIST idx files ({img}[.gz], {lbl}[.gz], ...){why}. "
        "Install them with `apt-get install dataset-fashion-mnist` or set data.root=DIR."
    )


def load_fashion_mnist(root: str, download: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{'train': (uint8 [N,1,28,28], int64 [N]), 'val': ...} from the idx files in root."""
    base = idx_root(root)
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
    for split, (img_path, lbl_path) in idx_paths(base).items():
        if img_path is None or lbl_path is None:
            raise missing_idx(base)
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
        *,
        augment: bool = False,
        norm: tuple[float, float] = (FASHION_MNIST_MEAN, FASHION_MNIST_STD),
        out: Output = Output(),
        limit: int = 0,
    ):
        """``norm``: the (mean, std) images are normalised with; ``out``: channels and device."""
        super().__init__(len(images), shard, mode, limit)
        self.images, self.labels = images, labels
        self.augment = augment and mode == "train"
        (self.mean, self.std), self.channels = norm, out.channels
        self.device = torch.device(out.device)

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
