"""A process's log lines: rank 0 logs dstrain's INFO to stdout, other ranks and other libraries only
warnings, each line prefixed with its rank. Ground floor, no torch: a bad config is reported by a
process that never imports torch (its import alone is 1.6 s a process quiet on 2 cores:
results/bench/startup_cpu.json)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(stream=None) -> None:
    """Rank 0 logs dstrain's INFO to ``stream`` (stdout, or a command's stderr when its stdout is
    its result); other ranks, and other libraries, only warnings; lines of ranks other than 0 are
    prefixed with their rank."""
    rank = int(os.environ.get("RANK", "0"))
    prefix = "dstrain" if rank == 0 else f"dstrain[rank {rank}]"
    logging.basicConfig(
        level=logging.WARNING,  # other libraries' INFO (compiler lines of an op build, ...) stays off
        format=f"%(asctime)s {prefix} %(levelname).1s %(message)s",
        datefmt="%H:%M:%S",
        stream=stream or sys.stdout,
    )
    logging.getLogger("dstrain").setLevel(logging.INFO if rank == 0 else logging.WARNING)
