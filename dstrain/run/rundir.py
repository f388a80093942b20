"""The run directory: choose it, create and check it, compare on resume, write config/meta files.

Layout of ``RUN_DIR``: ``config.yaml`` (the resolved trainer config), ``ds_config.json`` (the dict
DeepSpeed was given), ``meta.json`` (git SHA, world size, versions, command), ``checkpoints/``
(dstrain/loop/checkpoint.py), ``ranks/`` (dstrain/loop/fault.py), ``tb/`` (TensorBoard), ``summary.json`` and,
with Final Polishing, ``polished/``; ``.lock``, which rank 0 holds locked while the run lives
(:func:`hold`): a second run started in the directory meanwhile (a resume launched twice, a bench
started again beside its own runs) is refused before it writes anything, not left to interleave
its checkpoints with the first's. The lock goes with the process, however it ends.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.core.files import RUN_DIR_FILE_ENV, atomic_write_text
from dstrain.core.provenance import environment, git_sha, uncommitted_diff
from dstrain.loop.checkpoint import complete_tags
from dstrain.settings.config import ModelConfig, TrainConfig

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
# a run that failed before its first complete checkpoint: nothing to continue
FAILED = "failed.json"
# the model settings a checkpoint's tensors depend on
MODEL_KEYS = ("name", "num_classes", "in_channels", "width", "blocks_per_stage")
LOCK = ".lock"  # locked (flock) by the live run's rank 0; it holds who that is
_held: dict[Path, int] = {}  # run directories this process holds: their lock file's descriptor


def _holder(path: Path) -> str:
    """Who holds ``path``'s lock, in words, from what the holder wrote into it."""
    try:
        rec = json.loads((path / LOCK).read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["time"]))
        return f"pid {rec['pid']} on {rec['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its lock is held"


def _refusal(path: Path) -> str:
    return (
        f"run_dir={str(path)!r} is in use: another dstrain process is running in it "
        f"({_holder(path)}). Wait for it to end, stop it (SIGTERM: it checkpoints), or choose "
        "another run_dir"
    )


def in_use(path: Path) -> str | None:
    """Why ``path`` cannot be run in now (another live process holds its lock), or None. Reads
    only, for the start-up checks and ``--check``: the run takes the lock in :func:`create`."""
    lock = path / LOCK
    if path.resolve() in _held or not lock.is_file():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _refusal(path)
    except OSError:  # a file system without locks: nothing to know
        return None
    finally:
        os.close(fd)  # and with it the lock this probe took
    return None


def hold(path: Path) -> None:
    """Lock ``path`` for this process's life (rank 0, once the directory exists), or refuse it when
    another process holds it. A file system that cannot lock gets a warning, not a refusal."""
    key = path.resolve()
    if key in _held:
        return
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(_refusal(path)) from None
    except OSError as err:
        os.close(fd)
        log.warning(
            "run_dir %s: its file system cannot lock (%s): a second run started in it would not "
            "be refused",
            path,
            err.strerror,
        )
        return
    os.ftruncate(fd, 0)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    os.write(fd, (json.dumps(record) + "\n").encode())
    _held[key] = fd


def release_all() -> None:
    """Unlock every run directory this process holds (the end of a run in a process that goes on,
    as a test's; a process that ends releases them anyway)."""
    while _held:
        os.close(_held.popitem()[1])


def contents(path: Path) -> list[Path]:
    """What ``path`` holds, its lock file left out."""
    return [child for child in path.iterdir() if child.name != LOCK]


def resolve_seed(cfg: TrainConfig, run_dir: Path, draw: bool = True) -> None:
    """``seed=auto``: the seed ``run_dir``'s config.yaml recorded (a resume continues its run),
    else one drawn from the OS on rank 0 and shared (``draw``; ``--check`` draws none). In place."""
    if cfg.seed != "auto":
        return
    recorded = None
    if cfg.resume == "auto" and (run_dir / "config.yaml").is_file():
        from omegaconf import OmegaConf

        recorded = OmegaConf.load(run_dir / "config.yaml").get("seed")
    if isinstance(recorded, int):
        cfg.seed = recorded
        log.info("seed=auto: %d, as %s/config.yaml recorded it", recorded, run_dir)
    elif draw:
        import secrets

        cfg.seed = int(dist.broadcast_object(secrets.randbelow(2**31)))
        log.info("seed=auto: drew %d (recorded in config.yaml)", cfg.seed)


def choose(cfg: TrainConfig) -> Path:
    """The run directory (named on rank 0); never reuse one silently. Creates nothing."""
    path = cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(dist.broadcast_object(path))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir={str(path)!r} is a file; choose a directory")
    failed = failed_start(path)
    if failed is not None:
        log.warning(
            "run_dir %s holds a run that failed before its first checkpoint (%s: %s); starting over in it",
            path,
            FAILED,
            failed.get("message", "?"),
        )
    elif path.exists() and contents(path):
        if cfg.resume != "auto":
            raise ConfigError(
                f"run_dir={str(path)!r} already holds a run. Pass resume=auto to continue it, "
                "or choose a new run_dir=..."
            )
        if not (path / "meta.json").is_file() and not (path / CHECKPOINTS).is_dir():
            raise ConfigError(
                f"run_dir={str(path)!r} is not empty and is not a dstrain run (no meta.json, no "
                "checkpoints/); resume=auto only continues dstrain runs. Choose a new run_dir"
            )
    return path


def announce(path: Path) -> None:
    """Tell launch.sh where the run lives (it reports per rank from RUN_DIR/ranks): rank 0 writes
    the directory into the file $DSTRAIN_RUN_DIR_FILE names, once the start-up checks passed."""
    if dist.is_main() and os.environ.get(RUN_DIR_FILE_ENV):
        Path(os.environ[RUN_DIR_FILE_ENV]).write_text(str(path.resolve()) + "\n")


def checkpoint_bytes(model: torch.nn.Module, precision: str, ema: bool = False) -> int:
    """A generous estimate of one checkpoint: FP32 weights, two optimizer state slots, an FP32 master copy
    with FP16/BF16 engines, the buffers; with ``ema`` the FP32 average too (``ema.pt``)."""
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    copies = (4 if precision in ("fp16", "bf16") else 3) + (1 if ema else 0)
    return params * copies + buffers * (2 if ema else 1)


def disk_shortfall(path: Path, checkpoint_size: int) -> str | None:
    """Why ``path``'s file system (its nearest existing folder's) cannot hold two checkpoints of
    ``checkpoint_size`` bytes plus logs (the previous checkpoint stays until the next is complete),
    or None. A start-up check (dstrain/run/startup.py): the run and ``--check`` refuse alike."""
    where = next((p for p in (path.absolute(), *path.absolute().parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free
    need = 2 * checkpoint_size + 16 * 2**20  # + logs and TensorBoard events
    if free >= need:
        return None
    return (
        f"run_dir={str(path)!r}: {free / 2**20:.1f} MiB free on its file system, but two "
        f"checkpoints of ~{checkpoint_size / 2**20:.1f} MiB plus logs need "
        f"{need / 2**20:.0f} MiB; free space or choose another run_dir "
        "(fault.check_disk=false skips this check)"
    )


def create(path: Path) -> None:
    """Create the run directory and check it is writable, before training starts (its room was
    checked at start-up: :func:`disk_shortfall`). A failure removes what it created."""
    error = ""
    if dist.is_main():
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            hold(path)  # before anything in it changes: another live run there is refused
            probe = path / ".write_probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            error = f"run_dir={str(path)!r}: not writable ({err.strerror}); choose another run_dir"
            if created:
                shutil.rmtree(path, ignore_errors=True)
        except ConfigError as err:  # another live run holds it: nothing here is touched
            error = str(err)
        if not error and failed_start(path) is not None:  # nothing to continue: start from empty
            clear(path)
    error = dist.broadcast_object(error)
    if error:
        raise ConfigError(error)


def check_same_model(run_dir: Path, model: ModelConfig) -> None:
    """Resuming: the run's config.yaml must describe the same network as this config."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")).get("model", {})
    except Exception as err:  # missing or malformed: let DeepSpeed's load decide
        log.warning(
            "%s unreadable (%s): cannot compare the model settings", run_dir / "config.yaml", err
        )
        return
    diff = [
        f"model.{k}={saved.get(k)!r} there, {getattr(model, k)!r} here"
        for k in MODEL_KEYS
        if k in saved and saved[k] != getattr(model, k)
    ]
    if diff:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} holds checkpoints of a different model ({'; '.join(diff)}). "
            "Resume with the same model.* settings, or choose a new run_dir"
        )


def write_run_files(
    run_dir: Path,
    cfg: TrainConfig,
    engine_cfg: dict,
    ds_path: str,
    world: int,
    resume: dict,
    epoch: int = 0,
    resumed: str | None = None,
    skipped=(),
) -> None:
    """config.yaml, ds_config.json and meta.json (rank 0); ``resume``: what the checkpoints depend on
    (dstrain/run/compat.py); ``epoch``: the epochs done when this start (or restart) began;
    ``resumed``: the checkpoint it continues from, ``skipped``: the newer ones passed over as
    damaged, (tag, why)."""
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write_text(run_dir / "ds_config.json", json.dumps(engine_cfg, indent=2) + "\n")
    sha, starts = git_sha(), earlier_starts(run_dir)
    meta = {
        "git_sha": sha,  # this start's (the last restart's); "starts" holds every one
        "world_size": world,
        "deepspeed_config_file": ds_path,
        **environment(),
        "command": sys.argv,
        "resume": resume,
        "starts": [*starts, start_record(run_dir, sha, epoch, len(starts), resumed, skipped)],
    }
    atomic_write_text(run_dir / "meta.json", json.dumps(meta, indent=2) + "\n")


def earlier_starts(run_dir: Path) -> list[dict]:
    """The starts meta.json recorded before this one (a run from before they were recorded: its one
    SHA as the first start, its epoch unknown)."""
    try:
        old = json.loads((run_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return []
    if "starts" in old:
        return list(old["starts"])
    return [{"git_sha": old.get("git_sha"), "epoch": None, "diff": None}] if old else []


def start_record(
    run_dir: Path, sha: str, epoch: int, n: int, resumed: str | None = None, skipped=()
) -> dict:
    """Start ``n`` (0: the first): the SHA, the epoch it continues from, the date, and for a tree with
    uncommitted changes their diff, saved beside meta.json (``code-<n>.diff``): the code a -dirty
    run ran."""
    diff = uncommitted_diff() if sha.endswith("-dirty") else ""
    name = f"code-{n}.diff" if diff else None
    if name:
        atomic_write_text(run_dir / name, diff)
    return {
        "git_sha": sha,
        "epoch": epoch,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "diff": name,
        **({"resumed_from": resumed} if resumed else {}),
        **({"skipped_damaged": [{"tag": t, "why": w} for t, w in skipped]} if skipped else {}),
    }


def failed_start(path: Path) -> dict | None:
    """The record of a run in ``path`` that failed before its first complete checkpoint, or None."""
    marker = path / FAILED
    if not marker.is_file() or complete_tags(path / CHECKPOINTS):
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return {"message": f"{marker} unreadable"}


def mark_failed(path: Path, state: str, exit_code: int, message: str) -> bool:
    """A run that stops before its first complete checkpoint leaves nothing to continue: rank 0 writes
    RUN_DIR/failed.json (the error), which resume=auto, a new run in the same run_dir and the results
    tooling (``python -m dstrain.polish``, bench/) read as "no run here". The files stay for reading
    (config.yaml, meta.json, ranks/ for launch.sh's table). Returns whether the mark was made."""
    if not dist.is_main() or not path.is_dir() or complete_tags(path / CHECKPOINTS):
        return False
    record = {"state": state, "exit_code": exit_code, "message": message, "time": time.time()}
    try:
        atomic_write_text(path / FAILED, json.dumps(record, indent=2) + "\n")
    except OSError as err:  # a full disk must not hide the real error
        log.warning("could not write %s: %s", path / FAILED, err)
        return False
    log.info("%s: no checkpoint was written, marked failed (%s)", path, FAILED)
    return True


def clear(path: Path) -> None:
    """Empty a run directory that holds only a failed start (see :func:`failed_start`), its lock
    kept (this process holds it)."""
    for child in contents(path):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
