"""A run that makes no progress, or cannot stop in time, ends itself (the ``fault.*`` section, issue 18).

The training loop marks where it is with :meth:`Watchdog.phase` (one of :data:`PHASES`): a name
and a time, nothing else (no lock, no host sync, no logging). A daemon thread ends the process:

- **stalled** (exit 6): a phase lasts longer than ``fault.stall_timeout_s``;
- **preempted** (exit 75, no new checkpoint): the loop has not acknowledged a SIGTERM/SIGINT
  (:meth:`~dstrain.loop.fault.StopSignals.acknowledge`) within ``fault.signal_grace_s``, or a second
  signal came 2 s or more after the first.

Either way it prints every thread's Python stack and one ``dstrain: error|stopped: ...`` line
on stderr, writes the rank's record (``RUN_DIR/ranks/``) and calls ``os._exit``. None of this
needs the main thread, which may be stuck in native code, where Python signal handlers never
run: the signals come from :class:`~dstrain.loop.fault.StopSignals`' wake-up socket, which CPython's
C-level handler writes at once. The watchdog never writes or deletes a checkpoint: the last
complete one stays, and ``resume=auto`` continues from it.

Tests hang the main thread in a phase from outside dstrain's code (tests/inject/sitecustomize.py).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dstrain.core import dist
from dstrain.core.errors import Preempted, Stalled
from dstrain.loop.fault import NO_NEW_CHECKPOINT, StopSignals, signal_name

log = logging.getLogger(__name__)

# what each phase waits for, said when it stalls
PHASES = {
    "data": "the data loader delivered no batch (a hung file system, a dead loader worker)",
    "forward/backward": (
        "the forward or backward pass did not return (a hung kernel; with more than one rank and no "
        "dstrain_communication block, DeepSpeed's gradient all-reduce runs inside backward, so a "
        "stuck peer shows here too)"
    ),
    "collective": (
        "a collective (gradient sync, BN sync, stop-flag or NaN check) waits for every rank: the "
        "stuck one may be another rank (RUN_DIR/ranks/ holds each rank's record)"
    ),
    "optimizer": "the optimizer step did not return",
    "checkpoint": "the checkpoint write did not finish (a slow or hung file system)",
    "evaluation": "an evaluation batch did not finish",
    "polish": "a Final Polishing batch did not finish",
}
# within this of the first signal, more signals are the same stop: a launcher forwarding the
# scheduler's SIGTERM, Ctrl-C reaching every process of a terminal
SAME_STOP_S = 2.0


class Watchdog:
    """``phase(name)`` from the loop; a thread between :meth:`start` and :meth:`stop` that ends a stuck run.

    ``stall_timeout_s`` / ``grace_s`` of 0 switch that bound off; a second signal always exits.
    ``exit_process`` (``os._exit``) and ``stream`` (stderr) are replaceable for in-process tests.
    """

    def __init__(
        self,
        stall_timeout_s: float,
        grace_s: float = 0.0,
        signals: StopSignals | None = None,
        *,
        exit_process: Callable[[int], None] = os._exit,
        stream=None,
    ):
        self.stall_timeout_s, self.grace_s, self.signals = stall_timeout_s, grace_s, signals
        self.exit_process, self.stream = exit_process, stream
        self._mark = ("data", time.monotonic())  # (phase, since): one assignment, read whole
        self._first: tuple[int, float] | None = None  # (signum, monotonic time) of the first signal
        self._thread: threading.Thread | None = None

    def phase(self, name: str) -> None:
        """The main thread enters phase ``name`` (a key of :data:`PHASES`): progress."""
        self._mark = (name, time.monotonic())

    @contextmanager
    def running(
        self, report: Callable[[str, int, str], None], note: Callable[[], str]
    ) -> Iterator[Watchdog]:
        """:meth:`start` ... :meth:`stop` around a block, whichever way the block ends."""
        self.start(report, note)
        try:
            yield self
        finally:
            self.stop()

    def start(
        self,
        report: Callable[[str, int, str], None] = lambda state, code, message: None,
        note: Callable[[], str] = lambda: "",
    ) -> None:
        """Watch from now. Before exiting, the thread calls ``report(state, exit_code, message)`` (the rank's
        record); ``note()`` ends its message: the step, and where ``resume=auto`` continues from."""
        self._report, self._note = report, note
        self._prefix = "dstrain" if dist.world_size() == 1 else f"dstrain[rank {dist.rank()}]"
        self.phase(self._mark[0])
        self._stop_read, self._stop_write = socket.socketpair()
        self._thread = threading.Thread(target=self._watch, name="dstrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it does not exit the process)."""
        if self._thread is None:
            return
        self._stop_write.send(b"x")
        self._thread.join()
        self._thread = None
        self._stop_read.close()
        self._stop_write.close()

    # ------------------------------------------------------------ the thread
    def _watch(self) -> None:
        while True:
            if self._stop_read in self._wait(self._timeout(time.monotonic())):
                return
            verdict = self._check(time.monotonic())
            if verdict is not None:
                self._fire(*verdict)
                return

    def _timeout(self, now: float) -> float | None:
        """Seconds until the next bound could be passed; None: none is running (wait for a signal or stop)."""
        deadlines = []
        if self.stall_timeout_s:
            deadlines.append(self._mark[1] + self.stall_timeout_s)
        if self._grace_running():
            deadlines.append(self._first[1] + self.grace_s)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _wait(self, timeout: float | None) -> list:
        wakeup = self.signals.wakeup if self.signals is not None else None
        sources = [self._stop_read] + ([wakeup] if wakeup is not None else [])
        try:
            return select.select(sources, [], [], timeout)[0]
        except (OSError, ValueError):  # StopSignals.restore() closed the wake-up socket meanwhile
            return []

    def _grace_running(self) -> bool:
        signals = self.signals
        return bool(
            self.grace_s
            and self._first is not None
            and signals is not None
            and signals.wakeup is not None  # not restored (polish: default handlers again)
            and not signals.acknowledged
        )

    def _check(self, now: float) -> tuple[str, int, str] | None:
        """(state, exit status, message) when a bound is passed, else None."""
        phase, since = self._mark
        for signum in self.signals.received() if self.signals is not None else []:
            if self._first is None:
                self._first = (signum, now)
            elif now - self._first[1] >= SAME_STOP_S:
                first, at = self._first
                return (
                    Preempted.state,
                    Preempted.exit_code,
                    f"second signal ({signal_name(signum)}, {now - at:.0f} s after {signal_name(first)}) "
                    f"in phase {phase}: exiting at once {NO_NEW_CHECKPOINT} {self._note()}",
                )
        if self._grace_running() and now - self._first[1] >= self.grace_s:
            first, at = self._first
            return (
                Preempted.state,
                Preempted.exit_code,
                f"{signal_name(first)} received {now - at:.0f} s ago and the step in flight (phase "
                f"{phase}) did not finish within fault.signal_grace_s={self.grace_s:g}: exiting "
                f"{NO_NEW_CHECKPOINT} {self._note()}",
            )
        if self.stall_timeout_s and now - since >= self.stall_timeout_s:
            return (
                Stalled.state,
                Stalled.exit_code,
                f"stalled: no progress for {now - since:.0f} s in phase {phase} "
                f"(fault.stall_timeout_s={self.stall_timeout_s:g}): {PHASES.get(phase, phase)}; "
                f"every thread's stack is on stderr. Exiting {self._note()}. If this phase can "
                "take that long, raise fault.stall_timeout_s (0 = off)",
            )
        return None

    def _fire(self, state: str, code: int, message: str) -> None:
        """Stacks, the one line, the record, flush everything, exit. Each part may fail; the exit may not."""
        stream = self.stream or sys.stderr
        kind = "stopped" if code == Preempted.exit_code else "error"
        try:
            stream.write(f"{self._prefix}: watchdog: every thread's stack ({state}):\n")
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.write(
                f"{self._prefix}: {kind}: {message}\n"
            )  # one write: ranks' lines stay whole
        except Exception as err:  # a closed stderr must not keep a stuck run alive
            log.error("watchdog: could not print: %s; %s", err, message)
        try:
            self._report(state, code, message)
        except Exception as err:
            log.error("watchdog: could not write the rank record: %s", err)
        for out in (stream, sys.stdout, *logging.getLogger().handlers):
            try:
                out.flush()
            except Exception:  # exiting anyway
                pass
        self.exit_process(code)
