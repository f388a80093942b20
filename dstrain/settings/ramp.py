"""Batch-size control (Mikami et al.): the global batch as a pure function of the epoch.

``batch.global_size`` is the batch from epoch 0; ``batch.ramp`` lists later switches
as ``[epoch, global_size]`` pairs, e.g. ``[[5, 4096]]``. (A leading ``[0, B]`` entry
is accepted when ``B == batch.global_size``, so ``[[0, 1024], [5, 4096]]`` reads
as in the paper.)

The per-rank micro batch stays fixed for the whole run (``batch.micro_per_rank``,
or the first stage's per-rank batch) and a switch changes only the number of
accumulated micro batches. The data loaders therefore keep their batch shape (no
pipeline rebuild), and the trainer drives DeepSpeed's accumulation boundaries
itself, so the first step after a switch averages exactly the new global batch
(DeepSpeed's own micro-step counter would miscount it when the switch does not
line up with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dstrain.core.errors import ConfigError


@dataclass(frozen=True)
class BatchStage:
    epoch: int  # first epoch of the stage
    global_size: int  # images per optimizer step over all ranks
    micro: int  # images per forward on one rank
    accumulation: int  # micro batches per optimizer step
    # batch.noise_rewarm_epochs: the LR moves from that of batch ``lr_from`` to this stage's over
    # ``lr_ramp_epochs`` epochs from the stage's start (0: at once)
    lr_from: int = 0
    lr_ramp_epochs: float = 0.0

    def lr_batch(self, progress: float) -> float:
        """The batch whose LR (the scaling rule's) the step ending at ``progress`` (epochs) takes."""
        if not self.lr_ramp_epochs or progress >= self.epoch + self.lr_ramp_epochs:
            return self.global_size
        done = max(0.0, progress - self.epoch) / self.lr_ramp_epochs
        return self.lr_from + (self.global_size - self.lr_from) * done


def batch_arithmetic(global_size: int, micro_per_rank: int, world_size: int) -> tuple[int, int]:
    """Return (micro batch per rank, gradient accumulation steps) for a global batch.

    The single place where ``global = micro x accumulation x world`` is solved.
    """
    if global_size % world_size:
        raise ConfigError(
            f"batch.global_size={global_size} is not divisible by the world size {world_size}; "
            f"use a multiple of {world_size} (e.g. {max(world_size, global_size // world_size * world_size)})"
        )
    per_rank = global_size // world_size
    micro = micro_per_rank or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"batch.micro_per_rank={micro} does not divide the per-rank batch {per_rank} "
            f"(batch.global_size={global_size} / world size {world_size}); pick a divisor of {per_rank} or 0"
        )
    return micro, per_rank // micro


def batch_plan(
    global_size: int, micro_per_rank: int, ramp, world: int, epochs: int | None = None
) -> list[BatchStage]:
    """Validated stages, first at epoch 0. Raises ConfigError naming ``batch.ramp``."""
    switches = [list(s) for s in (ramp or [])]
    for i, s in enumerate(switches):
        if len(s) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in s):
            raise ConfigError(
                f"batch.ramp[{i}]={s}: each entry must be [epoch, global_size] with two integers"
            )
    if switches and switches[0][0] == 0:
        if switches[0][1] != global_size:
            raise ConfigError(
                f"batch.ramp[0]={switches[0]} disagrees with batch.global_size={global_size}; "
                "drop the epoch-0 entry or make them equal"
            )
        switches = switches[1:]
    stages = [(0, global_size)] + [tuple(s) for s in switches]
    for (e0, _), (e1, b1) in zip(stages, stages[1:]):
        if e1 <= e0:
            raise ConfigError(f"batch.ramp: epochs must increase strictly, got {e1} after {e0}")
        if b1 < 1:
            raise ConfigError(f"batch.ramp: global size {b1} at epoch {e1} must be >= 1")
    if epochs is not None and stages[-1][0] >= epochs:
        raise ConfigError(
            f"batch.ramp: a switch at epoch {stages[-1][0]} never happens with epochs={epochs}"
        )
    micro, _ = batch_arithmetic(global_size, micro_per_rank, world)
    out = []
    for epoch, size in stages:
        if size % (micro * world):
            raise ConfigError(
                f"batch.ramp: global size {size} at epoch {epoch} is not a multiple of micro batch "
                f"{micro} x {world} ranks = {micro * world}; the micro batch stays fixed during a ramp "
                "(set batch.micro_per_rank to a common divisor)"
            )
        out.append(BatchStage(epoch, size, micro, size // (micro * world)))
    return out


def batch_at(epoch: int, plan: list[BatchStage]) -> BatchStage:
    """The stage in force during ``epoch`` (0-based)."""
    current = plan[0]
    for stage in plan:
        if stage.epoch <= epoch:
            current = stage
    return current


def global_size_at(epoch: int, global_size: int, ramp) -> int:
    """The global batch of ``epoch`` (0-based) under ``batch.global_size`` and a valid ``batch.ramp``,
    without a world size (what a checkpoint's config recorded): :func:`batch_at`'s rule."""
    switches = [
        BatchStage(int(e), int(b), 1, 1) for e, b in sorted(map(tuple, ramp or [])) if e > 0
    ]
    return batch_at(epoch, [BatchStage(0, global_size, 1, 1), *switches]).global_size


def grown(stage: BatchStage, factor: float, cap: int, world: int) -> int | None:
    """batch.follow_noise: the global batch after ``stage``'s at a switch, ``factor`` times it
    rounded down to whole micro batches on every rank and at most ``cap``; None when it cannot grow."""
    unit = stage.micro * world
    size = min(int(stage.global_size * factor), cap) // unit * unit
    return size if size > stage.global_size else None
