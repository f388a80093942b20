"""What every bench shares: running the real trainer and reading its summary, and the provenance of a result.

    from bench.common import REPO, provenance, run_trainer

``run_trainer`` runs a command line as a user would (``python -m dstrain ...``, a ``deepspeed``
launcher or ``./launch.sh``), stops the bench with the command and the tail of its output when the
run fails, and returns the run's ``summary.json`` with the command and its wall time added.
``provenance`` is the block every result file starts with: command, git SHA, date, host and versions.

A bench stopped with SIGTERM (``pkill -TERM -f results/harness/accuracy_study.py``, a scheduler's stop) hands
it on to the trainers it runs, which checkpoint and exit, and starts no other: its runs resume when
the same command runs again. Without that, each trainer, a child the signal does not reach, trained
on alone, and a bench started again beside it would train the same run directory twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TRAINER = [sys.executable, "-m", "dstrain"]


def mean_pm(mean: float, sd: float, n: int) -> str:
    """'mean ± sd' (two decimals), or the mean and "(one seed)" for n = 1: a sample sd of one value
    is undefined, and '± 0.00' would read as no spread. Every table's ± cell prints through this."""
    return f"{mean:.2f} (one seed)" if n < 2 else f"{mean:.2f} ± {sd:.2f}"


def run_trainer(
    cmd: list[str], run_dir: Path, *, env: dict | None = None, what: str = "dstrain"
) -> dict:
    """Run ``cmd`` (which must write ``run_dir``) from the repository root; its summary.json, plus ``command``,
    ``command_wall_s`` and ``stdout``."""
    if _stop["signal"]:
        raise SystemExit(f"{what}: not started, this bench was stopped ({_stop['signal']})")
    t0 = time.perf_counter()
    with (
        stop_signals_forwarded(),
        subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        ) as child,
    ):
        with _children_lock:
            _children.add(child)
        try:
            stdout, stderr = child.communicate()
        finally:
            with _children_lock:
                _children.discard(child)
        stopped = _stop["signal"]
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    if stopped:  # ended by the signal (a checkpoint) or just before it: the bench stops either way
        raise SystemExit(
            f"{what}: stopped ({stopped}, exit {proc.returncode}); what it checkpointed "
            f"resumes when the same command runs again: {shlex.join(cmd)}"
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


_children: set[subprocess.Popen] = set()  # the trainers running now, from any thread
_children_lock = threading.Lock()
_stop = {"signal": None, "installed": False}


def _on_stop(signum: int, frame) -> None:
    """SIGTERM/SIGINT: start no trainer from now on; SIGTERM goes on to the running ones (SIGINT
    from a terminal reached them already, as their process group's: a second one would stop them
    without a checkpoint). With none running, the bench stops as the signal's default would."""
    _stop["signal"] = signal.Signals(signum).name
    with _children_lock:
        running = [child for child in _children if child.poll() is None]
    if not running:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if signum == signal.SIGTERM:
        for child in running:
            child.send_signal(signum)
    print(
        f"bench: {_stop['signal']}: waiting for {len(running)} trainer(s) to checkpoint and stop",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def stop_signals_forwarded():
    """:func:`_on_stop` handles SIGTERM and SIGINT inside the block; the handlers before it are back
    after it. A no-op off the main thread (handlers can only be set there, so a bench that runs
    trainers from worker threads enters this in its main thread first) and when nested."""
    if _stop["installed"] or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum in before:
        signal.signal(signum, _on_stop)
    _stop.update(installed=True, signal=None)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        _stop.update(installed=False, signal=None)


def provenance(script: str, args: list[str] | None = None, command: str | None = None) -> dict:
    """dstrain.core.provenance.record for ``python bench/SCRIPT ARGS`` (default: this process's
    arguments; a SCRIPT with its folder, ``results/harness/ablation.py``, from the repository
    root), or for ``command`` as given (a launcher's, a trainer's)."""
    from dstrain.core.provenance import record

    if command is None:
        path = script if "/" in script else f"bench/{script}"
        command = f"python {path} " + shlex.join(sys.argv[1:] if args is None else args)
    return record(command)


def write_result(path: Path, result: dict, *, title: str, headline: str) -> Path:
    """A result file as results/evidence.py reads one: ``title`` and ``headline`` (one line of what
    it measured), then ``result``, which starts with :func:`provenance` (command, git SHA, date,
    machine). Written atomically: a reader never sees half a file, a failed write leaves the old."""
    data = {"title": title, "headline": headline, **result}
    missing = [k for k in ("command", "git_sha", "date", "machine") if not data.get(k)]
    if missing:
        raise ValueError(f"{path}: a result needs its provenance; missing {', '.join(missing)}")
    from dstrain.core.files import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    return path


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
