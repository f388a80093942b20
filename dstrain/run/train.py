"""A training run, set up in named phases: check, join the job, build, resume, fit, polish, summarise.

:func:`run` reads top to bottom. Everything that can be checked without starting anything
(the config, the DeepSpeed JSON, the batch plan) is checked in :func:`prepare`, so bad input
fails before a process group, a run directory or a model exists; the loop itself is
:class:`dstrain.loop.trainer.Trainer`.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.core.errors import ConfigError, PeerLost, RunStopped, first_line
from dstrain.core.files import atomic_write_text
from dstrain.core.hooks import Hooks, LoopHook
from dstrain.loop import checkpoint, fault, final_polish, mlperf, tracking
from dstrain.loop.monitor import Monitor
from dstrain.loop.target import TargetStop
from dstrain.loop.trainer import Trainer, TrainState
from dstrain.run import compat, outcome, rundir, startup
from dstrain.run.components import Components, build_components
from dstrain.run.plan import Plan, prepare
from dstrain.settings.config import TrainConfig
from dstrain.techniques import comm, noise_scale, warm_start
from dstrain.techniques.ema import EMAHook, WeightEMA
from dstrain.techniques.lars import LARS, LARSLog
from dstrain.techniques.models import compile_engine, keep_batchnorm_fp32
from dstrain.techniques.noise_scale import GradientNoise, NoiseRamp
from dstrain.techniques.optim import build_optimizer, steps_suppressed

log = logging.getLogger(__name__)


def run(cfg: TrainConfig, ds_path: str) -> dict:
    """Train ``cfg`` with the DeepSpeed JSON at ``ds_path``; returns summary.json's content."""
    plan = prepare(cfg, ds_path)
    dist.init_process_group(cfg.fault.collective_timeout_s)
    signals = fault.StopSignals()
    signals.install()  # from here a SIGTERM/SIGINT stops the run after a step, with a checkpoint
    try:
        # MLPerf's init_start: before anything is checked or built (its log is opened when built)
        began_ms = mlperf.now_ms()
        if why := dist.rank_without_gpu():
            raise ConfigError(why)
        # the checks --check makes, in its order: nothing is built or written before they pass,
        # and a refusal leaves the run directory as it was
        start = startup.check(plan, dist.device())
        run_dir = start.run_dir
        rundir.announce(run_dir)
        try:
            trainer = build_trainer(plan, start, signals, began_ms)
            log_plan(plan, start)
        except Exception as err:  # stopped while building: the directory says so
            outcome.mark_failed_start(run_dir, err)
            raise
        summary = fit_and_summarise(trainer, plan, run_dir)
    finally:
        signals.restore()
        rundir.release_all()
    dist.shutdown()
    return summary


def build_trainer(
    plan: Plan,
    start: startup.Start,
    signals: fault.StopSignals,
    began_ms: int | None = None,
) -> Trainer:
    """Phase 2, after the start-up checks: model, data, optimizer, engine, run directory, and the
    state to start from. ``began_ms``: when the run began (:func:`dstrain.loop.mlperf.now_ms`),
    MLPerf's init_start; None: now."""
    cfg, spec, run_dir = plan.cfg, plan.spec, start.run_dir
    # the run's one MLPerf log (a no-op with log.mlperf off and on ranks other than 0)
    mlperf_log = mlperf.MLPerfLog(cfg.log.mlperf and dist.is_main(), began_ms)
    if cfg.resume == "auto" and not start.resume_tag:
        log.info("resume=auto: no complete checkpoint in %s, starting fresh", run_dir)
    device = dist.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_cudnn(cfg.deterministic)
    first = plan.stages[0]
    parts = build_components(cfg, spec.precision, first, device, start.images, source=spec.path)
    if start.init_tensors:  # init.weights, read and fitted by the start-up checks (a fresh run)
        warm_start.apply(parts.model, start.init_tensors)
    # the EMA's FP32 copy is taken before DeepSpeed casts or compiles the model
    ema = weight_ema(cfg, parts.model, device)
    engine_cfg = spec.engine_config(first.micro, first.accumulation, plan.world)
    engine, optimizer, grad_sync = build_engine(plan, parts, engine_cfg)
    noise = gradient_noise(plan, engine, device)
    # every group gets the timeout, also those DeepSpeed and comm.py made
    dist.set_timeout_everywhere(cfg.fault.collective_timeout_s)
    rundir.create(run_dir)
    # only now: a config or data error above leaves nothing behind
    root = run_dir / rundir.CHECKPOINTS
    state, last_checkpoint = resume(engine, root, start.resume_tag, start.skipped)
    checks = fault.StepChecks.create(signals, device, cfg.fault.max_consecutive_skips)
    checks.last_checkpoint = last_checkpoint
    trainer = Trainer(
        cfg=cfg,
        engine=engine,
        optimizer=optimizer,
        data=parts.data,
        stages=plan.stages,
        schedule=plan.schedule,
        monitor=Monitor(
            run_dir,
            dist.is_main(),
            cfg.log.tensorboard,
            tracking.sinks(cfg.log, run_dir, cfg.name, resolved(cfg)) if dist.is_main() else (),
        ),
        checks=checks,
        checkpoint_root=root,
        input_dtype=parts.input_dtype,
        memory_format=parts.memory_format,
        grad_sync=grad_sync,
        noise=noise,
        state=state,
        hooks=loop_hooks(cfg, mlperf_log, optimizer, ema, noise),
    )
    if dist.is_main():
        rundir.write_run_files(
            run_dir,
            cfg,
            engine_cfg,
            spec.path,
            plan.world,
            compat.fingerprint(cfg, spec, plan.world),
            epoch=state.epoch,
            resumed=start.resume_tag,
            skipped=start.skipped,
        )
        start_mlperf_log(mlperf_log, trainer, plan, run_dir, device)
    return trainer


def resolved(cfg: TrainConfig) -> dict:
    """The config as the run resolved it (what config.yaml holds), for the trackers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def weight_ema(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> WeightEMA | None:
    """optim.ema: the FP32 average of ``model``'s weights (dstrain/techniques/ema.py), or None."""
    settings = cfg.optim.ema
    if not settings.decay:
        return None
    where = torch.device("cpu") if settings.device == "cpu" else device
    ema = WeightEMA(model, settings, where)
    log.info(
        "EMA of the weights: decay %g%s, every %d step(s), FP32 on %s",
        settings.decay,
        f" (timm's warmup, gamma {settings.warmup_gamma:g}, power {settings.warmup_power:g})"
        if settings.warmup
        else "",
        settings.every_steps,
        where,
    )
    return ema


def gradient_noise(plan: Plan, engine, device: torch.device) -> GradientNoise | None:
    """log.noise_scale: the measurement on the engine's parameters (dstrain/techniques/noise_scale.py),
    or None (off, or a DeepSpeed config whose gradients it cannot read: said once)."""
    cfg = plan.cfg
    if not cfg.log.noise_scale:
        return None
    if why := noise_scale.unsupported(plan.spec.engine, cfg.model.bn_group):
        log.warning("log.noise_scale: not measured: %s", why)
        return None
    params = engine.module.parameters()
    log_ = cfg.log
    return GradientNoise(
        params,
        log_.noise_scale_decay,
        device,
        log_.noise_scale_every,
        local_big=plan.spec.lossy_comm,
    )


def loop_hooks(
    cfg: TrainConfig,
    mlperf_log: mlperf.MLPerfLog,
    optimizer: torch.optim.Optimizer,
    ema: WeightEMA | None = None,
    noise: GradientNoise | None = None,
) -> Hooks[Trainer]:
    """What rides on this run's loop (dstrain/core/hooks.py), in the order each event reaches them."""
    target = TargetStop(cfg.target_top1) if cfg.target_top1 else None
    # MLPerf's marks are no-ops with log.mlperf off; run_stop's status asks the target
    hooks: list[LoopHook[Trainer]] = [mlperf.MLPerfMarks(mlperf_log, target)]
    if ema is not None:  # before TargetStop: an epoch's EMA top-1 is in the history however it ends
        hooks.append(EMAHook(ema))
    if target is not None:
        hooks.append(target)
    if isinstance(optimizer, LARS):  # its trust ratios on every log line
        hooks.append(LARSLog(tensors=cfg.log.lars_tensors))
    if noise is not None:
        hooks.append(noise)
        if cfg.batch.follow_noise:  # after the measurement: it decides on its averages
            batch = cfg.batch
            hooks.append(
                NoiseRamp(noise, batch.noise_factor, batch.noise_cap, batch.noise_rewarm_epochs)
            )
    return Hooks(hooks)


def start_mlperf_log(
    log_: mlperf.MLPerfLog, trainer: Trainer, plan: Plan, run_dir: Path, device: torch.device
) -> None:
    """log.mlperf: the file in run_dir, the submission keys and the run's hyperparameters."""
    settings = plan.cfg.log
    log_.open(run_dir, trainer.state.epoch)
    log_.submission(
        settings.mlperf_division,
        settings.mlperf_org,
        settings.mlperf_platform or mlperf.platform(plan.world, device),
        settings.mlperf_status,
    )
    data = trainer.data
    log_.hyperparameters(mlperf.run_values(plan, data.n_train, data.n_val, trainer.schedule))


def build_engine(plan: Plan, parts: Components, engine_cfg: dict):
    """(engine, client optimizer, our gradient sync or None) for the first batch-size stage, whose
    DeepSpeed config is ``engine_cfg``."""
    import deepspeed

    optimizer = build_optimizer(parts.model, plan.spec.optimizer, plan.schedule.base_lr)
    # DeepSpeed's fp16/bf16 wrapper steps once with zero grads in initialize: make that step a no-op
    with steps_suppressed(optimizer):
        engine, _, _, _ = deepspeed.initialize(
            model=parts.model, optimizer=optimizer, config=engine_cfg
        )
    if plan.spec.precision == "fp16":  # the native engine cast every parameter to FP16
        log.info(
            "fp16 engine: %d BatchNorm modules kept in FP32", keep_batchnorm_fp32(engine.module)
        )
    # after initialize: its broadcast needs NCHW tensors
    if parts.memory_format == torch.channels_last:
        engine.module.to(memory_format=torch.channels_last)
    if plan.cfg.model.compile:  # after the layout change: the graph sees the final strides
        compile_engine(engine, plan.cfg.model.compile_mode, plan.cfg.model.compile_backend)
    return engine, optimizer, configure_grad_sync(engine, plan.spec.comm, plan.world, plan.cfg.seed)


def configure_grad_sync(
    engine, spec: comm.CommSpec | None, world: int, seed: int
) -> comm.GradientSync | None:
    """Who averages the gradients: our comm layer (returned), DeepSpeed's backward all-reduce, or nobody.

    With one rank (ZeRO 0) DeepSpeed would still flatten every gradient, "all-reduce" it over a group of
    one and copy it back each step: an identity that made a resnet18 CPU step 1.28x slower (a probe,
    `git show 7d4f03e:bench/single_rank_allreduce.py`)."""
    if spec is not None:  # our gradient sync replaces the engine's backward all-reduce
        engine.enable_backward_allreduce = False
        return comm.GradientSync(
            spec.config, list(engine.module.parameters()), seed=seed, dtype=spec.dtype
        )
    if world == 1 and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False
    return None


def resume(engine, root: Path, tag: str | None, skipped=()) -> tuple[TrainState, Path | None]:
    """Load checkpoint ``tag`` (None: start fresh) into the engine: (state, its directory).

    :func:`build_trainer` has already refused a checkpoint this config cannot continue
    (dstrain/run/compat.py), before anything was built or written."""
    if not tag:
        return TrainState(), None
    state = TrainState()
    state.load_state_dict(checkpoint.load(engine, root, tag))
    log.info("resumed from %s: %d epochs and %d steps done", root / tag, state.epoch, state.step)
    if skipped:
        log.warning(
            "resumed from %s, not from the newer %s (damaged): the epochs since are trained again",
            tag,
            ", ".join(t for t, _ in skipped),
        )
    return state, root / tag


def log_plan(plan: Plan, start: startup.Start) -> None:
    """The plan as the run starts it: the very lines ``--check`` prints (startup.plan_lines)."""
    job = f"{plan.world} rank(s) on {dist.device().type}"
    for line in startup.plan_lines(plan, start, job):
        log.info("%s", line)


def fit_and_summarise(trainer: Trainer, plan: Plan, run_dir: Path) -> dict:
    """Phase 3: train, polish, write summary.json; how the run ended is recorded once
    (:class:`dstrain.run.outcome.Outcome`: every rank's record in RUN_DIR/ranks/)."""
    with outcome.Outcome(run_dir, dist.rank(), plan.world, lambda: trainer.state.step) as ending:
        ending.on_end(trainer.monitor.close)
        ending.on_end(trainer.hooks.close)
        # the watchdog, ending a stalled or signalled process, records through the same path
        watchdog_report = functools.partial(ending.end, close=False)
        try:
            with trainer.watchdog.running(watchdog_report, trainer.resume_note):
                trainer.fit()
                # trained and checkpointed: a signal during polishing just ends it
                trainer.checks.signals.restore()
                polished = (
                    final_polish.polish(trainer, run_dir) if plan.cfg.polish.enabled else None
                )
        except (RunStopped, ConfigError):  # ConfigError found only while training: a corrupt image
            raise
        except Exception as err:
            if fault.is_collective_failure(err):
                raise lost_peer(trainer, ending.records, err) from None
            raise
        summary = trainer.summary(plan.world, plan.spec.precision)
        if polished:
            summary["polish"] = polished
        if trainer.grad_sync is not None:
            summary["comm"] = trainer.grad_sync.summary()
        if dist.is_main():
            atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
            trainer.monitor.finish(summary)
            log.info(
                "summary: final top-1 %.4f, best %.4f, %d epochs, %.1f s wall, %.0f img/s -> %s",
                summary["final_top1"],
                summary["best_top1"],
                summary["epochs"],
                summary["wall_time_s"],
                summary["images_per_sec"],
                run_dir / "summary.json",
            )
    return summary


def lost_peer(trainer: Trainer, records: fault.RankRecords, err: Exception) -> PeerLost:
    """A collective failed: name the rank that went first (from the peers' records) and the way back."""
    step, last = trainer.state.step, trainer.checks.last_checkpoint
    peers = fault.wait_for_records(records)
    blamed = fault.failed_ranks(peers, dist.rank())
    msg = fault.describe_lost(
        peers,
        dist.rank(),
        first_line(err),
        trainer.cfg.fault.collective_timeout_s,
    )
    msg += f" at step {step}. " + (
        f"The last complete checkpoint is {last}; resume=auto continues from it"
        if last
        else "No checkpoint was written yet"
    )
    # recorded by the Outcome it is raised through
    return PeerLost(
        msg, said_by_peer=bool(blamed) and all(r["state"] == "bad_input" for r in blamed)
    )


def set_cudnn(deterministic: bool) -> None:
    """Fixed input shapes: cuDNN autotunes once and keeps the fastest kernels, unless ``deterministic``
    asks for the same kernels every run (bit-identical reruns and resumes, some speed lost)."""
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
