"""Ground floor: where a result came from (git SHA, host, library versions), for run directories and benches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


# benchmark and evidence result files are outputs, not code: rewriting one does not make the tree dirty
CODE = ["--", ".", ":(exclude)results/bench", ":(exclude)results/studies"]


def git_sha() -> str:
    """HEAD's SHA, with ``-dirty`` when tracked code differs from it; outside a checkout (a tree copied
    to a compute node without .git) ``$DSTRAIN_GIT_SHA`` as given, else ``unknown``."""
    if not (REPO_ROOT / ".git").exists():
        return os.environ.get("DSTRAIN_GIT_SHA", "unknown")
    git = ["git", "-C", str(REPO_ROOT)]
    try:
        sha = subprocess.run(
            git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        status = git + ["status", "--porcelain", "--untracked-files=no", *CODE]
        dirty = subprocess.run(status, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def uncommitted_diff() -> str:
    """What tracked code differs from HEAD by (``git diff HEAD``, result files left out): with the
    SHA, the code a ``-dirty`` run ran. '' for a clean tree or outside a checkout."""
    if not (REPO_ROOT / ".git").exists():
        return ""
    cmd = ["git", "-C", str(REPO_ROOT), "diff", "HEAD", "--no-color", *CODE]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu() -> dict:
    """The CPU's model and the vector ISA torch's CPU kernels dispatch on (``cpu_capability``):
    the same run trained on two machines can differ in its floats (docs/testing.md), so a record
    names the one it ran on."""
    import torch

    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        pass
    return {"model": model, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def environment() -> dict:
    """Host, CPU, Python, torch, DeepSpeed and GPU: what a number measured here depends on."""
    import torch

    try:
        import deepspeed

        deepspeed_version = deepspeed.__version__
    except ImportError:
        deepspeed_version = None
    return {
        "host": socket.gethostname(),
        "cpu": cpu(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed_version,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def record(command: str) -> dict:
    """The provenance every result file starts with: the command that made it, the commit (with
    ``-dirty``), the date, and the machine and libraries it ran on. One helper for every script."""
    import time

    env = environment()
    return {
        "command": command.strip(),
        "git_sha": git_sha(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(env),
        **env,
        "cpu_count": os.cpu_count(),
    }


def machine(env: dict) -> str:
    """One line naming what a number was measured on: the GPU (where one is), the CPU cores and
    model, torch: the ``machine`` of a result file (results/evidence.py)."""
    model = (env.get("cpu") or {}).get("model")
    cores = f"{os.cpu_count()} CPU cores" + (f" ({model})" if model else "")
    return ", ".join(x for x in (env.get("cuda"), cores, f"torch {env.get('torch')}") if x)
