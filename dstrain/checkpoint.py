"""Atomic checkpoints around DeepSpeed's save_checkpoint, with the trainer's own state.

Layout of ``RUN_DIR/checkpoints``::

    epoch0003/              one complete checkpoint (DeepSpeed files + ours)
        mp_rank_00_model_states.pt ...   DeepSpeed: module, optimizer, loss scaler, client_state
        rng_rank00000.pt ...             per-rank RNG state (DeepSpeed saves none)
        trainer_state.json               epoch, step, history (human-readable copy)
    epoch0004.partial/      a save in progress, or one killed half-way: never loaded
    latest                  the tag of the newest complete checkpoint

A save writes into ``<tag>.partial``; after every rank has finished, rank 0
renames it to ``<tag>`` and then replaces ``latest`` atomically (write to a
temporary file, fsync, ``os.replace``). A process killed at any point leaves the
previous checkpoint complete and ``latest`` pointing at it.
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

from dstrain import dist

log = logging.getLogger("dstrain")
TAG_RE = re.compile(r"^epoch(\d{4,})$")
POINTER = "latest"
STATE_FILE = "trainer_state.json"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoint tags, oldest first."""
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)))


def newest_complete(root: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete one on disk."""
    pointer = root / POINTER
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if TAG_RE.match(tag) and (root / tag / STATE_FILE).is_file():
            return tag
        log.warning("%s names %r, which is not a complete checkpoint; scanning the directory", pointer, tag)
    tags = complete_tags(root)
    return tags[-1] if tags else None


def save(engine, root: Path, epoch: int, trainer_state: dict, keep_last: int = 0) -> Path:
    """Collective: every rank calls it. Returns the complete checkpoint's directory."""
    tag = f"epoch{epoch:04d}"
    partial = f"{tag}.partial"
    if dist.is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / partial, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=partial, client_state={"dstrain": trainer_state}, save_latest=False)
    (root / partial).mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), root / partial / f"rng_rank{dist.rank():05d}.pt")
    dist.barrier()  # every rank's files are on disk before the checkpoint is declared complete
    if dist.is_main():
        atomic_write_text(root / partial / STATE_FILE, json.dumps(trainer_state, indent=2))
        if (root / tag).exists():  # re-saving an epoch (e.g. after a resume): replace the old copy
            shutil.rmtree(root / tag)
        os.rename(root / partial, root / tag)
        _fsync_dir(root)
        atomic_write_text(root / POINTER, tag + "\n")
        _prune(root, keep_last)
    dist.barrier()
    return root / tag


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for tag in complete_tags(root)[:-keep_last]:
        shutil.rmtree(root / tag, ignore_errors=True)


def load(engine, root: Path, tag: str) -> dict:
    """Load a complete checkpoint into the engine; returns the trainer state saved with it."""
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
    if path is None or not client_state or "dstrain" not in client_state:
        raise RuntimeError(f"{root / tag}: DeepSpeed could not load this checkpoint")
    rng_file = root / tag / f"rng_rank{dist.rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        log.warning("%s missing (world size changed?): RNG state not restored on rank %d", rng_file, dist.rank())
    return client_state["dstrain"]
