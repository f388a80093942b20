"""Ground floor: atomic file writes (a reader sees the old file or the new one, never half of one),
and private ones for shared places (``/tmp``: nothing another user placed there is followed)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: a file dstrain writes gets the permissions any new file gets


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(fh)`` into a temporary file beside ``path``, fsync it, rename it over ``path``, fsync
    the folder. The temporary file is created exclusively under a fresh name (``mkstemp``: never a
    file or link someone placed there), then given the usual permissions (0666 less the umask)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fchmod(fh.fileno(), 0o666 & ~_UMASK)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    atomic_write(path, lambda fh: fh.write(text.encode()))


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where the folder cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only, safely in a shared folder: the file is
    created afresh beside ``path`` (exclusively, mode 0600: ``mkstemp``) and renamed over it. A
    rename replaces whatever ``path`` was, a symbolic link another user planted included, and never
    writes through it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# the launcher (dstrain/run/launch.py) names a file here; rank 0 writes the run directory's path
# into it once the start-up checks passed (dstrain/run/rundir.py: announce)
RUN_DIR_FILE_ENV = "DSTRAIN_RUN_DIR_FILE"
