"""Data: Fashion-MNIST from idx files, ImageNet-style folders (torchvision), synthetic batches.

Every training loader follows the same sharding rule, so a run's optimisation
does not depend on how many ranks share it: each epoch draws one permutation of
the data set from ``(seed, epoch)``, cuts it into global batches (the last,
incomplete one is dropped), and rank ``r`` takes the ``r``-th slice of every
global batch, split into micro batches. ``set_epoch`` is called by the trainer
(DeepSpeed's loader never calls it). Validation shards are contiguous and
disjoint: every val image is evaluated exactly once across ranks.
"""
from __future__ import annotations

import gzip
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dstrain.config import FASHION_MNIST_DEFAULT_ROOT, ConfigError, DataConfig

log = logging.getLogger("dstrain")

FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@dataclass
class Shard:
    """Where this rank stands in the data-parallel world, and its batch sizes."""
    rank: int = 0
    world: int = 1
    micro: int = 32          # images per forward on this rank
    accumulation: int = 1    # micro batches per optimizer step
    eval_batch: int = 1000   # images per eval forward on this rank
    seed: int = 0

    @property
    def global_batch(self) -> int:
        return self.micro * self.accumulation * self.world


def epoch_order(n: int, shard: Shard, epoch: int, shuffle: bool = True) -> list[torch.Tensor]:
    """This rank's micro-batch index lists for one epoch (see the module docstring)."""
    g = torch.Generator().manual_seed(shard.seed * 100_003 + epoch)
    order = torch.randperm(n, generator=g) if shuffle else torch.arange(n)
    per_rank = shard.micro * shard.accumulation
    steps = n // shard.global_batch
    out = []
    for s in range(steps):
        start = s * shard.global_batch + shard.rank * per_rank
        mine = order[start:start + per_rank]
        out.extend(mine.split(shard.micro))
    return out


def val_range(n: int, rank: int, world: int) -> range:
    """Contiguous, disjoint shard: the union over ranks is every index exactly once."""
    return range(rank * n // world, (rank + 1) * n // world)


# ---------------------------------------------------------------- Fashion-MNIST
def read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError("not an unsigned-byte idx file")
        shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
        arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
        return arr.reshape(shape)
    except (OSError, ValueError, struct.error, EOFError) as err:
        raise ConfigError(f"{path}: unreadable idx file ({err}). Reinstall dataset-fashion-mnist "
                          "or point data.root at intact files.") from None


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
        target = base if (root and base.parent.exists()) else Path.home() / ".cache" / "dstrain" / "fashion-mnist"
        log.info("no Fashion-MNIST idx files in %s; trying a torchvision download into %s", base, target)
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
                "Install them with `apt-get install dataset-fashion-mnist` or set data.root=DIR.")
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ConfigError(f"{img_path} / {lbl_path}: shapes {images.shape} / {labels.shape} do not match")
        out[split] = (torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))
    return out


class TensorLoader:
    """Batches from uint8 images held in memory; augmentation is vectorised over the batch.

    Training augmentation (Fashion-MNIST): random crop with 2-pixel zero padding
    and a horizontal flip, drawn from a generator seeded by (seed, epoch, rank)
    so that a resumed run sees the same images as an uninterrupted one.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shard: Shard, train: bool, augment: bool,
                 mean: float, std: float, channels: int, device: torch.device | str = "cpu"):
        self.images, self.labels, self.shard = images, labels, shard
        self.train, self.augment = train, augment and train
        self.mean, self.std, self.channels, self.device = mean, std, channels, torch.device(device)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _index_lists(self) -> list[torch.Tensor]:
        if self.train:
            return epoch_order(len(self.images), self.shard, self.epoch)
        idx = torch.tensor(val_range(len(self.images), self.shard.rank, self.shard.world), dtype=torch.long)
        return list(idx.split(self.shard.eval_batch))

    def __len__(self) -> int:
        return len(self._index_lists())

    def _augment(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        b, _, h, w = x.shape
        padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
        dy = torch.randint(0, 5, (b,), generator=g)
        dx = torch.randint(0, 5, (b,), generator=g)
        rows = (dy[:, None] + torch.arange(h))[:, :, None]          # [B, H, 1]
        cols = (dx[:, None] + torch.arange(w))[:, None, :]          # [B, 1, W]
        x = padded[torch.arange(b)[:, None, None], :, rows, cols]   # [B, H, W, C]
        x = x.permute(0, 3, 1, 2)
        flip = torch.rand(b, generator=g) < 0.5
        return torch.where(flip[:, None, None, None], x.flip(3), x)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed((self.shard.seed * 1_000_003 + self.epoch) * 1024 + self.shard.rank)
        for idx in self._index_lists():
            x = self.images[idx].float().div_(255)
            if self.augment:
                x = self._augment(x, g)
            x = (x - self.mean) / self.std
            if self.channels != x.shape[1]:
                x = x.expand(-1, self.channels, -1, -1)
            yield x.contiguous().to(self.device, non_blocking=True), self.labels[idx].to(self.device)


# ---------------------------------------------------------------- ImageNet-style folder
class ShardSampler(torch.utils.data.Sampler):
    """Training: this rank's indices in the global-batch order of epoch_order(). Val: a contiguous shard."""

    def __init__(self, n: int, shard: Shard, train: bool):
        self.n, self.shard, self.train, self.epoch = n, shard, train, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> list[int]:
        if self.train:
            return [i for batch in epoch_order(self.n, self.shard, self.epoch) for i in batch.tolist()]
        return list(val_range(self.n, self.shard.rank, self.shard.world))

    def __iter__(self):
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())


class FolderLoader:
    """torchvision ImageFolder + DataLoader with the trainer's sharding; moves batches to the device."""

    def __init__(self, dataset, shard: Shard, train: bool, num_workers: int, pin_memory: bool, device):
        self.sampler = ShardSampler(len(dataset), shard, train)
        self.device = torch.device(device)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=shard.micro if train else shard.eval_batch, sampler=self.sampler,
            num_workers=num_workers, pin_memory=pin_memory and self.device.type == "cuda",
            persistent_workers=num_workers > 0, drop_last=False)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def build_imagefolder(cfg: DataConfig, shard: Shard, device, channels: int):
    import torchvision.datasets as tvd
    import torchvision.transforms as T

    root = Path(cfg.root)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError(f"data.root={cfg.root!r}: missing {root / split}/ (expected {root}/train/<class>/*.JPEG "
                              f"and {root}/val/<class>/*.JPEG). Set data.root to an ImageNet-style folder.")
    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    to_channels = [T.Grayscale(num_output_channels=channels)] if channels != 3 else []
    train_tf = T.Compose(([T.RandomResizedCrop(cfg.image_size), T.RandomHorizontalFlip()] if cfg.augment else
                          [T.Resize(cfg.val_resize), T.CenterCrop(cfg.image_size)])
                         + to_channels + [T.ToTensor(), normalize if channels == 3 else T.Normalize([0.5], [0.5])])
    val_tf = T.Compose([T.Resize(cfg.val_resize), T.CenterCrop(cfg.image_size)] + to_channels
                       + [T.ToTensor(), normalize if channels == 3 else T.Normalize([0.5], [0.5])])
    try:
        train_ds = tvd.ImageFolder(str(root / "train"), train_tf)
        val_ds = tvd.ImageFolder(str(root / "val"), val_tf)
    except (FileNotFoundError, RuntimeError) as err:
        raise ConfigError(f"data.root={cfg.root!r}: {err}") from None
    if train_ds.class_to_idx != val_ds.class_to_idx:
        raise ConfigError(f"data.root={cfg.root!r}: train/ and val/ have different class folders")
    train_ds, val_ds = _limit(train_ds, cfg.limit_train), _limit(val_ds, cfg.limit_val)
    return (FolderLoader(train_ds, shard, True, cfg.num_workers, cfg.pin_memory, device),
            FolderLoader(val_ds, shard, False, cfg.num_workers, cfg.pin_memory, device),
            len(train_ds), len(val_ds))


def _limit(ds, n: int):
    return torch.utils.data.Subset(ds, range(min(n, len(ds)))) if n else ds


# ---------------------------------------------------------------- synthetic
class SyntheticLoader:
    """Device-resident random batches, no decode or copy cost: for throughput benchmarks."""

    def __init__(self, n: int, batch: int, shape: tuple[int, ...], num_classes: int, device, seed: int, train: bool,
                 shard: Shard):
        g = torch.Generator().manual_seed(seed + shard.rank)
        self.x = torch.randn((batch, *shape), generator=g).to(device)
        self.y = torch.randint(0, num_classes, (batch,), generator=g).to(device)
        self.n, self.batch, self.train, self.shard = n, batch, train, shard

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        if self.train:  # read at each epoch: a batch-size ramp changes shard.accumulation
            return (self.n // self.shard.global_batch) * self.shard.accumulation
        return -(-len(val_range(self.n, self.shard.rank, self.shard.world)) // self.batch)

    def __iter__(self):
        for _ in range(len(self)):
            yield self.x, self.y


# ---------------------------------------------------------------- entry point
def build_data(cfg: DataConfig, shard: Shard, channels: int, num_classes: int, device="cpu"):
    """(train_loader, val_loader, n_train, n_val) for cfg.dataset, sharded for this rank."""
    if cfg.dataset == "fashion_mnist":
        splits = load_fashion_mnist(cfg.root, cfg.download)
        (xt, yt), (xv, yv) = splits["train"], splits["val"]
        if cfg.limit_train:
            xt, yt = xt[:cfg.limit_train], yt[:cfg.limit_train]
        if cfg.limit_val:
            xv, yv = xv[:cfg.limit_val], yv[:cfg.limit_val]
        if int(yt.max()) >= num_classes:
            raise ConfigError(f"model.num_classes={num_classes} but Fashion-MNIST has 10 classes")
        common = dict(mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD, channels=channels, device=device)
        train = TensorLoader(xt, yt, shard, train=True, augment=cfg.augment, **common)
        val = TensorLoader(xv, yv, shard, train=False, augment=False, **common)
        n_train, n_val = len(xt), len(xv)
    elif cfg.dataset == "imagefolder":
        train, val, n_train, n_val = build_imagefolder(cfg, shard, device, channels)
    else:
        shape = (channels, cfg.image_size, cfg.image_size)
        n_train, n_val = cfg.synthetic_train_size, cfg.synthetic_val_size
        train = SyntheticLoader(n_train, shard.micro, shape, num_classes, device, shard.seed, True, shard)
        val = SyntheticLoader(n_val, shard.eval_batch, shape, num_classes, device, shard.seed, False, shard)
    if n_train < shard.global_batch:
        raise ConfigError(f"data: {n_train} training images is less than one global batch "
                          f"(batch.global_size={shard.global_batch}); lower batch.global_size or use more data")
    return train, val, n_train, n_val
