"""Atomic checkpoints around DeepSpeed's save_checkpoint, with the trainer's own state.

Layout of ``RUN_DIR/checkpoints``::

    epoch0003/              one complete checkpoint (DeepSpeed files + ours) after 3 epochs
        mp_rank_00_model_states.pt ...   DeepSpeed: module, optimizer, loss scaler, client_state
        rng_rank00000.pt ...             per-rank RNG state (DeepSpeed saves none)
        trainer_state.json               epoch, step, history (human-readable copy)
        manifest.json                    every file's size and CRC-32, written last
    epoch0003-step00000050/ written on SIGTERM/SIGINT: 3 epochs and global step 50 done
    epoch0004.partial/      a save in progress, or one killed half-way: never loaded
    latest                  the tag of the newest complete checkpoint

A save writes into ``<tag>.partial``; after every rank has finished, the ranks
read the files back for the manifest (dstrain/loop/manifest.py), rank 0 writes it
and renames the folder to ``<tag>`` and then replaces ``latest`` atomically (write
to a temporary file, fsync, ``os.replace``). ``resume=auto`` takes the newest
checkpoint whose files still match their manifest (:func:`newest_intact`): one
damaged after it was written costs that checkpoint, not the run. A process
killed at any point leaves the previous checkpoint complete and ``latest``
pointing at it (tested by killing at each phase: tests/inject/sitecustomize.py). A write that fails (a full
disk) fails on every rank with :class:`~dstrain.core.errors.CheckpointWriteError`,
and the partial directory is removed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from dstrain.core import dist
from dstrain.core.errors import CheckpointWriteError, ConfigError, first_line
from dstrain.core.files import atomic_write_text, fsync_dir
from dstrain.core.safe_load import NUMPY_ARRAYS, load_data, refuse_code
from dstrain.loop import manifest

log = logging.getLogger(__name__)
TAG_RE = re.compile(r"^epoch(\d{4,})(?:-step(\d{8,}))?$")
POINTER = "latest"
STATE_FILE = "trainer_state.json"
MODEL_FILE = "mp_rank_00_model_states.pt"  # DeepSpeed's module weights (model parallel rank 0)


def tag_for(epoch: int, step: int | None = None) -> str:
    """``epoch0003`` after 3 whole epochs; ``epoch0003-step00000050`` for a stop part-way through the fourth."""
    return f"epoch{epoch:04d}" if step is None else f"epoch{epoch:04d}-step{step:08d}"


def _order(tag: str) -> tuple[int, int]:
    m = TAG_RE.match(tag)
    return int(m.group(1)), int(m.group(2) or 0)


def rng_state() -> dict:
    """Every generator's state, in types torch's weights_only loader reads (numpy's key array as a
    tensor): the file loads as data (dstrain/core/safe_load.py)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]  # a tensor, or a numpy array in files before issue 51
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoint tags, oldest first."""
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(tags, key=_order)


def newest_complete(root: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete one on disk."""
    pointer = root / POINTER
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if TAG_RE.match(tag) and (root / tag / STATE_FILE).is_file():
            return tag
        log.warning(
            "%s names %r, which is not a complete checkpoint; scanning the directory", pointer, tag
        )
    tags = complete_tags(root)
    return tags[-1] if tags else None


def trainer_state(root: Path, tag: str) -> dict:
    """The trainer state a complete checkpoint was saved with (its human-readable copy), or {}."""
    try:
        return json.loads((root / tag / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def save(
    engine, root: Path, tag: str, trainer_state: dict, keep_last: int = 0, files: dict | None = None
) -> Path:
    """Collective: every rank calls it. Returns the complete checkpoint's directory. ``files``:
    ``{name: payload}`` this rank saves beside DeepSpeed's (the loop's hooks', e.g. ``ema.pt``)."""
    partial = f"{tag}.partial"
    error = ""
    try:
        if dist.is_main():
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(root / partial, ignore_errors=True)
        dist.barrier()
        engine.save_checkpoint(
            str(root), tag=partial, client_state={"dstrain": trainer_state}, save_latest=False
        )
        (root / partial).mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), root / partial / f"rng_rank{dist.rank():05d}.pt")
        for name, payload in (files or {}).items():
            torch.save(payload, root / partial / name)
    except (
        OSError,
        RuntimeError,
    ) as err:  # torch.save reports ENOSPC as e.g. "unexpected pos N vs M"
        error = f"{root / partial}: {_describe(err, root)}"
    # every rank's files are on disk before the checkpoint is complete
    _agree_or_fail(root / partial, error)
    files: dict[str, dict] = {}
    try:
        files = manifest.gather_entries(root / partial)  # the ranks share the reading
    except OSError as err:
        error = f"{root / partial}: {_describe(err, root)}"
    _agree_or_fail(root / partial, error)
    if dist.is_main():
        try:
            atomic_write_text(root / partial / STATE_FILE, json.dumps(trainer_state, indent=2))
            files[STATE_FILE] = manifest.entry(root / partial / STATE_FILE)
            manifest.write(root / partial, files)
            stale = root / f"{tag}.stale"
            if (
                root / tag
            ).exists():  # re-saving a tag (e.g. after a resume): move the old copy aside first
                shutil.rmtree(stale, ignore_errors=True)
                os.rename(root / tag, stale)
            os.rename(root / partial, root / tag)
            shutil.rmtree(stale, ignore_errors=True)
            fsync_dir(root)
            atomic_write_text(root / POINTER, tag + "\n")
            _prune(root, keep_last, tag)
        except OSError as err:
            error = f"{root / tag}: {_describe(err, root)}"
    _agree_or_fail(root / partial, error)
    return root / tag


def _describe(err: Exception, root: Path) -> str:
    text = (
        err.strerror
        if isinstance(err, OSError) and err.strerror
        else str(err).strip().splitlines()[-1]
    )
    try:
        free = shutil.disk_usage(root).free
        if free < 2**20:
            return f"the file system is full ({free // 1024} KiB free; {text})"
        return f"{text} ({free / 2**20:.1f} MiB free on its file system)"
    except OSError:
        return text


def _agree_or_fail(partial: Path, error: str) -> None:
    """All ranks learn whether any rank failed to write; then all raise, and the partial copy is removed."""
    if not dist.host_all_reduce([1.0 if error else 0.0], "max")[0]:
        return
    if dist.is_main():
        shutil.rmtree(partial, ignore_errors=True)
    where = error or "another rank could not write its part of the checkpoint"
    raise CheckpointWriteError(
        f"could not write a checkpoint: {where}. The previous complete checkpoint is "
        "untouched; free disk space (or fix permissions) and resume with resume=auto"
    )


def _prune(root: Path, keep_last: int, newest: str) -> None:
    """Keep ``keep_last`` checkpoints up to ``newest`` (just written): the older ones go, and only
    once ``newest``'s files are all there at their written sizes, so the newest intact checkpoint
    is never deleted for one that is not. A checkpoint newer than ``newest`` (a damaged one a
    resume skipped) is neither counted nor deleted: the run writes it again when it gets there."""
    if keep_last <= 0:
        return
    files = manifest.read(root / newest) or {}
    missing = [
        p for n, w in files.items() if (p := manifest.file_problem(root / newest, n, w, False))
    ]
    if missing or not files:
        log.warning(
            "checkpoint.keep_last: %s does not match its manifest (%s); no older checkpoint deleted",
            root / newest,
            "; ".join(missing) or "no manifest",
        )
        return
    older = [t for t in complete_tags(root) if _order(t) < _order(newest)]
    for tag in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(root / tag, ignore_errors=True)


# the classes a ZeRO stage 1/2 optimizer-state file (zero_pp_rank_*_optim_states.pt) pickles besides
# tensors: DeepSpeed's own enum, loss-scaler and fragment-address records (DeepSpeed 0.19)
ZERO_STATE_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def allowed_globals(name: str) -> tuple[str, ...]:
    """What a checkpoint file's pickle may name besides tensors: numpy's arrays in our RNG files,
    DeepSpeed's three ZeRO records in its optimizer-state files."""
    if name.startswith("rng_rank"):
        return NUMPY_ARRAYS
    if name.endswith("_optim_states.pt"):
        return ZERO_STATE_GLOBALS
    return ()


def refuse_foreign_code(ckpt: Path) -> None:
    """Refuse a checkpoint directory whose files would run code when unpickled (DeepSpeed's loader
    unpickles without weights_only): each file's pickle opcodes are read, nothing is run."""
    for path in sorted(ckpt.glob("*.pt")):
        refuse_code(path, allowed_globals(path.name))


def newest_intact(root: Path, tag: str = "") -> tuple[str | None, list[tuple[str, str]]]:
    """Collective (every rank reaches the same answer). The checkpoint to continue from: ``tag``,
    else the newest complete one (``latest``'s first) whose files match its manifest, or, written
    before manifests, load as data; and those passed over as damaged, with why. A file whose pickle
    names code is refused (ConfigError), not passed over."""
    tags = [tag] if tag else _newest_first(root)
    skipped = []
    for candidate in tags:
        found = manifest.problems(root / candidate, allowed_globals, (MODEL_FILE,))
        if not found:
            return candidate, skipped
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        skipped.append((candidate, shown))
    return None, skipped


def _newest_first(root: Path) -> list[str]:
    tags = complete_tags(root)[::-1]
    first = newest_complete(root)
    return [first, *[t for t in tags if t != first]] if first else tags


def damaged_error(root: Path, skipped: list[tuple[str, str]], what: str) -> ConfigError:
    """No intact checkpoint is left: one line naming each damaged one and what is wrong."""
    each = "; ".join(f"{tag}: {why}" for tag, why in skipped)
    return ConfigError(
        f"{what}: no intact checkpoint in {root} ({each}). Copy the damaged files again from where "
        "they came, or start a new run_dir; nothing was written"
    )


def configured_groups(optimizer) -> list[dict]:
    """The optimizer's settings per parameter group as this run's JSON and config built them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def keep_configured(optimizer, configured: list[dict]) -> list[str]:
    """After a checkpoint's optimizer state is loaded, put back the settings this run was built
    with: torch's ``load_state_dict`` keeps the saved groups' values (momentum, weight decay, the
    trust coefficient ...), so a setting changed at resume, which the resume check allows, would
    be silently ignored. What a group gathered while training (a step count, the last LR) and is
    not a setting stays as loaded; the weight decay the schedule scales is taken from the new
    setting. Returns the changes, ``key: saved -> now``."""
    changed = []
    for group, now in zip(optimizer.param_groups, configured, strict=True):
        for key, value in now.items():
            saved = group.get(key)
            if key != "lr" and saved != value and not hasattr(value, "shape"):
                changed.append(f"{key}: {saved!r} -> {value!r}")
        if "initial_weight_decay" not in now:
            group.pop("initial_weight_decay", None)  # apply_schedule takes it from weight_decay
        group.update(now)
    return sorted(set(changed))


def load(engine, root: Path, tag: str) -> dict:
    """Load a complete checkpoint into the engine; returns the trainer state saved with it. The
    optimizer keeps this run's settings (:func:`keep_configured`), the checkpoint's state."""
    refuse_foreign_code(root / tag)  # before DeepSpeed unpickles its files
    configured = configured_groups(engine.optimizer) if engine.optimizer is not None else None
    try:
        path, client_state = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    except RuntimeError as err:  # load_state_dict's "size mismatch" / "Missing key(s)"
        if "size mismatch" not in str(err) and "key(s)" not in str(err):
            raise
        raise ConfigError(
            f"{root / tag}: this checkpoint belongs to a different model "
            f"({str(err).splitlines()[-1].strip()[:160]}). Resume with the model.* settings it was "
            "trained with, or start a new run_dir"
        ) from None
    except (KeyError, ValueError) as err:  # an optimizer or engine state of another layout
        # dstrain/run/compat.py refuses the known causes first; this names the file if another slips through
        raise ConfigError(
            f"{root / tag}: cannot be loaded into this run's optimizer or engine "
            f"({type(err).__name__}: {first_line(err)[:160]}). "
            "Resume with the run's own config.yaml and DeepSpeed JSON, or start a new run_dir"
        ) from None
    if path is None or not client_state or "dstrain" not in client_state:
        raise RuntimeError(f"{root / tag}: DeepSpeed could not load this checkpoint")
    if configured is not None:
        changed = keep_configured(engine.optimizer, configured)
        if changed:
            log.info(
                "resumed with this run's optimizer settings, not the checkpoint's: %s",
                ", ".join(changed),
            )
    rng_file = root / tag / f"rng_rank{dist.rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(load_data(rng_file, NUMPY_ARRAYS))
    else:
        log.warning(
            "%s missing (world size changed?): RNG state not restored on rank %d",
            rng_file,
            dist.rank(),
        )
    return client_state["dstrain"]
