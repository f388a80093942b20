"""Rank-0 monitoring: TensorBoard scalars and a concise console line."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("dstrain")


class Monitor:
    """Writes nothing on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def step(self, *, epoch: int, epochs: int, step: int, step_in_epoch: int, steps_per_epoch: int, loss: float,
             lr: float, global_batch: int, images_per_sec: float, loss_scale: float | None,
             comm_bytes: float | None = None, skipped: int | None = None) -> None:
        if not self.enabled:
            return
        self.scalars("train", {"loss": loss, "lr": lr, "global_batch": global_batch,
                               "images_per_sec": images_per_sec, "loss_scale": loss_scale,
                               "comm_bytes_per_step": comm_bytes, "skipped_steps": skipped}, step)
        scale = f" scale {loss_scale:g}" if loss_scale is not None else ""
        scale += f" skipped {skipped}" if skipped else ""
        sent = f"  sent {comm_bytes / 2**20:.2f} MiB/step" if comm_bytes is not None else ""
        log.info("epoch %d/%d step %d/%d  loss %.4f  lr %.4g  batch %d  %.0f img/s%s%s", epoch + 1, epochs,
                 step_in_epoch, steps_per_epoch, loss, lr, global_batch, images_per_sec, scale, sent)

    def epoch(self, epoch: int, epochs: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.scalars("epoch", metrics, epoch + 1)
        parts = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        log.info("epoch %d/%d done: %s", epoch + 1, epochs, "  ".join(parts))
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
