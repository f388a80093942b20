"""How a dstrain command's process ends: :func:`run`, the whole of every entry point that imports
torch (``python -m dstrain``, the ``dstrain`` command, ``deepspeed dstrain/main.py``, and the
evaluate, polish and export commands)."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

_status: int | None = None  # set by run once the command returned its exit status


def run(main: Callable[[], int]) -> NoReturn:
    """Run ``main`` and exit with its status, without the interpreter's finalisation.

    After the ``atexit`` handlers, finalising the interpreter tears down every module and runs the
    cycle collector over everything still alive, several times: half a second a process holding
    torch and DeepSpeed on a 2-core CPU (bench/startup.py's ``exit_saves_s``), more with a model
    and its engine, paid by every rank of every run, evaluation and polish; and where
    torch.compile loaded Triton, its nanobind bindings print a page of "leaked" objects at that
    teardown. So once ``main`` has returned, the process ends the way a forked multiprocessing
    child does: the non-daemon threads joined and every ``atexit`` handler run as Python runs them
    (the handler registered here, first, runs last), logging shut down and stdout/stderr flushed
    (Python's and the C library's), then ``os._exit``. Everything a command writes is closed
    before it returns (checkpoints, summary, TensorBoard, the trackers). A command that raises, or
    exits through ``sys.exit`` itself (argparse's ``--help``), ends as Python ends it.

    So does a rank of a multi-rank job that fails: DeepSpeed's launcher kills every other rank as
    soon as one exits with an error, and its peers, stopping for the same reason, are then still
    writing their own line and record (``RUN_DIR/ranks/``); a rank leaving at once cut them off.
    """
    global _status
    atexit.register(_end_now)  # before the command registers its own: runs after them
    status = main()
    if status == 0 or int(os.environ.get("WORLD_SIZE") or 1) == 1:
        _status = status
    sys.exit(status)


def _end_now() -> None:
    if _status is None:  # the command did not return: the interpreter ends the process
        return
    logging.shutdown()  # where logging was imported before run, its own handler would run after
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing to flush
            pass
    try:  # native libraries' C stdio buffers, which exit() flushes and os._exit does not
        ctypes.CDLL(None).fflush(None)
    except (AttributeError, OSError):  # no C library to ask: nothing more to flush
        pass
    os._exit(_status)
