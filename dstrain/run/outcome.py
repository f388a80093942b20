"""How a run ended, decided once and recorded once.

Every way a run can end has a state and an exit status (dstrain/core/errors.py): done, preempted,
diverged, lost_peer, stalled, checkpoint_failed, bad_input (a config error), error (a crash).
:func:`ending_of` maps whatever ended a run to that pair and the one line the user reads;
:class:`Outcome` is the context around the part of a run that has a run directory: whichever way
the block ends (it returns, it raises, or the watchdog ends the process and calls :meth:`end`), the
rank's record (``RUN_DIR/ranks/``, what ``launch.sh`` reports from) is written once, the run
directory is marked failed when no checkpoint exists yet, and what was registered with
:meth:`on_end` (the TensorBoard writer) is closed, once. The polish command ends through
:func:`ending_of` too, so both commands report a stop with the same state, status and line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dstrain.core.errors import EXIT_ERROR, EXIT_OK, ConfigError, RunStopped, first_line
from dstrain.loop import fault
from dstrain.run import rundir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ending:
    state: str  # done | preempted | diverged | lost_peer | stalled | checkpoint_failed | bad_input | error
    exit_code: int
    message: str = ""


DONE = Ending("done", EXIT_OK)


def mark_failed_start(run_dir: Path, err: BaseException) -> None:
    """A run that stopped after choosing its directory but before :class:`Outcome` began (while
    building): the directory is marked failed with the same state, status and line."""
    ending = ending_of(err)
    rundir.mark_failed(run_dir, ending.state, ending.exit_code, ending.message)


def ending_of(err: BaseException) -> Ending:
    """The state, exit status and line of what stopped a run: a stop dstrain decided on (its own
    state and status), bad input (2), or anything else, a crash (1, its first line)."""
    if isinstance(err, (ConfigError, RunStopped)):
        return Ending(err.state, err.exit_code, str(err))
    return Ending("error", EXIT_ERROR, first_line(err))


class Outcome:
    """``with Outcome(run_dir, rank, world, step) as outcome: ...`` records how the block ended.

    ``step()`` gives the optimizer step to record. A ``done`` is recorded only when the block
    returns; an exception is recorded with :func:`ending_of` and re-raised. :meth:`end` may also be
    called from another thread (the watchdog, just before it ends the process): the first call wins.
    """

    def __init__(self, run_dir: Path, rank: int, world: int, step: Callable[[], int] = lambda: 0):
        self.run_dir, self.step = run_dir, step
        self.records = fault.RankRecords(run_dir, rank, world)
        self.ending: Ending | None = None
        self._closers: list[Callable[[], None]] = []

    def on_end(self, close: Callable[[], None]) -> None:
        """Call ``close`` once when the run ends, before its record is written."""
        self._closers.append(close)

    def end(self, state: str, exit_code: int, message: str = "", close: bool = True) -> None:
        """Record the ending (the first call only). ``close=False``: the watchdog's call, from its
        own thread while the main thread may be stuck anywhere; the process exits right after."""
        if self.ending is not None:
            return
        self.ending = Ending(state, exit_code, message)
        for close_one in self._closers if close else []:
            try:
                close_one()
            except Exception as err:  # closing a writer must not hide how the run ended
                log.warning("while ending the run (%s): %s", state, first_line(err))
        self.records.finish(state, exit_code, message, self.step())
        if state != DONE.state:  # before the first checkpoint: the directory says it failed
            rundir.mark_failed(self.run_dir, state, exit_code, message)

    def __enter__(self) -> Outcome:
        self.records.start(self.step())
        return self

    def __exit__(self, kind, err, tb) -> bool:
        ending = DONE if err is None else ending_of(err)
        self.end(ending.state, ending.exit_code, ending.message)
        return False  # an exception goes on to the command, which prints its line
