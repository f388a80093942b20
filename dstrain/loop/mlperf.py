"""MLPerf Training logs (``log.mlperf``): ``RUN_DIR/mlperf.log`` as MLPerf's own checkers read it.

The ``:::MLLOG`` lines are written by the ``mlperf-logging`` package's ``mllog`` (the logger NVIDIA's
submissions and the MLPerf references use), rank 0 only, with the keys MLPerf's ResNet-50 rules
ask for (ruleset 4.0.0, the last with ResNet): the submission keys, ``cache_clear``, init and run
start/stop (``run_stop`` with its status), ``epoch_start``/``epoch_stop`` and
``eval_start``/``eval_accuracy``/``eval_stop`` with ``epoch_num``, the sample counts, the global
batch and accumulation, the seed, ``model_bn_span`` and the optimizer's keys (``lars_*`` for
LARS, ``sgd_*`` for SGD), every value the one the run uses (the resolved schedule, not the
recipe's words). Check a log with::

    python -m mlperf_logging.compliance_checker --usage training --ruleset 4.0.0 RUN_DIR/mlperf.log

Events before the run directory exists (``init_start`` and the hyperparameters) are kept and
written, with their own time stamps, once it does. A resumed run writes a new file per attempt
(``mlperf-2.log``, ...): MLPerf results come from one uninterrupted run.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dstrain.core.hooks import Hook
from dstrain.loop.target import TargetStop

PACKAGE_HINT = "pip install mlperf-logging==4.1.68 (or: pip install -e '.[mlperf]')"
BENCHMARK = "resnet"  # the MLPerf benchmark whose rules these runs follow
LOG_NAME = "mlperf.log"
# set by ./launch.sh --drop-caches once the page cache is flushed on every node (MLPerf's cache_clear)
CACHE_CLEARED_ENV = "DSTRAIN_CACHE_CLEARED"
log = logging.getLogger(__name__)


def require_package() -> None:
    """log.mlperf=true needs the mlperf-logging package: a clear line before anything starts."""
    try:
        import mlperf_logging.mllog  # noqa: F401
    except ImportError as err:
        from dstrain.core.errors import ConfigError

        raise ConfigError(
            f"log.mlperf=true: the mlperf-logging package is not installed ({err}); "
            f"{PACKAGE_HINT}, or set log.mlperf=false"
        ) from None


def events(path: Path) -> list[dict]:
    """The ``:::MLLOG`` events of a log, decoded (other lines skipped)."""
    prefix = ":::MLLOG "
    return [
        json.loads(line.split(prefix, 1)[1])
        for line in path.read_text(encoding="latin-1").splitlines()
        if prefix in line
    ]


def log_path(run_dir: Path) -> Path:
    """mlperf.log, or for a later attempt in the same run directory mlperf-N.log (never overwritten)."""
    for n in itertools.count(1):
        path = run_dir / (LOG_NAME if n == 1 else f"mlperf-{n}.log")
        if not path.exists():
            return path
    raise AssertionError("unreachable")


class _Buffered(logging.Handler):
    """Lines kept in memory until :meth:`open` names the file, then appended to it as they come."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.path: Path | None = None

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage().lstrip("\n")
        if self.path is None:
            self.lines.append(line)
            return
        with self.path.open("a") as fh:
            fh.write(line + "\n")

    def open(self, path: Path) -> None:
        path.write_text("".join(line + "\n" for line in self.lines))
        self.path, self.lines = path, []


def now_ms() -> int:
    """The time as MLPerf's lines stamp it: milliseconds since the Unix epoch."""
    return int(time.time() * 1000)


class MLPerfLog:
    """The MLPerf log of one run attempt; every method is a no-op when ``enabled`` is false (other
    ranks, log.mlperf=false). ``init_start_ms``: when the run began (:func:`now_ms`, taken before
    its start-up checks), stamped on ``init_start``; None: now."""

    def __init__(self, enabled: bool, init_start_ms: int | None = None) -> None:
        self.enabled = enabled
        self.path: Path | None = None
        self.stopped = False
        if not enabled:
            return
        from mlperf_logging.mllog import constants, mllog

        self.c = constants
        logger = logging.getLogger(f"dstrain.loop.mlperf.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        self.handler = _Buffered()
        logger.addHandler(self.handler)
        self.logger = logger
        # call sites as repository paths (dstrain/loop/trainer.py), not this machine's
        root = str(Path(__file__).resolve().parents[2])
        self.ml = mllog.MLLogger(logger=logger, default_stack_offset=2, root_dir=root)
        self.ml.start(key=self.c.INIT_START, time_ms=init_start_ms)

    # ------------------------------------------------------------ set-up
    def open(self, run_dir: Path, resumed_epoch: int) -> None:
        """Write what was kept into the run directory's log file; from now on lines go there."""
        if not self.enabled:
            return
        self.path = log_path(run_dir)
        self.handler.open(self.path)
        if resumed_epoch:
            logging.getLogger(__name__).warning(
                "log.mlperf: this attempt resumes after epoch %d and logs to %s; MLPerf results "
                "come from one uninterrupted run",
                resumed_epoch,
                self.path,
            )

    def submission(self, division: str, org: str, platform: str, status: str) -> None:
        if not self.enabled:
            return
        c = self.c
        for key, value in (
            (c.SUBMISSION_BENCHMARK, BENCHMARK),
            (c.SUBMISSION_DIVISION, division),
            (c.SUBMISSION_ORG, org),
            (c.SUBMISSION_PLATFORM, platform),
            (c.SUBMISSION_STATUS, status),
        ):
            self.ml.event(key=key, value=value)
        # true only where the cache was flushed before the run: launch.sh sets it from what its
        # --drop-caches flushed in this job, 0 otherwise (an inherited 1 does not pass through it);
        # a job script that starts the ranks itself sets DSTRAIN_CACHE_CLEARED=1 after its flush
        cleared = os.environ.get(CACHE_CLEARED_ENV) == "1"
        self.ml.event(key=c.CACHE_CLEAR, value=cleared)
        if not cleared and division == "closed":
            log.warning(
                "log.mlperf: cache_clear false (the page cache was not flushed before this run); "
                "MLPerf's rules ask for it: launch with ./launch.sh --drop-caches"
            )

    def hyperparameters(self, values: dict) -> None:
        """One point-in-time event per key (the keys of :func:`hyperparameters`)."""
        if not self.enabled:
            return
        for key, value in values.items():
            self.ml.event(key=key, value=value)

    def run_start(self) -> None:
        if not self.enabled:
            return
        self.ml.end(key=self.c.INIT_STOP)
        self.ml.start(key=self.c.RUN_START)

    # ------------------------------------------------------------ the loop
    def epoch_start(self, epoch: int) -> None:
        if self.enabled:
            self.ml.start(key=self.c.EPOCH_START, metadata={self.c.EPOCH_NUM: epoch + 1})

    def epoch_stop(self, epoch: int) -> None:
        if self.enabled:
            self.ml.end(key=self.c.EPOCH_STOP, metadata={self.c.EPOCH_NUM: epoch + 1})

    def eval_start(self, epoch: int) -> None:
        if self.enabled:
            self.ml.start(key=self.c.EVAL_START, metadata={self.c.EPOCH_NUM: epoch + 1})

    def eval_stop(self, epoch: int, top1: float) -> None:
        if not self.enabled:
            return
        meta = {self.c.EPOCH_NUM: epoch + 1}
        self.ml.event(key=self.c.EVAL_ACCURACY, value=float(top1), metadata=meta)
        self.ml.end(key=self.c.EVAL_STOP, metadata=meta)

    def run_stop(self, success: bool) -> None:
        if not self.enabled or self.stopped:
            return
        status = self.c.SUCCESS if success else self.c.ABORTED
        self.ml.end(key=self.c.RUN_STOP, metadata={self.c.STATUS: status})
        self.stopped = True

    def close(self) -> None:
        if self.enabled:
            self.logger.removeHandler(self.handler)


class MLPerfMarks(Hook):
    """The loop's events as MLPerf's marks in ``log``: run_start, each epoch's start and stop, each
    evaluation's start, accuracy and stop, and run_stop: success where ``target`` (the run's
    :class:`~dstrain.loop.target.TargetStop`, None without ``target_top1``) saw the quality target
    reached, else aborted."""

    def __init__(self, log: MLPerfLog, target: TargetStop | None = None) -> None:
        self.log = log
        self.target = target

    def fit_start(self, trainer) -> bool:
        self.log.run_start()
        return False

    def epoch_start(self, trainer, epoch: int) -> None:
        self.log.epoch_start(epoch)

    def train_end(self, trainer, epoch: int) -> None:
        self.log.epoch_stop(epoch)

    def eval_start(self, trainer, epoch: int) -> None:
        self.log.eval_start(epoch)

    def eval_end(self, trainer, epoch: int, metrics: dict) -> bool:
        self.log.eval_stop(epoch, metrics["val_top1"])
        return False

    def fit_end(self, trainer, completed: bool) -> None:
        # MLPerf's success: the quality target reached (the RCP checker counts these runs' epochs)
        reached = self.target is not None and self.target.reached > 0
        self.log.run_stop(success=completed and reached)

    def summary(self, trainer) -> dict:
        return {"mlperf_log": str(self.log.path)} if self.log.path else {}

    def close(self) -> None:
        self.log.close()


def run_values(plan, n_train: int, n_val: int, schedule) -> dict:
    """The run's values under MLPerf's key names, as the run uses them (the last batch-size
    stage's batch, the resolved peak and end LR): the common keys, then ``lars_*`` (LARS) or
    ``sgd_*`` (SGD); another optimizer logs its name only (the closed division takes LARS or SGD)."""
    from dstrain.techniques.schedule import end_lr

    cfg, last = plan.cfg, plan.stages[-1]
    optim, optimizer = cfg.optim, plan.spec.optimizer
    peak = schedule.peak(last.global_size)
    decay_epochs = optim.decay_epochs or cfg.epochs - optim.warmup_epochs
    values: dict = {
        "seed": cfg.seed,
        "global_batch_size": last.global_size,
        "gradient_accumulation_steps": last.accumulation,
        "train_samples": n_train,
        "eval_samples": n_val,
        "model_bn_span": (cfg.model.bn_span or last.micro) * cfg.model.bn_group,
        "opt_name": optimizer.kind,
        "opt_learning_rate_warmup_epochs": optim.warmup_epochs,
    }
    if optimizer.kind in ("lars", "sgd"):
        p, params = optimizer.kind, optimizer.params
        values.update(
            {
                f"{p}_opt_base_learning_rate": peak,
                f"{p}_opt_end_learning_rate": (
                    end_lr(optim, peak) if optim.decay in ("poly", "cosine") else peak
                ),
                f"{p}_opt_learning_rate_decay_steps": round(
                    decay_epochs
                    * (  # data.last_batch=fill: epochs count images, steps N/B an epoch
                        n_train / last.global_size
                        if cfg.data.last_batch == "fill"
                        else n_train // last.global_size
                    )
                ),
                f"{p}_opt_momentum": float(params.get("momentum", 0.0)),
                f"{p}_opt_weight_decay": float(params.get("weight_decay", 0.0)),
            }
        )
        if optim.decay == "poly":
            values[f"{p}_opt_learning_rate_decay_poly_power"] = optim.poly_power
        if p == "lars":
            values["lars_opt_learning_rate_warmup_epochs"] = optim.warmup_epochs
            values["lars_epsilon"] = float(params.get("eps", 0.0))
    return values


def platform(world: int, device) -> str:
    """``<ranks>x<device name>``, e.g. 8xNVIDIA H100 80GB HBM3 or 2xCPU."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{world}x{name}"


RULESET = "4.0.0"  # the last MLPerf Training ruleset with ResNet (later ones crash on its logs)
# "CHECK for 'key' failed in line N" (a line's rule), "Failed checks for key" (an at-least-one
# rule over all lines), "Required EXACTLY_ONE occurrence of 'key'" and similar (a count)
FAILED_CHECK = re.compile(
    r"CHECK for '(\w+)' failed|Failed checks for (\w+)|Required \w+ occurrences? of '(\w+)'"
)


@dataclass(frozen=True)
class Verdict:
    """MLPerf's compliance checker on one log: passed, the keys whose checks failed, its output."""

    passed: bool
    failed: list[str]
    output: str


def check_log(path: Path, timeout: float = 300) -> Verdict:
    """Run ``python -m mlperf_logging.compliance_checker --usage training --ruleset 4.0.0`` on
    ``path`` (in a scratch folder: the checker writes compliance_checker.log where it runs)."""
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlperf_logging.compliance_checker",
                "--usage",
                "training",
                "--ruleset",
                RULESET,
                str(Path(path).resolve()),
            ],
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    output = proc.stdout + proc.stderr
    passed = proc.returncode == 0 and "SUCCESS" in output
    failed = {key for match in FAILED_CHECK.findall(output) for key in match if key}
    return Verdict(passed, sorted(failed), output)


TARGET_TOP1 = 0.759  # MLPerf ResNet-50's quality target


def judge_values(values: dict, division: str) -> Verdict:
    """Would a log with these hyperparameters pass MLPerf's checker? A log written as a run would
    write it, with one evaluation at the target, judged by the checker itself (``--check``)."""
    with tempfile.TemporaryDirectory() as scratch:
        log = MLPerfLog(True)
        log.open(Path(scratch), resumed_epoch=0)
        log.submission(division, "dstrain", "check", "research")
        log.hyperparameters(values)
        log.run_start()
        log.epoch_start(0)
        log.epoch_stop(0)
        log.eval_start(0)
        log.eval_stop(0, TARGET_TOP1)
        log.run_stop(success=True)
        log.close()
        return check_log(Path(scratch) / LOG_NAME)
