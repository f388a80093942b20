"""NVIDIA DALI pipelines over an image folder: decode on the GPU (``mixed``) when there is one, on the CPU otherwise.

One pipeline per loader (two chained for augmentation, below), built at its first pass and kept:
every later pass (each epoch, each evaluation) feeds the same pipeline its files, so a pass pays no
pipeline build, no decoder or memory set-up and no prefetch ramp (a pipeline built per pass ran at
0.18x a plain DALI pipeline on an H100 at 25 batches an epoch, issue 17). DALI works ``prefetch``
batches ahead, across the end of a pass into the pass the loader predicts next (see
:class:`_Stream`), and a new batch is scheduled as soon as one is handed out.

Which files a rank reads, and in what order, comes from :mod:`dstrain.data.sharding` (the same
global batches on any number of ranks, reshuffled from (seed, epoch), the batch-size ramp); the
pipeline takes them through ``fn.external_source``: each batch is this rank's file paths, which
DALI's own threads read (``fn.io.file.read``), decode, crop, resize and normalise. DALI's file
reader could not follow our order (it shuffles from a buffer and shards contiguous ranges), and a
reader fed a new list would mean a new pipeline.

Random-resized crops and flips are drawn by dstrain, not by DALI's generator: for every sample,
from (seed, epoch, rank, batch index), ``CROP_ATTEMPTS`` candidate (area, aspect ratio) pairs and
a position and a coin. The first candidate that fits the image is decoded as a region of interest;
when none fits, the centred crop of the whole image with its aspect ratio clamped to the range
(torchvision's ``RandomResizedCrop`` rule). So a resumed run, even from the middle of an epoch,
draws exactly the crops an uninterrupted one draws, and the pipeline holds no random state across
passes. Which candidate fits depends on the image's size, which only its header says, so an
augmenting loader runs two pipelines (:class:`_Chain`): the first reads each file and peeks its
size (``fn.peek_image_shape``), the host picks the windows (:func:`crop_window`, NumPy, a batch at
once), the second decodes them. Choosing inside one pipeline took ~30 operators a batch, each a
scheduling round: DaliLoader ran at 0.38x a plain DALI pipeline on an H200 with ``mixed`` decode.

Pipelines
  train  random-resized-crop (area / aspect-ratio ranges) decoded as a region of interest, resize to
         ``image_size``, random horizontal flip, normalise.
  val    decode, resize the shorter side to ``val_resize``, center crop ``image_size``, normalise.
         Also used for train mode with ``start_epoch(..., augment=False)`` and for the polish set.
Output: NCHW, or NHWC viewed as channels_last NCHW; float16 for FP16 and BF16 training (half the
bytes of float32; the trainer casts to bfloat16 on the device, DALI has no bfloat16), else float32.
Batches are DALI's own buffers handed over by DLPack (no copy): DALI's dynamic executor keeps a
buffer alive while a tensor references it.

GPU settings (``data`` section): ``hw_decoder_load`` (the share of JPEGs given to the hardware
decoder of A100/H100-class GPUs), ``num_workers`` (DALI CPU threads per rank), ``prefetch``
(batches prepared ahead); docs/data.md gives their measured effects.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from dstrain.data.images import (
    GRAY_MEAN,
    GRAY_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    CorruptImageError,
    ImageList,
    corrupt_image_message,
    decode_error,
)
from dstrain.data.sharding import Output, Shard, ShardedBatches, index_lists, next_offset
from dstrain.settings.config import DataConfig

log = logging.getLogger(__name__)

CROP_ATTEMPTS = 10  # candidate crops per sample, as torchvision's RandomResizedCrop and DALI try
NO_FIT = 1e6  # the score of a candidate that does not fit (any score below it is a fitting one)
# nvJPEG's buffers, sized once for ImageNet-class images so they are not grown batch by batch
# (the values of DALI's ResNet-50 example)
DEVICE_MEMORY_PADDING, HOST_MEMORY_PADDING = 211_025_920, 140_544_512


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loader's output dtype for a training input dtype: float16 serves FP16 and BF16 training
    (DALI has no bfloat16; the cast on the device is cheap), float32 anything else."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


def crop_draws(seed: int, n: int, area, aspect) -> dict[str, np.ndarray]:
    """The random draws of ``n`` random-resized crops and flips, as the pipeline takes them.

    Per sample, ``CROP_ATTEMPTS`` candidates of area fraction s ~ U(area) and aspect ratio
    r ~ logU(aspect). On a W x H image a candidate is sqrt(s r W H) x sqrt(s W H / r) pixels, so
    it fits iff ``lo`` = s r <= q <= r / s = ``hi`` (q = W / H), and its size relative to the image
    is sqrt(a / q) x sqrt(q / b) with a = s r, b = r / s; its position is (u, v) of the room left.
    One more candidate, last, always fits: torchvision's fallback, the whole image with its aspect
    ratio clamped to the range, centred (a, b = 1e6, 1e-6: the pipeline's clamps to
    min(1, aspect max / q) x min(1, q / aspect min) give its size; they never cut a fitting
    candidate). Then the flip coin."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(area[0], area[1], (n, CROP_ATTEMPTS))
    r = np.exp(rng.uniform(math.log(aspect[0]), math.log(aspect[1]), (n, CROP_ATTEMPTS)))
    u, v = rng.uniform(size=(2, n, 1))
    flip = rng.uniform(size=n) < 0.5

    def last(values: np.ndarray, fallback: float) -> np.ndarray:
        full = np.concatenate([values, np.full((n, 1), fallback)], 1)
        return np.ascontiguousarray(full, dtype=np.float32)

    return {
        "attempt": np.ascontiguousarray(
            np.broadcast_to(np.arange(CROP_ATTEMPTS + 1, dtype=np.float32), (n, CROP_ATTEMPTS + 1))
        ),
        "lo": last(s * r, 0.0),
        "hi": last(r / s, np.inf),
        "a": last(s * r, 1e6),
        "b": last(r / s, 1e-6),
        "u": last(np.repeat(u, CROP_ATTEMPTS, 1), 0.5),
        "v": last(np.repeat(v, CROP_ATTEMPTS, 1), 0.5),
        "flip": flip.astype(np.int32),
    }


def crop_window(q: np.ndarray, draws: dict[str, np.ndarray], aspect) -> np.ndarray:
    """The crops (x, y, w, h), relative to the image, that the decode pipeline decodes for images
    of aspect ratios ``q`` (their headers' width / height): computed on the host for a whole batch
    (:class:`_Windows`); the geometry test checks decoded pixels against it."""
    q = q[:, None]
    score = draws["attempt"] + ((draws["lo"] > q) | (q > draws["hi"])) * NO_FIT
    chosen = score == score.min(1, keepdims=True)

    def pick(name: str) -> np.ndarray:
        return (draws[name] * chosen).sum(1, keepdims=True)

    w = np.minimum(np.minimum(1.0, aspect[1] / q), np.sqrt(pick("a") / q))
    h = np.minimum(np.minimum(1.0, q / aspect[0]), np.sqrt(q / pick("b")))
    return np.concatenate([pick("u") * (1 - w), pick("v") * (1 - h), w, h], 1)


@dataclass
class _Pass:
    """One pass (an epoch, an evaluation) as the pipeline's feed hands it over, batch by batch."""

    key: tuple  # what decides its batches: (epoch, start, accumulation, augment, offset)
    size: int  # its batches
    # (batch indices, what the feed hands DALI for it, its crop draws or None), made as fed
    items: Iterator
    claimed: bool = False  # a consumer iterates it (False: fed ahead, on a prediction)


class _Stream:
    """The pipeline's ``external_source``: an endless stream of batches, pass after pass.

    DALI runs ``prefetch`` batches ahead of the consumer; at the end of a pass the stream goes on
    with the pass the loader predicts next (the next epoch in the same order rules; the same
    evaluation again), so the pipeline is never idle between passes and needs no reset. A pass
    that turns out different (a ramp step, a resume, a pass broken off) starts its own batches at
    once; the few batches fed ahead on the wrong prediction are run and dropped (``fed`` says
    which pass each batch in flight belongs to)."""

    def __init__(self, predict: Callable[[_Pass], _Pass]):
        # weak: the loader owns the pipeline that owns this stream; a strong reference back would
        # keep a dropped loader's pipeline (and its busy threads) alive until the garbage collector
        self.predict = weakref.WeakMethod(predict)
        self.current: _Pass | None = None
        self.scheduled = False  # the pipeline's queue has been filled (its first schedule_run)
        self.fed: deque[tuple[_Pass, torch.Tensor]] = deque()
        # the crop draws of the batches fed, in order (read by an augmenting chain's _Windows)
        self.draws: deque[dict[str, np.ndarray]] = deque()

    def start(self, new: _Pass) -> _Pass:
        """The pass a consumer iterates: the one fed ahead if it is the same, else ``new``."""
        if self.current is not None and not self.current.claimed and self.current.key == new.key:
            new = self.current
        self.current, new.claimed = new, True
        return new

    def __call__(self):
        while True:
            item = next(self.current.items, None)
            if item is not None:
                batch, inputs, draws = item
                self.fed.append((self.current, batch))
                if draws is not None:
                    self.draws.append(draws)
                return inputs
            self.current = self.predict()(self.current)


class _Windows:
    """The decode pipeline's ``external_source``: the peek pipeline's next batch (the encoded files
    and their sizes), with the crop windows and flips the host picks for it.

    The decode pipeline copies what it is fed (``no_copy`` off), so the peek pipeline's batch is
    released at the next call and one more peek scheduled in its place."""

    def __init__(self, peek, stream: _Stream, aspect):
        self.peek, self.stream, self.aspect = peek, stream, aspect
        self.held = False  # a peek batch is shared out (released at the next call)

    def __call__(self):
        if self.held:
            self.peek.release_outputs()
            self.peek.schedule_run()
        encoded, shape = self.peek.share_outputs()
        self.held = True
        hw = np.asarray(shape.as_array())  # H, W, C of each image (as its decoder will orient it)
        draws = self.stream.draws.popleft()
        window = crop_window(hw[:, 1] / hw[:, 0], draws, self.aspect)
        return (
            encoded,
            np.ascontiguousarray(window[:, :2]),
            np.ascontiguousarray(window[:, 2:]),
            draws["flip"],
        )


class _Chain:
    """An augmenting loader's two pipelines as one: ``peek`` reads the files and their sizes,
    ``decode`` decodes the windows :class:`_Windows` picks. The loader talks to ``decode``; the
    first schedule fills ``peek``'s queue first."""

    def __init__(self, decode, peek):
        self.decode, self.peek, self.started = decode, peek, False
        self.exec_dynamic = decode.exec_dynamic

    def share_outputs(self):
        return self.decode.share_outputs()

    def release_outputs(self) -> None:
        self.decode.release_outputs()

    def schedule_run(self) -> None:
        if not self.started:
            self.peek.schedule_run()
            self.started = True
        self.decode.schedule_run()

    def _shutdown(self) -> None:
        try:
            _shutdown(self.decode)  # first: its feed reads peek
        finally:
            _shutdown(self.peek)


def _shutdown(pipe) -> None:
    """Stop a DALI pipeline's threads now (DALI's own teardown, its ``__del__``)."""
    shutdown = getattr(pipe, "_shutdown", None)
    if shutdown is not None:
        shutdown()


class DaliLoader(ShardedBatches):
    """One split of an image folder through DALI; iteration yields (images, labels) on ``device``."""

    exec_dynamic: bool | None = None  # DALI's executor: None = its default (dynamic since 2.0)

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
        """``cfg`` (the ``data`` section) gives sizes, crop ranges, threads, prefetch and the
        hardware-decoder share."""
        super().__init__(len(images), shard, mode, limit)
        self.images = images
        self.augment = augment and mode == "train"
        self.image_size, self.val_resize = cfg.image_size, cfg.val_resize
        self.area, self.aspect = tuple(cfg.random_area), tuple(cfg.random_aspect_ratio)
        self.channels, self.channels_last = out.channels, out.channels_last
        self.num_threads, self.prefetch = max(1, cfg.num_workers), max(1, cfg.prefetch)
        self.hw_decoder_load = cfg.hw_decoder_load
        self.device = torch.device(out.device)
        self.dtype = output_dtype(out.dtype)
        self._pipe = None  # (pipeline, stream, augment) once built; None after a failed pass
        self.builds = 0  # pipelines built by this loader (the tests and bench/loader.py read it)

    def _set_augment(self, augment: bool) -> None:
        self.augment = augment and self.mode == "train"

    def _build(self, augment: bool):
        """The pipeline (and its feed) for one transform; the feed decides the files of each pass.
        With ``augment``, the two pipelines of :class:`_Chain`."""
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device.type == "cuda"
        rgb = self.channels == 3
        mean = [m * 255 for m in (IMAGENET_MEAN if rgb else GRAY_MEAN * self.channels)]
        std = [s * 255 for s in (IMAGENET_STD if rgb else GRAY_STD * self.channels)]
        size, out_type = (
            self.image_size,
            (types.FLOAT16 if self.dtype == torch.float16 else types.FLOAT),
        )
        decode = dict(
            device="mixed" if gpu else "cpu", output_type=types.RGB if rgb else types.GRAY
        )
        if gpu:
            decode.update(
                hw_decoder_load=self.hw_decoder_load,
                device_memory_padding=DEVICE_MEMORY_PADDING,
                host_memory_padding=HOST_MEMORY_PADDING,
            )
        feed = _Stream(self._predict)
        t0 = time.perf_counter()
        from_shards = self.images.store is not None  # the feed hands over the bytes themselves
        settings = dict(
            batch_size=self._max_batch(),
            num_threads=self.num_threads,
            prefetch_queue_depth=self.prefetch,
            device_id=(self.device.index or 0) if gpu else None,
            seed=self.shard.seed,  # nothing random is drawn in the pipelines; for completeness
            exec_dynamic=self.exec_dynamic,
        )

        def encoded_of(paths):
            return paths if from_shards else fn.io.file.read(paths)

        def normalised(images, mirror, **crop):
            return fn.crop_mirror_normalize(
                images,
                mirror=mirror,
                mean=mean,
                std=std,
                dtype=out_type,
                output_layout="HWC" if self.channels_last else "CHW",
                **crop,
            )

        if not augment:

            @pipeline_def(**settings)
            def pipeline():
                (paths,) = fn.external_source(source=feed, num_outputs=1)
                images = fn.decoders.image(encoded_of(paths), **decode)
                images = fn.resize(images, resize_shorter=self.val_resize)
                return normalised(images, 0, crop=[size, size], crop_pos_x=0.5, crop_pos_y=0.5)

            pipe = pipeline()
            pipe.build()
        else:
            # CPU only: files and headers. One batch deeper than decode's queue: decode's feed
            # holds one peek batch while the next ones are read, so reading stays ahead of
            # training even at data.prefetch=1
            @pipeline_def(
                **{**settings, "device_id": None, "prefetch_queue_depth": self.prefetch + 1}
            )
            def peek_pipeline():
                (paths,) = fn.external_source(source=feed, num_outputs=1)
                encoded = encoded_of(paths)
                return encoded, fn.peek_image_shape(encoded, dtype=types.FLOAT)

            peek = peek_pipeline()
            peek.build()

            @pipeline_def(**settings)
            def decode_pipeline():
                encoded, anchor, extent, mirror = fn.external_source(
                    source=_Windows(peek, feed, self.aspect), num_outputs=4
                )
                # a region-of-interest decode: only the crop window is decoded
                images = fn.decoders.image_slice(encoded, anchor, extent, **decode)
                return normalised(fn.resize(images, size=[size, size]), mirror)

            try:
                pipe = decode_pipeline()
                pipe.build()
            except BaseException:
                _shutdown(peek)  # not left to the garbage collector with its threads
                raise
            pipe = _Chain(pipe, peek)
        self.builds += 1
        log.debug(
            "DALI %s pipeline (%s) built in %.2f s",
            self.mode,
            "augment" if augment else "no augmentation",
            time.perf_counter() - t0,
        )
        return pipe, feed

    def _max_batch(self) -> int:
        return self.shard.micro if self.mode == "train" else self.shard.eval_batch

    def _pass(
        self, epoch: int, start: int, accumulation: int, augment: bool, offset: int = 0
    ) -> _Pass:
        shard = replace(self.shard, accumulation=accumulation)
        batches = index_lists(self.n, shard, self.mode, epoch, self.limit, offset)[start:]
        draws = (self.augment_seed(epoch), self.area, self.aspect) if augment else None
        items = feed_items(self.images, batches, start, draws)
        return _Pass((epoch, start, accumulation, augment, offset), len(batches), items)

    def _predict(self, done: _Pass) -> _Pass:
        """The pass after ``done``: a training loader's next epoch from its start; an evaluation
        (val, polish) again."""
        epoch, _, accumulation, augment, offset = done.key
        if self.mode != "train":
            return self._pass(epoch, 0, accumulation, augment)
        global_batch = replace(self.shard, accumulation=accumulation).global_batch
        after = next_offset(self.n, global_batch, offset) if self.shard.fill else 0
        return self._pass(epoch + 1, 0, accumulation, augment, after)

    def close(self) -> None:
        """Stop the pipeline's threads now (they run ahead between passes). DALI's pipeline holds
        reference cycles, so dropping it alone would leave its threads to the garbage collector;
        a process that forks (a DataLoader's workers) must not do so while they work. Batches
        already handed out stay valid. The next pass builds a new pipeline."""
        if self._pipe is not None:
            pipe, self._pipe = self._pipe[0], None
            _shutdown(pipe)

    def __del__(self):
        self.close()

    def _pipeline(self, augment: bool):
        """The kept pipeline for this transform: built on first use, or when the transform
        changed or the last pass failed."""
        if self._pipe is not None and self._pipe[2] != augment:
            self.close()
        if self._pipe is None:
            pipe, stream = self._build(augment)
            self._pipe = (pipe, stream, augment)
        return self._pipe[:2]

    @staticmethod
    def _next_output(pipe):
        """The oldest batch in flight, and one more batch scheduled in its place: DALI keeps
        ``prefetch`` batches in the works while the trainer uses this one (``Pipeline.run`` would
        schedule only when asked for the next, leaving one fewer in flight during a step)."""
        (images,) = pipe.share_outputs()
        x = images.as_tensor()  # every sample has the same shape after the crop
        x = torch.from_dlpack(x) if pipe.exec_dynamic else _copy(x)
        pipe.release_outputs()  # under the dynamic executor the tensor keeps its buffer
        pipe.schedule_run()
        return x

    def __iter__(self):
        """This pass's batches from the kept pipeline (see :class:`_Stream`)."""
        epoch = self.epoch if self.mode == "train" else 0
        new = self._pass(epoch, self.start, self.shard.accumulation, self.augment, self.offset)
        if not new.size:
            return
        pipe, stream = self._pipeline(self.augment)
        mine = stream.start(new)
        todo = mine.size
        while todo:
            try:
                with (
                    torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
                ):
                    # a new pipeline: fill its queue (later passes find theirs in flight)
                    if not stream.scheduled:
                        pipe.schedule_run()
                        stream.scheduled = True
                    images = self._next_output(pipe)
            except RuntimeError as err:  # DALI's pipeline is unusable after an operator error
                self.close()
                raise self._decode_error(err, [batch for _, batch in stream.fed]) from None
            except BaseException:  # raised by the feed's own code: its batches are out of step
                self.close()
                raise
            owner, batch = stream.fed.popleft()
            if owner is mine:  # else fed ahead for a pass that did not come: dropped
                todo -= 1
                yield self._tensor(images), batch_labels(self.images, batch, self.device)

    def _tensor(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 3, 1, 2) if self.channels_last else x  # NHWC = channels_last NCHW

    def _decode_error(self, err: RuntimeError, in_flight: list[torch.Tensor]) -> Exception:
        """The error to show: the undecodable file among the batches in flight and why it does not
        decode (PIL's reason, with DALI's own decode line when it gave one: its last line is often
        only "Current pipeline object is no longer valid")."""
        images = self.images
        suspects = list(dict.fromkeys(i for b in in_flight for i in b.tolist()))
        bad = [
            (images.files[i], why)
            for i in suspects
            if (why := decode_error(images.source(i))) is not None
        ]
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        dali = next((line for line in lines if "decod" in line.lower()), None)
        if bad:
            path, why = bad[0]
            extra = f" (and {len(bad) - 1} more nearby)" if len(bad) > 1 else ""
            reason = why + (f"; DALI: {dali}" if dali else "")
            return CorruptImageError(corrupt_image_message(path, reason) + extra)
        names = [images.files[i] for i in suspects[:3]]
        return RuntimeError(f"DALI pipeline failed on a batch holding {names}...: {err}")


def _copy(dense) -> torch.Tensor:
    """A batch copied out of DALI's buffer: without the dynamic executor DALI reuses its buffers."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type
    from nvidia.dali.tensors import TensorGPU

    gpu = isinstance(dense, TensorGPU)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else "cpu"
    x = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device=device)
    return feed_ndarray(dense, x, cuda_stream=torch.cuda.current_stream() if gpu else None)


def feed_items(images: ImageList, batches: list[torch.Tensor], first: int, draws: tuple | None):
    """What the feed hands DALI for each batch: the paths (one NUL-padded array), or for shards the
    encoded images themselves, and with ``draws`` = (the epoch's seed, area, aspect) the batch's
    crop draws, seeded by (that seed, the batch's index in the epoch). A plain function: the
    pipeline's stream holds it, and a reference back to the loader would keep the loader, and the
    pipeline's threads, alive."""
    files, store = images.files, images.store
    for k, batch in enumerate(batches, start=first):
        idx = batch.tolist()
        if store is None:
            paths = path_rows([files[i] for i in idx])
        else:
            paths = [np.frombuffer(store.read(i), np.uint8) for i in idx]
        if draws is None:
            yield batch, (paths,), None
            continue
        seed, area, aspect = draws
        yield batch, (paths,), crop_draws(seed * 1_000_003 + k, len(idx), area, aspect)


def path_rows(paths: list[str]) -> np.ndarray:
    """A batch's file paths as one uint8 array, a row a path, NUL-padded to the longest.

    DALI takes one dense array in one call; a list of per-sample arrays costs it a Python loop over
    the samples (type checks and a tensor each, ~20 us a sample) on the training thread, where a
    GPU-fed pipeline has no time to spare. ``fn.io.file.read`` opens the path up to its first NUL."""
    encoded = [os.fsencode(p) for p in paths]  # the bytes the file system has (any encoding)
    width = max(map(len, encoded))
    joined = b"".join(e.ljust(width, b"\0") for e in encoded)
    return np.frombuffer(joined, np.uint8).reshape(len(encoded), width)


def batch_labels(images: ImageList, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The labels of a batch, from the file list (DALI carries only the pixels)."""
    y = torch.from_numpy(images.labels[batch.numpy()])
    return y.to(device, non_blocking=True) if device.type == "cuda" else y
