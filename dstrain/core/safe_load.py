"""Reading torch files as data: a checkpoint from elsewhere never runs code (docs/faults.md, "What
dstrain trusts").

``torch.load`` unpickles, and a pickle may call any function it names: a crafted
``mp_rank_00_model_states.pt`` runs its author's code the moment it is loaded. torch's
``weights_only`` loader allows tensors, containers and numbers only, which is all a checkpoint of
weights holds. Everything dstrain loads itself goes through :func:`load_data`; the files DeepSpeed
unpickles on a resume (its loader has no ``weights_only``) are read by :func:`refuse_code` first,
which looks at the pickle's opcodes without running them and refuses a file that names anything
the ``weights_only`` loader would not allow.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path

import torch

from dstrain.core.errors import ConfigError, first_line

# numpy's array reconstruction, for dstrain's RNG files written before the numpy state became a
# tensor (they hold numpy arrays): allowed for those files alone (torch's own advice for arrays)
NUMPY_ARRAYS = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType",
)
FIX = (
    "dstrain loads checkpoints as data only (torch.load weights_only). If you trust its author, load "
    "it in your own Python session and save its tensors again (torch.save(state_dict))"
)


class DamagedFile(ConfigError):
    """A file of torch.save's format that is empty, cut short or corrupted: damage, not distrust
    (a checkpoint's manifest, dstrain/loop/manifest.py, tells which of its files changed).
    ``what``: the damage in words, after the file's name."""

    def __init__(self, path: Path, what: str):
        self.what = what
        super().__init__(
            f"{path}: {what}. The file is damaged, not foreign: copy it again from where it came, "
            "or resume from an earlier checkpoint"
        )


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6 is a zip archive


def damage(path: Path, err: Exception) -> DamagedFile | None:
    """``err`` (reading ``path`` as torch.save's zip) as damage, or None when the file is not one
    (an old-format pickle, or not a torch file at all: dstrain cannot read it as data)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as oserr:
        return DamagedFile(path, f"does not read ({oserr.strerror or oserr})")
    if not head:
        return DamagedFile(path, "is empty (0 bytes)")
    if head != ZIP_MAGIC:
        return None
    why = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
    return DamagedFile(path, f"is cut short or corrupted ({why})")


def refuse_code(path: Path, allowed: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigError` naming ``path`` if unpickling it would call anything torch's
    ``weights_only`` loader does not allow (besides ``allowed``); reads opcodes, runs nothing. A
    torch.save file that does not read raises :class:`DamagedFile`."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as err:  # not a torch zip file (a raw pickle), or a damaged or truncated one
        if damaged := damage(path, err):
            raise damaged from None
        raise ConfigError(
            f"{path}: refused: not a checkpoint torch.save wrote ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:120] if str(err) else 'unreadable'}), so dstrain cannot "
            f"read it as data; {FIX}"
        ) from None
    unsafe = [name for name in names if name not in set(allowed)]
    if unsafe:
        shown = ", ".join(unsafe[:3]) + (f" and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
        raise ConfigError(
            f"{path}: refused: unpickling it would call {shown}, which a checkpoint of weights never "
            f"needs (it could run code); nothing was loaded. {FIX}"
        )


def load_data(path: Path, allowed: Iterable[str] = ()) -> object:
    """``torch.load(path, weights_only=True)`` on the CPU, ``allowed`` (global names, from
    :data:`NUMPY_ARRAYS`) added; a file that asks for more is refused in one line naming it."""
    allowed = tuple(allowed)
    refuse_code(path, allowed)
    extra = [_resolve(name) for name in allowed]
    try:
        with torch.serialization.safe_globals([g for g in extra if g is not None]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # what the opcode scan could not see
        raise ConfigError(f"{path}: refused: {str(err).splitlines()[-1][:200]}; {FIX}") from None
    except (RuntimeError, EOFError, OSError) as err:  # a record of the zip that does not read
        raise damage(path, err) or DamagedFile(path, f"does not read ({first_line(err)})") from None


def _resolve(name: str) -> object | None:
    """The object a global's name means, if this numpy has it."""
    module, _, attr = name.rpartition(".")
    try:
        obj = __import__(module, fromlist=[attr])
        return getattr(obj, attr)
    except (ImportError, AttributeError):
        return None
