"""A checkpoint's manifest: every file with its size and CRC-32, written last.

TensorFlow's CheckpointManager and Orbax mark a checkpoint complete once its files are written, and
a reader takes the newest complete one. A file lost or damaged after that mark (a partial copy
between file systems, a scratch purge, a disk error) still passes such a check; with the manifest,
"complete" means every file present and as written::

    manifest.json   {"format": 1, "checksum": "crc32",
                     "files": {"mp_rank_00_model_states.pt": {"bytes": 1234, "crc32": "1a2b3c4d"}, ...}}

The ranks share the reading, when the manifest is made and when it is checked: each reads every
world-th file (names sorted) and the results are gathered, so every rank reaches the same verdict.
CRC-32 (zlib) finds damage, not tampering (a checkpoint's pickles are checked for code apart:
dstrain/core/safe_load.py); it runs at a few GB/s on one core, so a checkpoint costs about one more
read of its files (``python bench/checkpoint.py`` measures it per GB).

A checkpoint written before manifests existed has none: it is checked by loading each file as data.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.core.files import atomic_write_text
from dstrain.core.safe_load import DamagedFile, load_data, refuse_code

NAME = "manifest.json"
FORMAT = 1
CHUNK = 8 << 20


def crc32(path: Path) -> str:
    """The file's CRC-32 as 8 hex digits, read in chunks."""
    crc = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "crc32": crc32(path)}


def my_share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (sorted): every world-th from its rank; all of them where no
    process group is up (``--check``, the polish command before it starts one)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return sorted(names)
    return sorted(names)[tdist.get_rank() :: tdist.get_world_size()]


def gather_entries(folder: Path) -> dict[str, dict]:
    """Collective: the entry of every file in ``folder``, the ranks sharing the reading. Raises
    OSError on the rank that could not read its share (the caller makes every rank agree)."""
    names = [p.name for p in folder.iterdir() if p.is_file() and p.name != NAME]
    mine, error = {}, None
    try:
        mine = {name: entry(folder / name) for name in my_share(names)}
    except OSError as err:
        error = err
    merged: dict[str, dict] = {}
    for part in dist.all_gather_object(mine):
        merged.update(part)
    if error is not None:
        raise error
    # a file this rank lists that no rank read (a listing that differed between ranks)
    for name in sorted(set(names) - set(merged)):
        merged[name] = entry(folder / name)
    return merged


def write(folder: Path, files: dict[str, dict]) -> None:
    """The manifest of ``files`` (name -> entry), atomically: a reader sees all of it or none."""
    body = {"format": FORMAT, "checksum": "crc32", "files": dict(sorted(files.items()))}
    atomic_write_text(folder / NAME, json.dumps(body, indent=1) + "\n")


def read(folder: Path) -> dict | None:
    """The manifest's files (name -> entry), or None for a checkpoint written before manifests."""
    path = folder / NAME
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        files = body["files"]  # a later format keeps each file's bytes and crc32 (file_problem)
        if not isinstance(files, dict):
            raise ValueError(f"files is a {type(files).__name__}")
        return files
    except (OSError, ValueError, KeyError, TypeError) as err:
        # written atomically: a manifest that does not read was damaged after the save
        return {NAME: {"unreadable": f"{type(err).__name__}: {str(err)[:80]}"}}


def file_problem(folder: Path, name: str, want: dict, checksums: bool = True) -> str | None:
    """What is wrong with one file against its manifest entry, in words, or None."""
    if "unreadable" in want:
        return f"{name} does not read ({want['unreadable']})"
    path = folder / name
    if not isinstance(want, dict) or not {"bytes", "crc32"} <= set(want):
        return f"{name}'s manifest entry does not read ({str(want)[:60]})"
    try:
        size = path.stat().st_size
        if size != want["bytes"]:
            how = "cut short" if size < want["bytes"] else "grown"
            return f"{name} has {size} bytes, {want['bytes']} when written ({how})"
        if checksums and crc32(path) != want["crc32"]:
            return f"{name} does not match its checksum (corrupted since it was written)"
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as err:
        return f"{name} does not read ({err.strerror or err})"
    return None


def problems(folder: Path, allowed=None, required: tuple[str, ...] = ()) -> list[str]:
    """Collective: what is wrong with the checkpoint in ``folder``, one phrase a damaged file (empty:
    intact). With a manifest: each file's presence, size and checksum. Without one (a checkpoint from
    before manifests): each ``*.pt`` file loads as data, ``allowed(name)`` naming the globals it may
    use, and the ``required`` files are there. A file whose pickle names code is refused on every
    rank (ConfigError), never skipped."""
    files = read(folder)
    mine: list[tuple[str, str]] = []  # (damaged | refused, what)
    if files is None:
        names = [p.name for p in folder.glob("*.pt")]
        mine += [("damaged", f"{n} is missing") for n in my_share(list(required)) if n not in names]
        for name in my_share(names):
            try:
                load_data(folder / name, allowed(name) if allowed else ())
            except DamagedFile as err:
                mine.append(("damaged", f"{name} {err.what}"))
            except ConfigError as err:
                mine.append(("refused", str(err)))
    else:
        for name in my_share(list(files)):
            if problem := file_problem(folder, name, files[name]):
                mine.append(distrust(folder / name, allowed) or ("damaged", problem))
    found = sorted(p for part in dist.all_gather_object(mine) for p in part)
    if refusal := next((what for kind, what in found if kind == "refused"), None):
        raise ConfigError(refusal)
    return [what for _, what in found]


def distrust(path: Path, allowed) -> tuple[str, str] | None:
    """A torch file changed since it was written whose pickle names code (or that is no torch.save
    zip at all): ("refused", the refusal), else None (plain damage)."""
    if path.suffix != ".pt" or not path.is_file():
        return None
    try:
        refuse_code(path, allowed(path.name) if allowed else ())
    except DamagedFile:
        return None
    except ConfigError as err:
        return ("refused", str(err))
    return None
