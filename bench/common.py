"""What every bench shares: running the real trainer and reading its summary, and the provenance of a result.

    from bench.common import REPO, provenance, run_trainer

``run_trainer`` runs a command line as a user would (``python -m dstrain ...``, a ``deepspeed``
launcher or ``./launch.sh``), stops the bench with the command and the tail of its output when the
run fails, and returns the run's ``summary.json`` with the command and its wall time added.
``provenance`` is the block every result file starts with: command, git SHA, date, host and versions.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TRAINER = [sys.executable, "-m", "dstrain"]


def run_trainer(
    cmd: list[str], run_dir: Path, *, env: dict | None = None, what: str = "dstrain"
) -> dict:
    """Run ``cmd`` (which must write ``run_dir``) from the repository root; its summary.json, plus ``command``,
    ``command_wall_s`` and ``stdout``."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    failed = Path(run_dir) / "failed.json"  # dstrain/run/rundir.py: no checkpoint, nothing to read
    if proc.returncode != 0 or failed.is_file():
        raise SystemExit(
            f"{what} failed ({proc.returncode}): {shlex.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    summary.update(
        command=shlex.join(cmd), command_wall_s=time.perf_counter() - t0, stdout=proc.stdout
    )
    return summary


def provenance(script: str, args: list[str] | None = None, command: str | None = None) -> dict:
    """dstrain.core.provenance.record for ``python bench/SCRIPT ARGS`` (default: this process's
    arguments), or for ``command`` as given (a launcher's, a trainer's)."""
    from dstrain.core.provenance import record

    if command is None:
        command = f"python bench/{script} " + shlex.join(sys.argv[1:] if args is None else args)
    return record(command)


def save_png(fig, path: Path, dpi: int) -> None:
    """A matplotlib figure as a 256-colour palette PNG: a plot's antialiased lines and text look
    the same, at about a third of the bytes of matplotlib's RGBA file. The work tree travels to the
    GPU node whole and every study report adds two figures, so their bytes are the DALI parts'
    room (tools/gpu_prepare.part_size: 156 MiB of DALI in 3 ferries needs a tree under 9 MiB)."""
    import io

    from PIL import Image

    raw = io.BytesIO()
    fig.savefig(raw, dpi=dpi, format="png")
    raw.seek(0)
    _write_palette(Image.open(raw), Path(path))


def palette_png(path: Path) -> bool:
    """Re-encode a PNG as :func:`save_png` writes one, unless it is a palette PNG already; whether
    it was (a report made by an older checkout, e.g. the issue-52 worktree's, writes RGBA)."""
    from PIL import Image

    with Image.open(path) as image:
        if image.mode == "P":
            return False
        image.load()
        _write_palette(image, Path(path))
    return True


def _write_palette(image, path: Path) -> None:
    palette = image.convert("RGB").quantize(256)
    tmp = path.with_name(path.name + ".tmp")
    palette.save(tmp, format="PNG", optimize=True)
    os.replace(tmp, path)  # atomic: a reader never sees half a figure
