"""Which images each rank reads: one rule shared by every loader.

Training: each epoch draws one permutation of the data set from ``(seed,
epoch)``, cuts it into global batches, and rank ``r`` takes the ``r``-th slice
of every global batch, split into micro batches. A run therefore sees the same
global batches on any number of ranks, a resumed run sees the same images as an
uninterrupted one, and a batch-size ramp needs no new loader: each epoch's index
lists are cut again from the accumulation that ``start_epoch`` passes.

The last, incomplete global batch of an epoch (``data.last_batch``): ``drop``
leaves it out (N mod B images an epoch unseen: 4.3% of Fashion-MNIST at batch
4,096); ``fill`` completes it with the first images of the next epoch's
permutation and starts the next epoch after them (its ``offset``), so the
permutations are read as one stream cut into global batches: every image once
an epoch, an epoch of ceil((N - offset) / B) steps, and E epochs of any batch
size ``E x N`` images to within one batch. The offset of an epoch follows from
the batches of the epochs before it (:func:`epoch_offset`), so a ramp and a
resume need nothing kept.

Validation: contiguous, disjoint shards; every val image is evaluated exactly
once across ranks.

Polish (training images with the val transform, used by Final Polishing): one
fixed, seed-determined permutation that does not change between epochs (so the
first N images are a class-balanced sample even when files are sorted by
class), optionally cut to N images, cut into whole batches, and the batches
dealt to ranks in contiguous runs (see :func:`polish_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

MODES = ("train", "val", "polish")


@runtime_checkable
class Loader(Protocol):
    """What the trainer asks of a loader (tensor, DALI, torchvision, synthetic): an epoch's batches
    of (images, labels) on the device, from micro batch ``start``, with a batch-size ramp's
    accumulation, training augmentation and (data.last_batch=fill) the epoch's offset set at epoch
    starts; ``len()`` counts the epoch's micro batches on this rank."""

    def start_epoch(
        self,
        epoch: int,
        *,
        accumulation: int | None = None,
        start: int = 0,
        augment: bool | None = None,
        offset: int = 0,
    ) -> None: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class Output:
    """The tensors a loader yields: ``channels`` channels on ``device``, as ``dtype`` (a loader may
    narrow it: DALI gives float16 for FP16/BF16 training), NHWC-backed when ``channels_last``.
    The in-memory Fashion-MNIST loader yields float32 NCHW; the model's first layer converts."""

    channels: int = 1
    device: Any = "cpu"
    dtype: torch.dtype = torch.float32
    channels_last: bool = False


@dataclass(frozen=True)
class Shard:
    """Where this rank stands in the data-parallel world, and its batch sizes.

    Frozen: a batch-size ramp changes ``accumulation`` by handing each loader a
    new value in ``start_epoch``, never by editing a shared object.
    """

    rank: int = 0
    world: int = 1
    micro: int = 32  # images per forward on this rank
    accumulation: int = 1  # micro batches per optimizer step
    eval_batch: int = 1000  # images per eval forward on this rank
    seed: int = 0
    fill: bool = False  # data.last_batch=fill: an epoch's last batch taken from the next epoch's

    @property
    def global_batch(self) -> int:
        return self.micro * self.accumulation * self.world


def permutation(n: int, shard: Shard, epoch: int, shuffle: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(shard.seed * 100_003 + epoch)
    return torch.randperm(n, generator=g) if shuffle else torch.arange(n)


def epoch_steps(n: int, global_batch: int, fill: bool, offset: int = 0) -> int:
    """The optimizer steps of an epoch of ``n`` images at ``global_batch`` that starts ``offset``
    images into its permutation (data.last_batch=fill; 0 with drop)."""
    return -(-(n - offset) // global_batch) if fill else n // global_batch


def next_offset(n: int, global_batch: int, offset: int) -> int:
    """data.last_batch=fill: how far into the next epoch's permutation this epoch's last batch
    reads (0 when the epoch's images fill whole batches)."""
    return epoch_steps(n, global_batch, True, offset) * global_batch - (n - offset)


def epoch_offset(n: int, batches: list[int]) -> int:
    """data.last_batch=fill: where an epoch starts in its permutation, given the global batch of
    every epoch before it (a ramp's stages, or the noise ramp's switches)."""
    offset = 0
    for batch in batches:
        offset = next_offset(n, batch, offset)
    return offset


def steps_per_epoch(n: int, batches: list[int], fill: bool) -> list[int]:
    """The optimizer steps of each epoch, given each epoch's global batch."""
    steps, offset = [], 0
    for batch in batches:
        steps.append(epoch_steps(n, batch, fill, offset))
        offset = next_offset(n, batch, offset) if fill else 0
    return steps


def filled_from(n: int, shard: Shard, offset: int) -> int:
    """data.last_batch=fill: the position in the epoch's last global batch from which its images
    are the next epoch's (the global batch when none are)."""
    rest = (n - offset) % shard.global_batch
    return rest or shard.global_batch


def epoch_order(
    n: int, shard: Shard, epoch: int, shuffle: bool = True, offset: int = 0
) -> list[torch.Tensor]:
    """This rank's micro-batch index lists for one training epoch, ``offset`` images into its
    permutation (data.last_batch=fill; see the module's docstring)."""
    order = permutation(n, shard, epoch, shuffle)
    if shard.fill:
        order = order[offset:]
        short = -len(order) % shard.global_batch
        if short:
            order = torch.cat([order, permutation(n, shard, epoch + 1, shuffle)[:short]])
    elif offset:
        raise ValueError(
            f"offset {offset}: an epoch starts part-way only with data.last_batch=fill"
        )
    per_rank = shard.micro * shard.accumulation
    steps = len(order) // shard.global_batch
    out = []
    for s in range(steps):
        start = s * shard.global_batch + shard.rank * per_rank
        mine = order[start : start + per_rank]
        out.extend(mine.split(shard.micro))
    return out


def val_range(n: int, rank: int, world: int) -> range:
    """Contiguous, disjoint shard: the union over ranks is every index exactly once."""
    return range(rank * n // world, (rank + 1) * n // world)


def polish_batches(n: int, shard: Shard, limit: int = 0) -> list[torch.Tensor]:
    """This rank's batches of the polish set (``shard.eval_batch`` images each).

    The first ``limit`` (0 = all) images of a fixed permutation are cut into
    whole batches (a short last batch is dropped unless it is the only one)
    *before* the batches are dealt to ranks: every batch, hence every
    batch-normalised activation of a BN refit, is the same on any number of ranks.
    """
    g = torch.Generator().manual_seed(shard.seed * 100_003 + 99_991)
    order = torch.randperm(n, generator=g)[: limit or n]
    batches = list(order.split(shard.eval_batch)) if len(order) else []
    if len(batches) > 1 and len(batches[-1]) < shard.eval_batch:
        batches.pop()
    mine = val_range(len(batches), shard.rank, shard.world)
    return batches[mine.start : mine.stop]


def index_lists(
    n: int, shard: Shard, mode: str, epoch: int = 0, limit: int = 0, offset: int = 0
) -> list[torch.Tensor]:
    """This rank's batches of indices for ``mode`` (train | val | polish); a training epoch from
    ``offset`` images into its permutation (data.last_batch=fill)."""
    if mode == "train":
        return epoch_order(n, shard, epoch, offset=offset)
    if mode == "polish":
        return polish_batches(n, shard, limit)
    if mode != "val":
        raise ValueError(f"mode {mode!r}: use one of {MODES}")
    r = val_range(n, shard.rank, shard.world)
    idx = torch.arange(r.start, r.stop)
    # split() of an empty tensor gives [empty]
    return list(idx.split(shard.eval_batch)) if len(idx) else []


class ShardedBatches:
    """What every loader shares: the data set size, its shard and mode, the epoch, and the epoch's
    index batches (:func:`index_lists`); ``len()`` counts this rank's micro batches.

    The loop calls :meth:`start_epoch` once per loader per epoch; subclasses apply ``augment``
    in :meth:`_set_augment`.
    """

    def __init__(self, n: int, shard: Shard, mode: str, limit: int = 0):
        self.n, self.shard, self.mode, self.limit = n, shard, mode, limit
        self.epoch, self.start, self.offset = 0, 0, 0

    def start_epoch(
        self,
        epoch: int,
        *,
        accumulation: int | None = None,
        start: int = 0,
        augment: bool | None = None,
        offset: int = 0,
    ) -> None:
        """Iterate epoch ``epoch`` from micro batch ``start`` (a run resumed part-way through it; ``len()``
        still counts the whole epoch), cut into global batches of ``accumulation`` micro batches per rank
        (None: unchanged), with training augmentation on or off (None: unchanged), from ``offset``
        images into its permutation (data.last_batch=fill: :func:`epoch_offset`)."""
        self.epoch, self.start, self.offset = epoch, start, offset
        if accumulation is not None and accumulation != self.shard.accumulation:
            self.shard = replace(self.shard, accumulation=accumulation)
        if augment is not None:
            self._set_augment(augment)

    def _set_augment(self, augment: bool) -> None:
        pass

    def batches(self) -> list[torch.Tensor]:
        return index_lists(self.n, self.shard, self.mode, self.epoch, self.limit, self.offset)

    def __len__(self) -> int:
        return len(self.batches())

    def augment_seed(self, epoch: int | None = None) -> int:
        """The seed of an epoch's (default: this epoch's) random crops and flips on this rank: a
        resumed run redraws the same."""
        epoch = self.epoch if epoch is None else epoch
        return (self.shard.seed * 1_000_003 + epoch) * 1024 + self.shard.rank
