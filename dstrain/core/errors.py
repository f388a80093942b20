"""Ground floor: the errors a run reports to its user, and every exit status, defined once.

Imports nothing of dstrain. Every way a run can end has its own exit status
(docs/faults.md):

====  =====================================================================
0     finished
1     an unexpected error (a traceback follows)
2     bad input: config, JSON, data, run directory (one ``dstrain: error:`` line)
3     diverged: a non-finite loss or weights, or too many consecutive FP16 overflow skips
4     lost a rank: a collective failed or timed out (``fault.collective_timeout_s``)
5     a checkpoint could not be written (disk full, permissions)
6     stalled: no progress for ``fault.stall_timeout_s``; every thread's stack is printed
75    stopped by SIGTERM/SIGINT after writing a checkpoint, or without one when the step in flight
      outlasted ``fault.signal_grace_s`` or a second signal came; ``resume=auto`` continues
====  =====================================================================

75 is ``EX_TEMPFAIL`` of sysexits.h ("try again later"): a job script can requeue on it.
"""

from __future__ import annotations

import re

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_PEER_LOST = 4
EXIT_CHECKPOINT = 5
EXIT_STALLED = 6
EXIT_PREEMPTED = 75


class ConfigError(Exception):
    """Bad input (config, JSON, data, run directory); the message names the key or file and the fix."""

    exit_code = EXIT_CONFIG
    state = "bad_input"


class RunStopped(Exception):
    """The run stopped on purpose; ``str(err)`` is the one line for the user, ``exit_code`` the status."""

    exit_code = EXIT_ERROR
    state = "error"


class Diverged(RunStopped):
    exit_code, state = EXIT_DIVERGED, "diverged"


class PeerLost(RunStopped):
    """``said_by_peer``: every rank to blame stopped on bad input and printed that line itself; this
    rank's report then goes to stdout, so a bad input is one error line however many ranks see it."""

    exit_code, state = EXIT_PEER_LOST, "lost_peer"

    def __init__(self, message: str, said_by_peer: bool = False):
        super().__init__(message)
        self.said_by_peer = said_by_peer


class CheckpointWriteError(RunStopped):
    exit_code, state = EXIT_CHECKPOINT, "checkpoint_failed"


class Stalled(RunStopped):
    """No progress within ``fault.stall_timeout_s`` (dstrain/loop/watchdog.py ends the process itself)."""

    exit_code, state = EXIT_STALLED, "stalled"


class Preempted(RunStopped):
    exit_code, state = EXIT_PREEMPTED, "preempted"


def first_line(err: BaseException) -> str:
    """The first sentence of an error, without a ``[file.cc:N]`` prefix (gloo's) or the advice after it."""
    text = str(err).strip().splitlines()
    if not text:
        return type(err).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", text[0])
    return re.split(r"\.\s+(?=[A-Z])", line)[0]
