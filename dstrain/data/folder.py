"""The torchvision loader for ImageNet-style folders: PIL decode and torchvision transforms in
DataLoader workers, over the file list of dstrain/data/images.py (the DALI loader reads the same)."""

from __future__ import annotations

import torch

from dstrain.data.images import (
    GRAY_MEAN,
    GRAY_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    CorruptImageError,
    ImageList,
    corrupt_image_message,
    first_corrupt_line,
)
from dstrain.data.sharding import Output, Shard, ShardedBatches, filled_from
from dstrain.settings.config import DataConfig


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
            with Image.open(self.images.source(i)) as img:
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
        batches = self.batches()
        keys = [[(i, self._seed(self.epoch, i)) for i in batch.tolist()] for batch in batches]
        if self.shard.fill and self.mode == "train" and batches:
            self._next_epoch_crops(keys)
        return iter(keys[self.start :])

    def _seed(self, epoch: int, i: int) -> int:
        return (self.shard.seed * 1_000_003 + epoch) * 2**24 + i

    def _next_epoch_crops(self, keys: list[list[tuple[int, int]]]) -> None:
        """data.last_batch=fill: the images the epoch's last global batch takes from the next
        epoch's permutation draw that epoch's crops (an image can be in both parts)."""
        per_rank = self.shard.micro * self.shard.accumulation
        first = filled_from(self.n, self.shard, self.offset) - self.shard.rank * per_rank
        last_step = keys[-self.shard.accumulation :]
        for k in range(max(first, 0), per_rank):
            batch = last_step[k // self.shard.micro]
            i = batch[k % self.shard.micro][0]
            batch[k % self.shard.micro] = (i, self._seed(self.epoch + 1, i))


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
        augment: bool = False,
        out: Output = Output(),
        limit: int = 0,
    ):
        """``cfg`` (the ``data`` section) gives transforms, workers, prefetch and pinning."""
        self.images, self.mode = images, mode
        self.sampler = ShardBatchSampler(len(images), shard, mode, limit)
        self.train_tf, self.val_tf = torchvision_transforms(cfg, out.channels)
        self.num_workers, self.prefetch = cfg.num_workers, cfg.prefetch
        self.device = torch.device(out.device)  # float32 NCHW: the model's first layer converts
        self.pin_memory = cfg.pin_memory and self.device.type == "cuda"
        self.augment, self._loader = augment and mode == "train", None

    def start_epoch(
        self,
        epoch: int,
        *,
        accumulation: int | None = None,
        start: int = 0,
        augment: bool | None = None,
        offset: int = 0,
    ) -> None:
        """See :meth:`dstrain.data.sharding.ShardedBatches.start_epoch`."""
        self.sampler.start_epoch(epoch, accumulation=accumulation, start=start, offset=offset)
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
