"""A finished run, as the commands that work on one see it (``python -m dstrain.polish``,
``.evaluate``, ``.export``): its config, the checkpoint ``resume=auto`` would choose, the file
holding the weights asked for, those weights loaded as data into the model its config describes,
the process group its evaluation joins, and the commands' arguments and frame (a
rank's log, one error line, the group left before exit). One place, so the three commands choose and refuse
alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from dstrain.core import dist
from dstrain.core.errors import ConfigError, RunStopped
from dstrain.core.logs import setup_logging
from dstrain.loop import checkpoint
from dstrain.run import ds_config, rundir
from dstrain.run.launch import adopt_mpi_env
from dstrain.run.outcome import ending_of
from dstrain.settings.config import TrainConfig, load_config, validate
from dstrain.techniques.bn_refit import POLISHED_DIR
from dstrain.techniques.ema import EMA_FILE
from dstrain.techniques.models import input_dtype
from dstrain.techniques.warm_start import read_weights

log = logging.getLogger(__name__)

WEIGHTS = ("trained", "ema", "polished")  # what a finished run holds: --weights
MODEL_FILE = "model.pt"  # a polished run's state dict, in RUN_DIR/polished/


def config(run_dir: Path, overrides: list[str] | None = None) -> TrainConfig:
    """The run's config.yaml with ``overrides``; refuses what is not a finished run's directory."""
    failed = rundir.failed_start(run_dir)
    if failed is not None:
        raise ConfigError(
            f"--checkpoint {run_dir}: this run failed before its first checkpoint "
            f"({rundir.FAILED}: {failed.get('message', '?')}); it has no weights"
        )
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--checkpoint {run_dir}: no config.yaml; pass a dstrain run directory")
    return load_config(str(run_dir / "config.yaml"), overrides)


def precision(run_dir: Path) -> str:
    """The precision the run trained in (its ds_config.json)."""
    return ds_config.precision(json.loads((run_dir / "ds_config.json").read_text()))


def checkpoint_dir(run_dir: Path, tag: str = "") -> Path:
    """The checkpoint ``resume=auto`` would continue from (or ``tag``): the newest whose files are
    as written, newer damaged ones passed over with a warning. Collective on a process group."""
    root = run_dir / rundir.CHECKPOINTS
    if tag and not (root / tag / checkpoint.STATE_FILE).is_file():
        raise ConfigError(f"--tag {tag}: no complete checkpoint {tag!r} in {root}")
    found, skipped = checkpoint.newest_intact(root, tag) if root.is_dir() else (None, [])
    if not found and skipped:
        raise checkpoint.damaged_error(root, skipped, f"--checkpoint {run_dir}")
    if not found:
        raise ConfigError(f"--checkpoint {run_dir}: no complete checkpoint in {root}")
    for damaged, why in skipped:
        if dist.is_main():
            log.warning("checkpoint %s skipped, damaged: %s; reading %s", damaged, why, found)
    return root / found


def weights_file(run_dir: Path, weights: str = "trained", tag: str = "") -> Path:
    """The file holding the run's ``weights`` (:data:`WEIGHTS`): the checkpoint's module states,
    its EMA (``optim.ema``), or Final Polishing's refit; refused in one line when absent."""
    if weights == "polished":
        path = run_dir / POLISHED_DIR / MODEL_FILE
        if not path.is_file():
            raise ConfigError(
                f"--weights polished: {path} missing; polish the run first "
                f"(python -m dstrain.polish --checkpoint {run_dir})"
            )
        return path
    found = checkpoint_dir(run_dir, tag)
    if weights == "ema" and not (found / EMA_FILE).is_file():
        raise ConfigError(
            f"--weights ema: {found} has no {EMA_FILE} (the run trained without optim.ema); "
            "choose --weights trained"
        )
    return found / (EMA_FILE if weights == "ema" else checkpoint.MODEL_FILE)


def load_weights(
    model: nn.Module,
    path: Path,
    field: str = "--weights",
    fix: str = "drop the model.* overrides",
) -> dict[str, torch.Tensor]:
    """The weights in ``path`` (any of :func:`weights_file`'s, or a state dict file ``field``
    names), read as data, loaded as float32 into ``model``, which must be the model they were
    trained as (every key, every shape); the float32 state dict. A refusal ends with ``fix``."""
    state = read_weights(path, field=field)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # size mismatch / missing keys
        raise ConfigError(
            f"{path}: these weights belong to a different model than model.* describes "
            f"({str(err).splitlines()[-1].strip()[:160]}); {fix}"
        ) from None
    return state


def join(cfg: TrainConfig, world_for_rules: int | None = None) -> int:
    """Validate ``cfg`` (for ``world_for_rules`` ranks, default this job's) and join this job's
    process group when it has more than one rank (a world of one without a launcher); the world
    size. A BN group is a training-time grouping of ranks (dstrain/techniques/bn_group.py), so it
    need not divide the job's ranks here."""
    import torch.distributed as tdist

    dist.setup_env_for_single_process()
    world = dist.world_size()
    validate(OmegaConf.merge(cfg, {"model": {"bn_group": 1}}), world_for_rules or world)
    if world > 1 and not tdist.is_initialized():
        dist.share_cpu_cores()
        tdist.init_process_group("nccl" if dist.use_gpu() else "gloo")
    if why := dist.rank_without_gpu():
        raise ConfigError(why)
    return world


class Autocast(nn.Module):
    """Runs a float32 model under autocast (bf16/fp16 recipes) without DeepSpeed."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device_type: str):
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def forward(self, x):
        if self.dtype == torch.float32:
            return self.module(x)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(x).float()


def autocast(model: nn.Module, precision: str, device: torch.device) -> Autocast:
    """``model`` (float32) computing as the run trained: FP16/BF16 under autocast on a GPU, BF16
    also on a CPU; FP16 on a CPU computes in float32 (CPUs have no FP16 kernels for most layers)."""
    dtype = (
        input_dtype(precision) if device.type == "cuda" or precision == "bf16" else torch.float32
    )
    return Autocast(model, dtype, device.type)


# ---------------------------------------------------------------- the commands' frame
def command_args(p: argparse.ArgumentParser, overrides_help: str) -> None:
    """What a command on a finished run takes beside its own options: the launcher's
    ``--local_rank`` and ``key=value`` config overrides."""
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)


def run_command(name: str, work: Callable[[], dict], log_stream=None) -> tuple[int, dict | None]:
    """``python -m dstrain.<name>``'s frame on every rank: the launcher's or mpirun's rank, the log
    (to ``log_stream``, default stdout), ``work()``; how it ended as a run's ending is (one
    ``dstrain.<name>: error:`` line, the run's exit statuses), the process group left before exit
    (gloo's teardown at exit can abort). (exit status, work's result or None)."""
    adopt_mpi_env()  # ranks started by mpirun: RANK before the log reads it
    setup_logging(log_stream)
    dist.quiet_deepspeed()
    try:
        return 0, work()
    except (ConfigError, RunStopped) as err:
        ending = ending_of(err)
        sys.stderr.write(f"dstrain.{name}: error: {ending.message}\n")  # one write: whole line
        sys.stderr.flush()
        return ending.exit_code, None
    finally:
        dist.shutdown()
