"""NVIDIA DALI pipelines over an image folder: decode on the GPU (``mixed``) when there is one, on the CPU otherwise.

The files to read come from dstrain.data.sharding through an external source,
so DALI follows exactly the same sharding, per-epoch shuffle and batch-size
ramp as the other loaders (DALI's own file reader shuffles through a buffer and
shards by contiguous ranges; it could not reproduce our global batches).
Reading the encoded bytes is parallel (a thread pool of ``num_threads``);
decoding, cropping, resizing and normalising run inside DALI.

Pipelines
  train  decode with random-resized-crop (area / aspect-ratio ranges), resize to
         ``image_size``, random horizontal flip, normalise.
  val    decode, resize the shorter side to ``val_resize``, center crop
         ``image_size``, normalise. Also used for train mode with
         ``set_augment(False)`` and for the polish set.
Output: NCHW, or NHWC viewed as channels_last NCHW, in float16 for fp16
training, else float32 (DALI has no bfloat16; the trainer casts on the device).

The training pipeline is rebuilt at each epoch with a seed from (seed, epoch,
rank), so a resumed run draws the same crops as an uninterrupted one. Building
a CPU pipeline costs milliseconds; see bench/loader.py.
"""
from __future__ import annotations

import collections
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from dstrain.data.folder import (
    GRAY_MEAN,
    GRAY_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    CorruptImageError,
    ImageList,
    corrupt_image_message,
)
from dstrain.data.sharding import Shard, index_lists

log = logging.getLogger("dstrain")


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class _FileSource:
    """DALI external-source callback: batch ``i`` of the current index lists as (encoded bytes, labels)."""

    def __init__(self, images: ImageList, batches: list[torch.Tensor], pool: ThreadPoolExecutor):
        self.images, self.batches, self.pool = images, batches, pool
        self.in_flight: collections.deque = collections.deque(maxlen=8)  # file lists not yet returned by DALI

    def __call__(self, info):
        if info.iteration >= len(self.batches):
            raise StopIteration
        idx = self.batches[info.iteration].tolist()
        files = [self.images.files[i] for i in idx]
        self.in_flight.append(files)
        data = list(self.pool.map(_read_bytes, files))
        return data, self.images.labels[idx]


def _read_bytes(path: str) -> np.ndarray:
    try:
        return np.fromfile(path, dtype=np.uint8)
    except OSError as err:
        raise CorruptImageError(corrupt_image_message(path, f"unreadable: {err.strerror}")) from None


def find_undecodable(files: list[str]) -> list[str]:
    """The files PIL cannot decode (used to name the culprit when a DALI batch fails)."""
    from PIL import Image

    bad = []
    for path in files:
        try:
            with Image.open(path) as img:
                img.load()
        except (OSError, ValueError, SyntaxError):
            bad.append(path)
    return bad


class DaliLoader:
    """One split of an image folder through DALI; iteration yields (images, labels) on ``device``."""

    def __init__(self, images: ImageList, shard: Shard, mode: str, *, augment: bool, image_size: int,
                 val_resize: int, area: tuple[float, float], aspect: tuple[float, float], channels: int,
                 num_threads: int, prefetch: int, device, dtype: torch.dtype = torch.float32,
                 channels_last: bool = False, limit: int = 0):
        from nvidia.dali import types

        self.images, self.shard, self.mode, self.limit = images, shard, mode, limit
        self.augment = augment and mode == "train"
        self.image_size, self.val_resize = image_size, val_resize
        self.area, self.aspect = tuple(area), tuple(aspect)
        self.channels, self.channels_last = channels, channels_last
        self.num_threads, self.prefetch = max(1, num_threads), max(1, prefetch)
        self.device = torch.device(device)
        self.dtype = torch.float16 if dtype == torch.float16 else torch.float32
        self.dali_dtype = types.FLOAT16 if self.dtype == torch.float16 else types.FLOAT
        self.epoch = 0
        self.pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="dstrain-read")
        self._pipe, self._pipe_key, self._source, self._finished = None, None, None, False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_augment(self, augment: bool) -> None:
        self.augment = augment and self.mode == "train"

    def _batches(self) -> list[torch.Tensor]:
        return index_lists(len(self.images), self.shard, self.mode, self.epoch, self.limit)

    def __len__(self) -> int:
        return len(self._batches())

    # -- pipeline
    def _build(self, batches: list[torch.Tensor], seed: int):
        from nvidia.dali import fn, pipeline_def, types

        source = _FileSource(self.images, batches, self.pool)
        gpu = self.device.type == "cuda"
        rgb = self.channels == 3
        scale = 255.0
        mean = [m * scale for m in (IMAGENET_MEAN if rgb else GRAY_MEAN * self.channels)]
        std = [s * scale for s in (IMAGENET_STD if rgb else GRAY_STD * self.channels)]
        batch_size = max(1, max((len(b) for b in batches), default=1))
        augment, size = self.augment, self.image_size

        @pipeline_def(batch_size=batch_size, num_threads=self.num_threads, prefetch_queue_depth=self.prefetch,
                      device_id=(self.device.index or 0) if gpu else None, seed=seed)
        def pipeline():
            encoded, labels = fn.external_source(source=source, num_outputs=2, batch=True, batch_info=True,
                                                 dtype=[types.UINT8, types.INT64])
            decode_kw = dict(device="mixed" if gpu else "cpu", output_type=types.RGB if rgb else types.GRAY)
            if augment:
                images = fn.decoders.image_random_crop(encoded, random_area=list(self.area),
                                                       random_aspect_ratio=list(self.aspect), **decode_kw)
                images = fn.resize(images, size=[size, size])
                mirror = fn.random.coin_flip(probability=0.5)
                crop = {}
            else:
                images = fn.decoders.image(encoded, **decode_kw)
                images = fn.resize(images, resize_shorter=self.val_resize)
                mirror, crop = 0, dict(crop=[size, size], crop_pos_x=0.5, crop_pos_y=0.5)
            images = fn.crop_mirror_normalize(images, mirror=mirror, mean=mean, std=std, dtype=self.dali_dtype,
                                              output_layout="HWC" if self.channels_last else "CHW", **crop)
            return images, labels

        pipe = pipeline()
        pipe.build()
        return pipe, source

    def __iter__(self):
        batches = self._batches()
        if not batches:
            return
        key = (self.mode, self.augment, self.epoch if self.mode == "train" else 0, max(len(b) for b in batches))
        if self._pipe is not None and key == self._pipe_key and self._finished:
            self._source.batches = batches
            self._pipe.reset()
        else:  # train: a new pipeline per epoch, seeded by (seed, epoch, rank); val/polish: built once
            seed = (self.shard.seed * 1_000_003 + key[2]) * 1024 + self.shard.rank
            self._pipe = None  # release the old pipeline's threads and buffers first
            self._pipe, self._source = self._build(batches, seed % (2 ** 31))
            self._pipe_key = key
        self._finished = False
        yield from self._outputs()
        self._finished = True
        if self.mode == "train":
            self._pipe = None  # next epoch builds its own

    def _outputs(self):
        from nvidia.dali.plugin.pytorch import feed_ndarray

        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        while True:
            try:
                images, labels = self._pipe.run()
            except StopIteration:
                return
            except RuntimeError as err:
                self._pipe = None  # DALI marks a pipeline invalid after an operator error
                raise self._decode_error(err) from None
            self._source.in_flight.popleft()
            dense = images.as_tensor()  # every sample has the same shape after the crop
            x = torch.empty(dense.shape(), dtype=self.dtype, device=self.device)
            feed_ndarray(dense, x, cuda_stream=stream)
            y = torch.from_numpy(np.array(labels.as_tensor())).reshape(-1).to(self.device, non_blocking=True)
            if self.channels_last:  # NHWC in memory = NCHW with channels_last strides
                x = x.permute(0, 3, 1, 2)
            yield x, y

    def _decode_error(self, err: RuntimeError) -> Exception:
        suspects = [f for files in self._source.in_flight for f in files]
        bad = find_undecodable(suspects)
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else "DALI decode failed"
        if bad:
            extra = f" (and {len(bad) - 1} more in the same batch)" if len(bad) > 1 else ""
            return CorruptImageError(corrupt_image_message(bad[0], f"DALI: {reason}") + extra)
        return RuntimeError(f"DALI pipeline failed on a batch holding {suspects[:3]}...: {err}")
