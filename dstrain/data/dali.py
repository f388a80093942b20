"""NVIDIA DALI pipelines over an image folder: decode on the GPU (``mixed``) when there is one, on the CPU otherwise.

Which files a rank reads, and in what order, comes from dstrain.data.sharding:
each pass (a training epoch, an evaluation) builds a pipeline whose file reader
gets exactly that list with shuffling off, so DALI follows the same sharding,
per-epoch shuffle and batch-size ramp as the other loaders (DALI's own shuffle
draws from a buffer and its shards are contiguous ranges; it could not
reproduce our global batches). Reading, decoding, cropping, resizing and
normalising all run in DALI's threads.

Pipelines
  train  decode with random-resized-crop (area / aspect-ratio ranges), resize to
         ``image_size``, random horizontal flip, normalise.
  val    decode, resize the shorter side to ``val_resize``, center crop
         ``image_size``, normalise. Also used for train mode with
         ``start_epoch(..., augment=False)`` and for the polish set.
Output: NCHW, or NHWC viewed as channels_last NCHW, in float16 for fp16
training, else float32 (DALI has no bfloat16; the trainer casts on the device).

A training pipeline is seeded from (seed, epoch, rank), so a resumed run draws
the same crops as an uninterrupted one. Building a pipeline costs milliseconds
plus the file list (bench/loader.py records it).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from dstrain.config import DataConfig
from dstrain.data.folder import (
    GRAY_MEAN,
    GRAY_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    CorruptImageError,
    ImageList,
    corrupt_image_message,
    decode_error,
)
from dstrain.data.sharding import Shard, ShardedBatches

log = logging.getLogger(__name__)


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class DaliLoader(ShardedBatches):
    """One split of an image folder through DALI; iteration yields (images, labels) on ``device``."""

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
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        limit: int = 0,
    ):
        """``cfg`` (the ``data`` section) gives sizes, crop ranges, threads and prefetch."""
        super().__init__(len(images), shard, mode, limit)
        self.images = images
        self.augment = augment and mode == "train"
        self.image_size, self.val_resize = cfg.image_size, cfg.val_resize
        self.area, self.aspect = tuple(cfg.random_area), tuple(cfg.random_aspect_ratio)
        self.channels, self.channels_last = channels, channels_last
        self.num_threads, self.prefetch = max(1, cfg.num_workers), max(1, cfg.prefetch)
        self.device = torch.device(device)
        self.dtype = torch.float16 if dtype == torch.float16 else torch.float32

    def _set_augment(self, augment: bool) -> None:
        self.augment = augment and self.mode == "train"

    def _build(self, files: list[str], labels: list[int], batch_size: int, seed: int):
        """A pipeline that reads ``files`` in this order (DALI's reader threads), then decodes and transforms."""
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device.type == "cuda"
        rgb = self.channels == 3
        mean = [m * 255 for m in (IMAGENET_MEAN if rgb else GRAY_MEAN * self.channels)]
        std = [s * 255 for s in (IMAGENET_STD if rgb else GRAY_STD * self.channels)]
        size, dtype = self.image_size, types.FLOAT16 if self.dtype == torch.float16 else types.FLOAT

        @pipeline_def(
            batch_size=batch_size,
            num_threads=self.num_threads,
            prefetch_queue_depth=self.prefetch,
            device_id=(self.device.index or 0) if gpu else None,
            seed=seed,
        )
        def pipeline():
            # pad_last_batch: a short last batch is filled with copies of its last file; __iter__ trims them
            encoded, label = fn.readers.file(
                files=files,
                labels=labels,
                random_shuffle=False,
                pad_last_batch=True,
                prefetch_queue_depth=self.prefetch,
                name="reader",
            )
            decode = dict(
                device="mixed" if gpu else "cpu", output_type=types.RGB if rgb else types.GRAY
            )
            if self.augment:  # decodes only the crop window (libjpeg-turbo / nvJPEG ROI decode)
                images = fn.decoders.image_random_crop(
                    encoded,
                    random_area=list(self.area),
                    random_aspect_ratio=list(self.aspect),
                    **decode,
                )
                images = fn.resize(images, size=[size, size])
                mirror, crop = fn.random.coin_flip(probability=0.5), {}
            else:
                images = fn.decoders.image(encoded, **decode)
                images = fn.resize(images, resize_shorter=self.val_resize)
                mirror, crop = 0, dict(crop=[size, size], crop_pos_x=0.5, crop_pos_y=0.5)
            images = fn.crop_mirror_normalize(
                images,
                mirror=mirror,
                mean=mean,
                std=std,
                dtype=dtype,
                output_layout="HWC" if self.channels_last else "CHW",
                **crop,
            )
            return images, label

        pipe = pipeline()
        pipe.build()
        return pipe

    def __iter__(self):
        """One pipeline per pass, over this pass's file order; train seeds it by (seed, epoch, rank), so a
        resumed run draws the same crops as an uninterrupted one."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        batches = self.batches()[
            self.start :
        ]  # a resumed epoch: same files in the same order, crops redrawn
        if not batches:
            return
        order = torch.cat(batches).tolist()
        # DALI seeds are int32
        pipe = self._build(
            [self.images.files[i] for i in order],
            self.images.labels[order].tolist(),
            len(batches[0]),
            (self.augment_seed() + 7919 * self.start) % 2**31,
        )
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for k, batch in enumerate(batches):
            try:
                images, labels = pipe.run()
            except RuntimeError as err:  # DALI's pipeline is unusable after an operator error
                raise self._decode_error(err, batches[k : k + self.prefetch + 2]) from None
            dense = images.as_tensor()  # every sample has the same shape after the crop
            x = torch.empty(dense.shape(), dtype=self.dtype, device=self.device)
            feed_ndarray(dense, x, cuda_stream=stream)  # a copy: DALI reuses its output buffers
            y = torch.from_numpy(np.array(labels.as_tensor(), dtype=np.int64)).reshape(-1)
            x, y = x[: len(batch)], y[: len(batch)]  # drop pad_last_batch's copies
            if self.channels_last:  # NHWC in memory = NCHW with channels_last strides
                x = x.permute(0, 3, 1, 2)
            yield x, y.to(self.device, non_blocking=True)

    def _decode_error(self, err: RuntimeError, in_flight: list[torch.Tensor]) -> Exception:
        suspects = [self.images.files[i] for batch in in_flight for i in batch.tolist()]
        bad = [path for path in suspects if decode_error(path) is not None]  # name the culprit
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else "DALI decode failed"
        if bad:
            extra = f" (and {len(bad) - 1} more nearby)" if len(bad) > 1 else ""
            return CorruptImageError(corrupt_image_message(bad[0], f"DALI: {reason}") + extra)
        return RuntimeError(f"DALI pipeline failed on a batch holding {suspects[:3]}...: {err}")
