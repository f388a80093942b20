"""The training run: set-up, the epoch loop, evaluation, checkpoints, summary.

Read top to bottom: :func:`run` builds everything from the config sections and
then loops over epochs calling :func:`train_epoch`, :func:`sync_bn_buffers`,
:func:`evaluate` and :func:`checkpoint.save` explicitly.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dstrain import checkpoint, comm, dist, ds_config, guard, polish
from dstrain.config import ConfigError, OptimConfig, TrainConfig, validate
from dstrain.data import Shard, build_data
from dstrain.losses import smoothed_cross_entropy
from dstrain.models import build_model, has_batchnorm
from dstrain.monitor import Monitor
from dstrain.optim import apply_schedule, build_optimizer, steps_suppressed
from dstrain.polish import augment_at
from dstrain.ramp import BatchStage, batch_at, batch_plan
from dstrain.schedule import lr_at, scaled_lr

log = logging.getLogger("dstrain")
REPO_ROOT = Path(__file__).resolve().parent.parent
FAULT_ENV = "DSTRAIN_FAULT_KILL_AT_STEP"  # tests: SIGKILL this process after that optimizer step


@dataclass
class TrainState:
    """What the trainer adds to DeepSpeed's checkpoint (client_state)."""
    epoch: int = 0              # completed epochs
    step: int = 0               # completed optimizer steps
    best_top1: float = 0.0
    train_time_s: float = 0.0   # wall time spent in completed epochs (train + eval)
    train_images: int = 0       # images consumed by completed epochs
    history: list = field(default_factory=list)
    epoch_step: int = 0         # optimizer steps done in the unfinished epoch (a stop part-way through it)
    epoch_sums: list = field(default_factory=list)  # its (loss*n, top1, top5, n) over all ranks
    epoch_elapsed_s: float = 0.0                    # and its wall time so far


@dataclass
class Watch:
    """What the loop checks after every optimizer step (dstrain/guard.py)."""
    signals: guard.StopSignals
    nonfinite: guard.NonFiniteWatch
    skips: guard.SkipCounter
    last_checkpoint: Path | None = None
    _pending: tuple | None = None  # the stop-flag all-reduce started at the previous call

    def stop_requested(self) -> str:
        """The signal any rank had received by the previous call, agreed over ranks, or ''.

        Multi-rank: each call waits for the tiny CPU all-reduce the previous call started (long done by
        then: it ran during a whole step) and starts the next one, so agreeing costs no step a wait; every
        rank stops after the same step, one step after the signal."""
        if dist.world_size() == 1:
            return self.signals.name
        agreed = self.drain()
        self._pending = dist.host_all_reduce_async([float(self.signals.signum)], "max")
        return agreed

    def drain(self) -> str:
        """Finish the outstanding stop-flag all-reduce (every rank has one); the signal it agreed on, or ''."""
        signum = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            signum, self._pending = int(flag.item()), None
        return guard.signal_name(signum)

    def stop_requested_now(self) -> str:
        """Agree on the signals received until now (a blocking all-reduce: once per epoch, at its end)."""
        if dist.world_size() == 1:
            return self.signals.name
        earlier = self.drain()
        signum = int(dist.host_all_reduce([float(self.signals.signum)], "max")[0])
        return earlier or guard.signal_name(signum)

    def check_finite(self, step: int, epoch: int, module: torch.nn.Module | None = None) -> None:
        """Raise Diverged if any rank saw a NaN/inf loss (or, with ``module``, holds non-finite weights)."""
        bad = self.nonfinite.first_bad_step(dist.all_reduce_min)
        if bad is not None:
            raise guard.Diverged(guard.divergence_message("non-finite loss (NaN/inf)", bad, epoch,
                                                          self.last_checkpoint))
        if module is not None and dist.host_all_reduce([0.0 if guard.params_finite(module) else 1.0], "max")[0]:
            raise guard.Diverged(guard.divergence_message("non-finite weights", step, epoch, self.last_checkpoint))


# ---------------------------------------------------------------- set-up helpers
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        # benchmark and evidence result files are outputs, not code: rewriting one does not make the tree dirty
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no",
                                "--", ".", ":(exclude)bench/results", ":(exclude)docs/results"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def choose_run_dir(cfg: TrainConfig) -> Path:
    """The run directory (named on rank 0); never reuse one silently. Creates nothing."""
    path = cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(dist.broadcast_object(path))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir={str(path)!r} is a file; choose a directory")
    if path.exists() and any(path.iterdir()):
        if cfg.resume != "auto":
            raise ConfigError(f"run_dir={str(path)!r} already holds a run. Pass resume=auto to continue it, "
                              "or choose a new run_dir=...")
        if not (path / "meta.json").is_file() and not (path / "checkpoints").is_dir():
            raise ConfigError(f"run_dir={str(path)!r} is not empty and is not a dstrain run (no meta.json, no "
                              "checkpoints/); resume=auto only continues dstrain runs. Choose a new run_dir")
    return path


def checkpoint_bytes(model: torch.nn.Module, precision: str) -> int:
    """A generous estimate of one checkpoint: FP32 weights, two optimizer state slots, an FP32 master copy
    with FP16/BF16 engines, the buffers."""
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params * (4 if precision in ("fp16", "bf16") else 3) + buffers


def make_run_dir(path: Path, checkpoint_size: int = 0) -> None:
    """Create the run directory and check it is writable with room for two checkpoints (the previous one
    stays until the next is complete), before training starts. A failure removes what it created."""
    error = ""
    if dist.is_main():
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".write_probe"
            probe.write_text("ok")
            probe.unlink()
            free = shutil.disk_usage(path).free
            need = 2 * checkpoint_size + 16 * 2 ** 20 if checkpoint_size else 0  # + logs and TensorBoard events
            if free < need:
                error = (f"run_dir={str(path)!r}: {free / 2**20:.1f} MiB free on its file system, but two "
                         f"checkpoints of ~{checkpoint_size / 2**20:.1f} MiB plus logs need "
                         f"{need / 2**20:.0f} MiB; free space or choose another run_dir "
                         "(fault.check_disk=false skips this check)")
        except OSError as err:
            error = f"run_dir={str(path)!r}: not writable ({err.strerror}); choose another run_dir"
        if error and created:
            shutil.rmtree(path, ignore_errors=True)
    error = dist.broadcast_object(error)
    if error:
        raise ConfigError(error)


def check_same_model(run_dir: Path, cfg: TrainConfig) -> None:
    """Resuming: the run's config.yaml must describe the same network as this config."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")).get("model", {})
    except Exception as err:  # missing or malformed: let DeepSpeed's load decide
        log.warning("%s unreadable (%s): cannot compare the model settings", run_dir / "config.yaml", err)
        return
    shape_keys = ("name", "num_classes", "in_channels", "width", "blocks_per_stage")
    diff = [f"model.{k}={saved.get(k)!r} there, {getattr(cfg.model, k)!r} here" for k in shape_keys
            if k in saved and saved[k] != getattr(cfg.model, k)]
    if diff:
        raise ConfigError(f"run_dir={str(run_dir)!r} holds checkpoints of a different model ({'; '.join(diff)}). "
                          "Resume with the same model.* settings, or choose a new run_dir")


def write_run_files(run_dir: Path, cfg: TrainConfig, engine_cfg: dict, ds_path: str, world: int) -> None:
    checkpoint.atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    checkpoint.atomic_write_text(run_dir / "ds_config.json", json.dumps(engine_cfg, indent=2) + "\n")
    meta = {"git_sha": git_sha(), "world_size": world, "deepspeed_config_file": ds_path,
            "host": socket.gethostname(), "python": sys.version.split()[0], "torch": torch.__version__,
            "deepspeed": __import__("deepspeed").__version__, "command": sys.argv,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    checkpoint.atomic_write_text(run_dir / "meta.json", json.dumps(meta, indent=2) + "\n")


def input_dtype(precision: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def loss_scale_of(engine) -> float | None:
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None)
    if scale is None and getattr(opt, "loss_scaler", None) is not None:
        scale = getattr(opt.loss_scaler, "cur_scale", None)
    return float(scale) if scale is not None else None


# ---------------------------------------------------------------- loop pieces
def train_epoch(engine, optimizer, loader, epoch: int, stage: BatchStage, state: TrainState, lr_fn, monitor: Monitor,
                watch: Watch, *, epochs: int, every: int, label_smoothing: float, dtype: torch.dtype,
                fmt: torch.memory_format = torch.contiguous_format, grad_sync=None) -> dict | None:
    """One epoch (or its rest, from ``state.epoch_step``). Returns the epoch's metrics, or None when a
    stop signal ended it early (``state.epoch_step`` / ``epoch_sums`` then hold the part done)."""
    engine.train()
    acc, start = stage.accumulation, state.epoch_step
    loader.set_epoch(epoch, start * acc)  # DeepSpeed never calls set_epoch; our loaders reshuffle from (seed, epoch)
    n_micro = len(loader)  # once: a folder loader's len() draws the epoch's permutation
    steps = n_micro // acc
    device = next(engine.module.parameters()).device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss*n, top1, top5, n (this epoch, this rank)
    if start and state.epoch_sums and dist.is_main():
        sums += torch.tensor(state.epoch_sums, dtype=torch.float64, device=device)
    window_loss, window_t0, window_steps = torch.zeros((), dtype=torch.float64, device=device), time.perf_counter(), 0
    kill_at = int(os.environ.get(FAULT_ENV, "0"))
    stop, done = "", start
    for i, (x, y) in enumerate(loader, start * acc):
        if i % acc == 0:
            lr, wd_factor = lr_fn(epoch + (i // acc + 1) / steps, stage.global_size)
            apply_schedule(optimizer, lr, wd_factor)
        # we own the boundary: DeepSpeed's micro-step counter drifts when a ramp changes accumulation
        engine.set_gradient_accumulation_boundary((i + 1) % acc == 0)
        logits = engine(x.to(dtype=dtype, memory_format=fmt))
        loss = smoothed_cross_entropy(logits, y, label_smoothing)
        watch.nonfinite.observe(loss, state.step + 1)
        engine.backward(loss)
        if grad_sync is not None and (i + 1) % acc == 0:
            grad_sync.sync()  # our all-reduce (dstrain/comm.py): the engine's is switched off
        engine.step()
        _accumulate(sums, loss.detach(), logits.detach(), y)
        window_loss += loss.detach().double() / acc
        if (i + 1) % acc:
            continue
        state.step += 1
        done, window_steps = done + 1, window_steps + 1
        if kill_at and state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        watch.skips.update(engine.skipped_steps, state.step, loss_scale_of(engine))
        stop = watch.stop_requested()
        if window_steps == every or (i + 1) == n_micro or stop:
            watch.check_finite(state.step, epoch)  # a host sync, as the logged loss is anyway
            dt = time.perf_counter() - window_t0
            monitor.step(epoch=epoch, epochs=epochs, step=state.step, step_in_epoch=done,
                         steps_per_epoch=steps, loss=window_loss.item() / window_steps,  # host sync
                         lr=lr, global_batch=stage.global_size,
                         images_per_sec=window_steps * stage.global_size / dt, loss_scale=loss_scale_of(engine),
                         comm_bytes=grad_sync.take_bytes() / window_steps if grad_sync is not None else None,
                         skipped=watch.skips.total or None)
            window_loss.zero_()
            window_t0, window_steps = time.perf_counter(), 0
        if stop:
            log.warning("%s received: stopping after step %d (epoch %d, step %d/%d) to write a checkpoint", stop,
                        state.step, epoch + 1, done, steps)
            break
    totals = dist.all_reduce_sum(sums).tolist()  # host sync, once per epoch
    if stop:
        state.epoch_step, state.epoch_sums = done, totals
        return None
    state.epoch_step, state.epoch_sums = 0, []
    loss_sum, top1, top5, n = totals
    n = max(n, 1.0)
    return {"train_loss": loss_sum / n, "train_top1": top1 / n, "train_top5": top5 / n}


def _accumulate(sums: torch.Tensor, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
    """Add (loss*n, top-1 hits, top-5 hits, n) on the device: no host sync per step."""
    hit = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]
    sums[0] += loss.double() * len(y)
    sums[1] += hit[:, 0].sum()
    sums[2] += hit.any(1).sum()
    sums[3] += len(y)


@torch.no_grad()
def evaluate(engine, loader, dtype: torch.dtype, fmt: torch.memory_format = torch.contiguous_format) -> dict:
    """Exact distributed evaluation: per-rank sums over disjoint shards, all-reduced."""
    engine.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=next(engine.parameters()).device)
    for x, y in loader:
        logits = engine(x.to(dtype=dtype, memory_format=fmt)).float()
        _accumulate(sums, F.cross_entropy(logits, y), logits, y)
    loss_sum, top1, top5, n = dist.all_reduce_sum(sums).tolist()
    engine.train()
    d = max(n, 1.0)
    return {"val_loss": loss_sum / d, "val_top1": top1 / d, "val_top5": top5 / d, "val_images": int(n)}


def sync_bn_buffers(model: torch.nn.Module) -> None:
    """Average BN running stats over ranks (DeepSpeed broadcasts parameters, not buffers)."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
           and m.running_mean is not None]
    if dist.world_size() == 1 or not bns:
        return
    flat = torch.cat([torch.cat([m.running_mean.float(), m.running_var.float()]) for m in bns])
    dist.all_reduce_sum(flat).div_(dist.world_size())
    offset = 0
    for m in bns:
        c = m.running_mean.numel()
        m.running_mean.copy_(flat[offset:offset + c])
        m.running_var.copy_(flat[offset + c:offset + 2 * c])
        offset += 2 * c


# ---------------------------------------------------------------- the run
def make_lr_fn(o: OptimConfig, base_lr: float, epochs: int):
    """lr_fn(t, B) -> (LR, weight-decay factor or None) for the step ending at progress t (epochs) at
    global batch B: the whole LR schedule in one place."""
    def lr_fn(t: float, global_batch: int) -> tuple[float, float | None]:
        peak = scaled_lr(base_lr, global_batch, o.lr_reference_batch, o.lr_scaling)
        lr = lr_at(t, base_lr=base_lr, peak_lr=peak, epochs=epochs, warmup_epochs=o.warmup_epochs,
                   warmup=o.warmup, start_factor=o.warmup_start_factor, hybrid_exp_fraction=o.hybrid_exp_fraction,
                   decay=o.decay, end_lr_factor=o.end_lr_factor, poly_power=o.poly_power,
                   milestones=tuple(o.step_milestones), gamma=o.step_gamma)
        return lr, (lr / peak if o.wd_follows_lr and peak > 0 else None)
    return lr_fn


def run(cfg: TrainConfig, ds_path: str) -> dict:
    import deepspeed

    dist.setup_env_for_single_process()
    world = dist.world_size()
    validate(cfg, world)
    user_ds = ds_config.load(ds_path)
    precision = ds_config.precision(user_ds)
    plan = batch_plan(cfg.batch.global_size, cfg.batch.micro_per_rank, cfg.batch.ramp, world, cfg.epochs)
    comm_cfg = comm.parse(user_ds, ds_path)
    if comm_cfg is not None and comm_cfg.mode == "torus2d":
        comm.grid_for(world, comm_cfg.grid)  # a grid that does not fit the world fails before anything starts
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=timedelta(seconds=cfg.fault.collective_timeout_s))
    dist.init_host_group()
    signals = guard.StopSignals()
    signals.install()  # from here a SIGTERM/SIGINT stops the run after a step, with a checkpoint
    run_dir = choose_run_dir(cfg)
    if dist.is_main() and os.environ.get("DSTRAIN_RUN_DIR_FILE"):  # launch.sh reports per rank from RUN_DIR/ranks
        Path(os.environ["DSTRAIN_RUN_DIR_FILE"]).write_text(str(run_dir.resolve()) + "\n")
    device = torch.device("cuda", dist.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels once

    seed_everything(cfg.seed)
    m = cfg.model
    model = build_model(m.name, m.num_classes, m.in_channels, m.width, m.blocks_per_stage, m.zero_init_residual)
    if precision == "bf16" and device.type == "cpu" and has_batchnorm(model):
        raise ConfigError(f"{ds_path}: bf16.enabled casts BatchNorm weights to bf16, which fails on CPU. "
                          "Use ds_configs/bf16.json (torch_autocast: bf16 compute, fp32 weights and BN).")
    optimizer, json_lr = build_optimizer(model, user_ds.get("optimizer"), source=ds_path)
    first = plan[0]
    shard = Shard(dist.rank(), world, first.micro, first.accumulation, cfg.batch.eval_per_rank, cfg.seed)
    dtype, fmt = input_dtype(precision), memory_format(m.channels_last)
    data = build_data(cfg.data, shard, m.in_channels, m.num_classes, device, dtype, m.channels_last)
    n_train, n_val = data.n_train, data.n_val
    largest = max(s.global_size for s in plan)
    if n_train < largest:
        raise ConfigError(f"batch.ramp: global size {largest} exceeds the {n_train} "
                          "training images; lower it or use more data")
    engine_cfg = ds_config.for_engine(user_ds, first.micro, first.accumulation, world)
    with steps_suppressed(optimizer):  # DeepSpeed's fp16/bf16 wrapper steps once with zero grads in initialize
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_cfg)
    if m.channels_last:  # after initialize: DeepSpeed's parameter broadcast needs NCHW-contiguous tensors
        engine.module.to(memory_format=torch.channels_last)
    grad_sync = configure_grad_sync(engine, comm_cfg, world, cfg.seed)
    dist.set_timeout_everywhere(cfg.fault.collective_timeout_s)  # also the groups DeepSpeed and comm.py made
    make_run_dir(run_dir, checkpoint_bytes(engine.module, precision) if cfg.fault.check_disk else 0)
    # only now: a config or data error above leaves nothing behind

    o = cfg.optim
    base_lr = o.base_lr or json_lr  # the trainer config may override the JSON's lr (a CLI sweep)
    lr_fn = make_lr_fn(o, base_lr, cfg.epochs)

    def peak_lr(global_batch: int) -> float:  # logged per stage and per epoch
        return scaled_lr(base_lr, global_batch, o.lr_reference_batch, o.lr_scaling)
    state = TrainState()
    ckpt_root = run_dir / "checkpoints"
    tag = checkpoint.newest_complete(ckpt_root) if cfg.resume == "auto" else None
    if tag:
        check_same_model(run_dir, cfg)
        state = TrainState(**checkpoint.load(engine, ckpt_root, tag))
        log.info("resumed from %s: %d epochs and %d steps done", ckpt_root / tag, state.epoch, state.step)
    elif cfg.resume == "auto":
        log.info("resume=auto: no complete checkpoint in %s, starting fresh", ckpt_root)
    if dist.is_main():
        write_run_files(run_dir, cfg, engine_cfg, ds_path, world)
    log.info("run_dir %s | world %d | precision %s | %s loader, %d train / %d val images | base lr %.4g per %d "
             "images (%s scaling rule)", run_dir, world, precision, data.loader, n_train, n_val, base_lr,
             o.lr_reference_batch, o.lr_scaling)
    for s in plan:
        log.info("from epoch %d: global batch %d = %d micro x %d accumulation x %d ranks, %d steps/epoch, "
                 "peak lr %.4g", s.epoch + 1, s.global_size, s.micro, s.accumulation, world,
                 n_train // s.global_size, peak_lr(s.global_size))

    monitor = Monitor(run_dir, dist.is_main(), cfg.log.tensorboard)
    watch = Watch(signals, guard.NonFiniteWatch(device), guard.SkipCounter(cfg.fault.max_consecutive_skips),
                  ckpt_root / tag if tag else None)
    records = guard.RankRecords(run_dir, dist.rank(), world)
    records.start(state.step)
    try:
        train_loop(engine, optimizer, cfg, plan, state, data, shard, lr_fn, peak_lr, monitor, watch, ckpt_root,
                   dtype=dtype, fmt=fmt, grad_sync=grad_sync)
        signals.restore()  # training is done and checkpointed: a signal during polishing just ends the process
        polish_info = polish_step(engine, data, cfg, state, run_dir, monitor, world, batch_at(cfg.epochs - 1, plan),
                                  dtype, fmt) if cfg.polish.enabled else None
    except guard.RunStopped as err:
        monitor.close()
        records.finish(err.state, err.exit_code, str(err), state.step)
        raise
    except ConfigError as err:  # found only while training: a corrupt image
        monitor.close()
        records.finish("bad_input", guard.EXIT_CONFIG, str(err), state.step)
        raise
    except Exception as err:
        monitor.close()
        if not guard.is_collective_failure(err):
            records.finish("error", guard.EXIT_ERROR, guard.first_line(err), state.step)
            raise
        msg = guard.describe_lost(guard.wait_for_records(records), dist.rank(), guard.first_line(err),
                                  cfg.fault.collective_timeout_s)
        msg += f" at step {state.step}. " + (f"The last complete checkpoint is {watch.last_checkpoint}; "
                                             "resume=auto continues from it" if watch.last_checkpoint
                                             else "No checkpoint was written yet")
        records.finish("lost_peer", guard.EXIT_PEER_LOST, msg, state.step)
        raise guard.PeerLost(msg) from None
    finally:
        signals.restore()
    monitor.close()
    summary = make_summary(state, world, batch_at(cfg.epochs - 1, plan).global_size, precision)
    if polish_info:
        summary["polish"] = polish_info
    if grad_sync is not None:
        summary["comm"] = grad_sync.summary()
    if dist.is_main():
        checkpoint.atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        log.info("summary: final top-1 %.4f, best %.4f, %d epochs, %.1f s wall, %.0f img/s -> %s",
                 summary["final_top1"], summary["best_top1"], summary["epochs"], summary["wall_time_s"],
                 summary["images_per_sec"], run_dir / "summary.json")
    records.finish("done", 0, "", state.step)
    return summary


def configure_grad_sync(engine, comm_cfg, world: int, seed: int):
    """Who averages the gradients: our comm layer (returned), DeepSpeed's backward all-reduce, or nobody.

    With one rank (ZeRO 0) DeepSpeed would still flatten every gradient, "all-reduce" it over a group of
    one and copy it back each step: an identity that made a resnet18 CPU step 1.28x slower
    (bench/single_rank_allreduce.py)."""
    if comm_cfg is not None:  # our gradient sync replaces the engine's backward all-reduce
        engine.enable_backward_allreduce = False
        return comm.GradientSync(comm_cfg, list(engine.module.parameters()), seed=seed)
    if world == 1 and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False
    return None


def train_loop(engine, optimizer, cfg: TrainConfig, plan: list[BatchStage], state: TrainState, data, shard: Shard,
               lr_fn, peak_lr, monitor: Monitor, watch: Watch, ckpt_root: Path, *, dtype: torch.dtype,
               fmt: torch.memory_format, grad_sync) -> None:
    """The epochs from ``state`` on: train, BN sync, evaluate, checkpoint; a stop signal checkpoints and raises."""
    o, n_train = cfg.optim, data.n_train
    for epoch in range(state.epoch, cfg.epochs):
        t0 = time.perf_counter() - state.epoch_elapsed_s
        stage = batch_at(epoch, plan)
        if stage.accumulation != engine.gradient_accumulation_steps():  # batch-size ramp (also after a resume)
            engine.set_train_batch_size(stage.global_size)
            log.info("epoch %d: global batch -> %d (%d accumulation steps)", epoch + 1, stage.global_size,
                     stage.accumulation)
        shard.accumulation = stage.accumulation  # the loaders cut this epoch's global batches from it
        augment = augment_at(epoch, cfg.epochs, cfg.polish.last_epochs_without_augmentation, cfg.data.augment)
        data.train.set_augment(augment)
        if cfg.data.augment and not augment:
            log.info("epoch %d/%d: un-augmented training images (polish.last_epochs_without_augmentation=%d)",
                     epoch + 1, cfg.epochs, cfg.polish.last_epochs_without_augmentation)
        if state.epoch_step:
            log.info("epoch %d: continuing after step %d of the epoch", epoch + 1, state.epoch_step)
        metrics = train_epoch(engine, optimizer, data.train, epoch, stage, state, lr_fn, monitor, watch,
                              epochs=cfg.epochs, every=cfg.log.every_steps, label_smoothing=o.label_smoothing,
                              dtype=dtype, fmt=fmt, grad_sync=grad_sync)
        sync_bn_buffers(engine.module)  # eval and checkpoints see the same BN statistics on every rank
        train_s = time.perf_counter() - t0  # the training part of the epoch (no evaluation, no checkpoint)
        if metrics is None:  # a stop signal part-way through the epoch
            state.epoch_elapsed_s = train_s
            stop_with_checkpoint(engine, cfg, state, watch, ckpt_root, checkpoint.tag_for(state.epoch, state.step),
                                 epoch)
        state.epoch_elapsed_s = 0.0
        last = epoch + 1 == cfg.epochs
        if last or (epoch + 1) % cfg.eval_every_epochs == 0:
            metrics.update(evaluate(engine, data.val, dtype, fmt))
            state.best_top1 = max(state.best_top1, metrics["val_top1"])
        steps = n_train // stage.global_size
        metrics.update(epoch_time_s=time.perf_counter() - t0, train_s=train_s, global_batch=stage.global_size,
                       steps_per_epoch=steps, peak_lr=peak_lr(stage.global_size), augment=int(augment))
        state.epoch, state.train_time_s = epoch + 1, state.train_time_s + metrics["epoch_time_s"]
        state.train_images += steps * stage.global_size
        state.history.append({"epoch": epoch + 1, "step": state.step, **metrics})
        monitor.epoch(epoch, cfg.epochs, metrics)
        every = cfg.checkpoint.every_epochs
        saved = last or (every and (epoch + 1) % every == 0)
        if saved:
            watch.check_finite(state.step, epoch, engine.module)
            watch.last_checkpoint = checkpoint.save(engine, ckpt_root, checkpoint.tag_for(epoch + 1), state.__dict__,
                                                    cfg.checkpoint.keep_last)
        if not last and watch.stop_requested_now():  # a signal during evaluation or the save: stop here
            if saved:
                raise guard.Preempted(preempted_message(watch, state, "the end of", epoch))
            stop_with_checkpoint(engine, cfg, state, watch, ckpt_root, checkpoint.tag_for(epoch + 1), epoch)
    watch.drain()


def stop_with_checkpoint(engine, cfg: TrainConfig, state: TrainState, watch: Watch, ckpt_root: Path, tag: str,
                         epoch: int) -> None:
    watch.drain()
    watch.check_finite(state.step, epoch, engine.module)  # never save a diverged model
    watch.last_checkpoint = checkpoint.save(engine, ckpt_root, tag, state.__dict__, cfg.checkpoint.keep_last)
    raise guard.Preempted(preempted_message(watch, state, "step %d of" % state.epoch_step if state.epoch_step
                                            else "the end of", epoch))


def preempted_message(watch: Watch, state: TrainState, where: str, epoch: int) -> str:
    return (f"stopped by {watch.signals.name or 'a signal on another rank'} after global step {state.step} "
            f"({where} epoch {epoch + 1}); checkpoint {watch.last_checkpoint} written. Run again with resume=auto "
            "and the same run_dir to continue")


def polish_step(engine, data, cfg: TrainConfig, state: TrainState, run_dir: Path, monitor: Monitor, world: int,
                last: BatchStage, dtype: torch.dtype, fmt: torch.memory_format) -> dict | None:
    """Final Polishing after the last epoch: BN refit, evaluation, RUN_DIR/polished/ (the checkpoints stay)."""
    if (run_dir / polish.POLISHED_DIR / "polish.json").is_file():
        log.info("polish: %s already exists (a resumed, finished run); not polishing again", run_dir / "polished")
        return json.loads((run_dir / polish.POLISHED_DIR / "polish.json").read_text())
    before = next(h for h in reversed(state.history) if "val_top1" in h)  # the last epoch is always evaluated
    pc = cfg.polish
    after = polish.polish_model(engine.module, engine, data.polish, lambda: evaluate(engine, data.val, dtype, fmt),
                                images=pc.images, batches=pc.batches, batch_per_rank=pc.batch_per_rank or last.micro,
                                world=world, dtype=dtype, fmt=fmt)
    info = polish.summarize(before, after, state.train_time_s)
    monitor.scalars("polish", {"val_top1_before": before["val_top1"], "val_top1_after": after["val_top1"],
                               "val_loss_before": before["val_loss"], "val_loss_after": after["val_loss"],
                               "refit_s": after["refit_s"]}, state.epoch)
    log.info("polish: top-1 %.4f -> %.4f (%+.4f), %.1f s = %.2f%% of the training time", before["val_top1"],
             after["val_top1"], info["top1_gain"], after["refit_s"], 100 * (info["refit_fraction_of_training"] or 0))
    if dist.is_main():
        polish.save_polished(run_dir, engine.module, {"checkpoint": f"epoch{state.epoch:04d}", **info})
    dist.barrier()
    return info


def make_summary(state: TrainState, world: int, global_batch: int, precision: str) -> dict:
    evaluated = [h for h in state.history if "val_top1" in h]
    final = evaluated[-1]["val_top1"] if evaluated else math.nan
    return {"final_top1": final, "best_top1": state.best_top1,
            "final_top5": evaluated[-1]["val_top5"] if evaluated else math.nan,
            "epochs": state.epoch, "steps": state.step, "global_batch": global_batch, "world_size": world,
            "precision": precision, "wall_time_s": state.train_time_s,
            "gpu_time_s": state.train_time_s * world,  # "GPU-time" = wall x ranks (METHODS.md sec. 8)
            "images_per_sec": state.train_images / state.train_time_s if state.train_time_s else 0.0,
            "history": state.history}
