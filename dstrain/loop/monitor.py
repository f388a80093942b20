"""Monitoring: the per-epoch step meter, TensorBoard scalars and the console line (rank 0); the log
lines' set-up is dstrain/core/logs.py (no torch: a config error is reported without importing it)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.loop.evaluate import accumulate_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """Where a log line stands: epoch e of E, optimizer step s of S in the epoch (1-based for display)."""

    epoch: int  # 0-based
    epochs: int
    step_in_epoch: int
    steps_per_epoch: int

    def __str__(self) -> str:
        return (
            f"epoch {self.epoch + 1}/{self.epochs} step {self.step_in_epoch}/{self.steps_per_epoch}"
        )


class StepMeter:
    """One epoch's training metrics on this rank: the epoch's sums and the current log window.

    Everything stays on the device until :meth:`take_window` (one host sync per log window) and
    :meth:`epoch_totals` (one all-reduce per epoch).
    """

    def __init__(self, device: torch.device, every_steps: int, carried: list[float] | None = None):
        self.every_steps = every_steps
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss*n, top1, top5, n
        # a resumed epoch: the part done before the stop, summed over ranks
        if carried and dist.is_main():
            self.sums += torch.tensor(carried, dtype=torch.float64, device=device)
        self.window_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.window_steps, self.window_t0 = 0, time.perf_counter()

    def add_micro_batch(
        self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, accumulation: int
    ) -> None:
        accumulate_metrics(self.sums, loss.detach(), logits.detach(), y)
        self.window_loss += loss.detach().double() / accumulation

    def end_step(self) -> bool:
        """Count an optimizer step; True when the log window is full."""
        self.window_steps += 1
        return self.window_steps == self.every_steps

    def take_window(self) -> tuple[float, int, float]:
        """(mean loss, steps, seconds) of the window since the last call, and start a new one."""
        loss = self.window_loss.item() / max(self.window_steps, 1)  # host sync
        steps, seconds = self.window_steps, time.perf_counter() - self.window_t0
        self.window_loss.zero_()
        self.window_steps, self.window_t0 = 0, time.perf_counter()
        return loss, steps, seconds

    def epoch_totals(self) -> list[float]:
        """(loss*n, top-1 hits, top-5 hits, n) over every rank (a collective: every rank calls it)."""
        return dist.all_reduce_sum(self.sums).tolist()  # host sync, once per epoch

    @staticmethod
    def epoch_metrics(totals: list[float]) -> dict:
        loss_sum, top1, top5, n = totals
        n = max(n, 1.0)
        return {"train_loss": loss_sum / n, "train_top1": top1 / n, "train_top5": top5 / n}


class Monitor:
    """TensorBoard scalars and console lines, and the same scalars to the experiment trackers
    (``sinks``: dstrain/loop/tracking.py); writes nothing on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, sinks=()):
        self.enabled = enabled
        self.writer = None
        self.sinks = list(sinks) if enabled else []
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
            log.info("TensorBoard: tensorboard --logdir %s", run_dir / "tb")

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        if self.writer is not None:
            for key, value in values.items():
                if value is not None:
                    self.writer.add_scalar(f"{prefix}/{key}", value, step)
        if not self.sinks:
            return
        named = {
            f"{prefix}/{k}": v
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if named:
            for sink in self.sinks:
                sink.scalars(named, step)

    def step(self, step: int, progress: Progress, values: dict) -> None:
        """``train/*`` scalars at global step ``step`` and one console line.

        ``values``: loss, lr, global_batch, images_per_sec, and where known loss_scale,
        comm_bytes_per_step (bytes), skipped_steps, trust_min/median/max (LARS), noise_scale and
        its parts (log.noise_scale)."""
        if not self.enabled:
            return
        self.scalars("train", values, step)
        line = (
            f"{progress}  loss {values['loss']:.4f}  lr {values['lr']:.4g}  batch {values['global_batch']}  "
            f"{values['images_per_sec']:.0f} img/s"
        )
        if values.get("loss_scale") is not None:
            line += f" scale {values['loss_scale']:g}"
        if values.get("skipped_steps"):
            line += f" skipped {values['skipped_steps']}"
        if values.get("comm_bytes_per_step") is not None:
            line += f"  sent {values['comm_bytes_per_step'] / 2**20:.2f} MiB/step"
        if values.get("noise_scale") is not None:  # with McCandlish's B/B_noise: E = E_min(1 + it)
            ratio = values["global_batch"] / values["noise_scale"]
            line += f"  B_noise {values['noise_scale']:.4g} (batch/B_noise {ratio:.3g})"
        if values.get("trust_median") is not None:
            line += (
                f"  trust {values['trust_min']:.3g}/{values['trust_median']:.3g}/"
                f"{values['trust_max']:.3g}"
            )
        log.info("%s", line)

    def note(self, line: str) -> None:
        """One console line (rank 0)."""
        if self.enabled:
            log.info("%s", line)

    def epoch(self, epoch: int, epochs: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.scalars("epoch", metrics, epoch + 1)
        parts = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        log.info("epoch %d/%d done: %s", epoch + 1, epochs, "  ".join(parts))
        if self.writer is not None:
            self.writer.flush()

    def finish(self, summary: dict) -> None:
        """The run's summary.json to the trackers, which end their runs as finished."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(summary)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.finish_unfinished()

    def finish_unfinished(self) -> None:
        """A run that ended before its summary: the trackers' runs end as killed."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close(None)
            except Exception as err:  # a tracker's failure must not hide how the run ended
                log.warning("tracking: %s could not close: %s", type(sink).__name__, err)
