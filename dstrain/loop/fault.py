"""How a run stops when something goes wrong: signals, divergence, lost ranks (the ``fault.*`` config section).

The exit statuses are defined in dstrain/core/errors.py and tabled in docs/faults.md.
:class:`StepChecks` is what the training loop asks after every optimizer step:
did a rank receive SIGTERM/SIGINT (agreed over ranks), did the loss or the
weights go non-finite, did FP16 skip too many steps in a row.

Each rank records how it ended in ``RUN_DIR/ranks/rankNNNNN.json`` (host, pid,
state, exit status, message). A rank that finds a collective broken reads its
peers' records to name the rank that failed: a process that is gone without a
record, or the first record with a failure. ``dstrain.launch`` prints the same
table when a job fails.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.core import dist
from dstrain.core.errors import Diverged
from dstrain.core.files import atomic_write_text

log = logging.getLogger(__name__)

RANKS_DIR = "ranks"
# in a "preempted" record's message: the rank exited without writing a new checkpoint (the watchdog's
# exits after a signal's grace or a second signal); launch.sh tells these apart from a clean stop
NO_NEW_CHECKPOINT = "without a new checkpoint"
NO_BAD_STEP = 2**62  # "no non-finite loss seen" in the MIN all-reduce of first bad steps


# ---------------------------------------------------------------- signals
def signal_name(signum: int) -> str:
    """'SIGTERM' for 15; '' for 0 (no signal)."""
    return signal.Signals(signum).name if signum else ""


class StopSignals:
    """SIGTERM/SIGINT set a flag; the training loop agrees on it across ranks after each step.

    The handler only records the signal: the step in flight finishes, every rank
    stops after the same step, a checkpoint is written, and the run exits 75.

    A Python handler runs only when the main thread runs Python code, and never while it is
    stuck in native code (a hung kernel, a collective). So :meth:`install` also sets a
    wake-up socket: CPython's C-level handler writes each signal's number to it at once,
    and :class:`dstrain.loop.watchdog.Watchdog`'s thread reads it (:meth:`received`) to bound
    the step in flight (``fault.signal_grace_s``) and to exit on a second signal. The loop
    calls :meth:`acknowledge` once it has stopped stepping and writes its checkpoint.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        self.acknowledged = False
        self.wakeup: socket.socket | None = None  # read end; None before install / after restore
        self._wakeup_write: socket.socket | None = None
        self._previous: dict = {}
        self._previous_wakeup: int | None = None

    def install(self) -> None:
        """Our handlers and the wake-up socket (call from the main thread)."""
        for s in self.SIGNALS:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)  # set_wakeup_fd requires it
        self._previous_wakeup = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        self.wakeup, self._wakeup_write = read, write

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum

    @property
    def name(self) -> str:
        return signal_name(self.signum)

    def acknowledge(self) -> None:
        """The loop has stopped stepping and now writes its checkpoint: the grace for the step ends."""
        self.acknowledged = True

    def received(self) -> list[int]:
        """SIGTERM/SIGINT numbers that arrived since the last call, from the wake-up socket (any thread;
        [] once restored). Other signals with a Python handler write there too; they are dropped."""
        wakeup = self.wakeup
        try:
            data = wakeup.recv(4096) if wakeup is not None else b""
        except OSError:  # nothing there (BlockingIOError), or closed by restore() meanwhile
            return []
        return [signum for signum in data if signum in self.SIGNALS]

    def restore(self) -> None:
        """Put back exactly the handlers that were there before :meth:`install` (SIG_IGN included) and the
        previous wake-up fd; close the wake-up socket."""
        for s, handler in self._previous.items():
            # None: set outside Python
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
        if self._previous_wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            self._previous_wakeup = None
        sockets, self.wakeup, self._wakeup_write = (self.wakeup, self._wakeup_write), None, None
        for sock in sockets:
            if sock is not None:
                sock.close()


# ---------------------------------------------------------------- divergence
class NonFiniteWatch:
    """The first optimizer step whose loss was NaN/inf, tracked on the device (no host sync per step).

    :meth:`first_bad_step` (a collective: the MIN over ranks, one host sync) is
    called at log windows, at the end of each epoch and before any checkpoint.
    """

    def __init__(self, device: torch.device):
        self.bad = torch.full((), NO_BAD_STEP, dtype=torch.int64, device=device)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        self.bad.masked_fill_(~torch.isfinite(loss.detach()) & (self.bad == NO_BAD_STEP), step)

    def first_bad_step(self, all_reduce_min) -> int | None:
        step = int(all_reduce_min(self.bad.clone()).item())
        return None if step == NO_BAD_STEP else step


def params_finite(module: torch.nn.Module) -> bool:
    flags = [p.detach().isfinite().all() for p in module.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True


class SkipCounter:
    """FP16 steps skipped by the dynamic loss scaler (an overflow in the gradients).

    ``update(skipped_total, step)`` takes the running count after each optimizer step
    (``scale``: the loss scale, or a function returning it, read only for a warning);
    ``limit`` consecutive skips (0 = no limit) stop the run: the loss scale has then been
    halved ``limit`` times without a finite gradient.
    """

    def __init__(self, limit: int):
        self.limit, self.total, self.consecutive, self.first_of_run = limit, 0, 0, 0

    def update(self, skipped_total: int, step: int, scale=None) -> None:
        new = skipped_total - self.total
        self.total = skipped_total
        if new <= 0:
            self.consecutive = 0
            return
        if self.consecutive == 0:
            self.first_of_run = step
        self.consecutive += new
        if self.consecutive in (1, 8) or self.consecutive % 32 == 0:
            log.warning(
                "step %d: FP16 gradient overflow, step skipped (%d in a row, %d in total, loss scale now %s)",
                step,
                self.consecutive,
                self.total,
                scale() if callable(scale) else scale,
            )
        if self.limit and self.consecutive >= self.limit:
            raise Diverged(
                f"{self.consecutive} consecutive FP16 steps skipped for gradient overflow (steps "
                f"{self.first_of_run}-{step}, limit fault.max_consecutive_skips={self.limit}): the "
                "loss scale cannot find finite gradients"
            )


def divergence_message(what: str, step: int, epoch: int, checkpoint: Path | None) -> str:
    last = (
        f"the last good checkpoint is {checkpoint} (resume=auto continues from it)"
        if checkpoint
        else "no checkpoint was written yet"
    )
    return (
        f"{what} at step {step} (epoch {epoch + 1}); the run stopped, {last}. Lower the learning rate "
        "(optim.base_lr), lengthen optim.warmup_epochs or set gradient_clipping in the DeepSpeed JSON"
    )


# ---------------------------------------------------------------- the loop's per-step checks
@dataclass
class StepChecks:
    """What the training loop checks after every optimizer step: stop signals, divergence, FP16 skips."""

    signals: StopSignals
    nonfinite: NonFiniteWatch
    skips: SkipCounter
    last_checkpoint: Path | None = None
    _pending: tuple | None = None  # the stop-flag all-reduce started at the previous call

    @classmethod
    def create(
        cls, signals: StopSignals, device: torch.device, max_consecutive_skips: int
    ) -> StepChecks:
        return cls(signals, NonFiniteWatch(device), SkipCounter(max_consecutive_skips))

    def stop_requested(self) -> str:
        """The signal any rank had received by the previous call, agreed over ranks, or ''.

        Multi-rank: each call waits for the tiny CPU all-reduce the previous call started (long done by
        then: it ran during a whole step) and starts the next one, so agreeing costs no step a wait; every
        rank stops after the same step, one step after the signal."""
        if dist.world_size() == 1:
            return self.signals.name
        agreed = self.drain()
        self._pending = dist.host_all_reduce_async([float(self.signals.signum)], "max")
        return agreed

    def drain(self) -> str:
        """Finish the outstanding stop-flag all-reduce (every rank has one); the signal it agreed on, or ''."""
        signum = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            signum, self._pending = int(flag.item()), None
        return signal_name(signum)

    def stop_requested_now(self) -> str:
        """Agree on the signals received until now (a blocking all-reduce: once per epoch, at its end)."""
        if dist.world_size() == 1:
            return self.signals.name
        earlier = self.drain()
        signum = int(dist.host_all_reduce([float(self.signals.signum)], "max")[0])
        return earlier or signal_name(signum)

    def check_finite(self, step: int, epoch: int, module: torch.nn.Module | None = None) -> None:
        """Raise Diverged if any rank saw a NaN/inf loss (or, with ``module``, holds non-finite weights)."""
        bad = self.nonfinite.first_bad_step(dist.all_reduce_min)
        if bad is not None:
            raise Diverged(
                divergence_message("non-finite loss (NaN/inf)", bad, epoch, self.last_checkpoint)
            )
        if (
            module is not None
            and dist.host_all_reduce([0.0 if params_finite(module) else 1.0], "max")[0]
        ):
            raise Diverged(
                divergence_message("non-finite weights", step, epoch, self.last_checkpoint)
            )


# ---------------------------------------------------------------- lost ranks
# gloo's own messages carry its source file ("[.../gloo/...cc:N] ..."), except the one a timed-out
# recv signals to every other pair of its context: "Application timeout caused pair closure"
COLLECTIVE_FAILURE = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|timed out|timeout|pair closure|broken pipe|"
    r"processgroup|watchdog|socket",
    re.IGNORECASE,
)


def is_collective_failure(err: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", ())
    if dist_error and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and bool(COLLECTIVE_FAILURE.search(str(err)))


def process_state(pid: int) -> str:
    """'gone' (no process, or a zombie nobody reaped yet), else the state letter of /proc/PID/stat
    (R running, S sleeping, D uninterruptible I/O, T stopped) or '?' where /proc cannot tell."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "?"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return "?"
    return "gone" if state in "ZX" else state


ALIVE_VERDICT = {
    "T": "process alive but stopped (SIGSTOP, a debugger)",
    "D": "process alive but stuck in uninterruptible I/O (a hung file system or device)",
}


class RankRecords:
    """``RUN_DIR/ranks/rankNNNNN.json``: who each rank is and how it ended (each rank writes its own)."""

    def __init__(self, run_dir: Path, rank: int, world: int):
        self.dir, self.rank, self.world = run_dir / RANKS_DIR, rank, world
        self.path = self.dir / f"rank{rank:05d}.json"

    def start(self, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # a resume on fewer ranks: the ranks beyond this job's are not in it
            for path in self.dir.glob("rank*.*"):
                number = path.stem.removeprefix("rank")
                if number.isdigit() and int(number) >= self.world:
                    path.unlink(missing_ok=True)
        self._write({"state": "running", "step": step})
        # a native crash (SIGSEGV, SIGABRT from "free(): invalid pointer", ...) leaves no record: Python's
        # fault handler writes which signal and where (every thread's stack) to rankNNNNN.crash instead
        # open until the process exits
        self._crash_file = open(self.dir / f"rank{self.rank:05d}.crash", "w")
        faulthandler.enable(file=self._crash_file, all_threads=True)

    def finish(
        self, state: str, exit_code: int, message: str = "", step: int | None = None
    ) -> None:
        if self.dir.is_dir():
            self._write({"state": state, "exit_code": exit_code, "message": message, "step": step})

    def _write(self, fields: dict) -> None:
        record = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            **fields,
            # what reached this rank of the job's environment: on several nodes, what the launcher
            # exported (docs/multinode.md), the first thing to look at when a node cannot join
            "env": {k: v for k, v in os.environ.items() if k.startswith(RECORDED_ENV)},
        }
        try:
            atomic_write_text(self.path, json.dumps(record) + "\n")
        except OSError as err:  # a full disk must not hide the real error
            log.warning("could not write %s: %s", self.path, err)

    def peers(self) -> list[dict]:
        return read_records(self.dir.parent, self.world)


RECORDED_ENV = (
    "DSTRAIN_",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def read_records(run_dir: Path, world: int | None = None) -> list[dict]:
    """Every rank's record (a missing one as ``{"rank": r, "state": "no record"}``), with ``verdict`` added."""
    folder = run_dir / RANKS_DIR
    found = {}
    for path in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
            found[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError):
            continue
    world = world or (max(found) + 1 if found else 0)
    here = socket.gethostname()
    out = []
    for r in range(world):
        rec = found.get(r, {"rank": r, "state": "no record"})
        crash = crash_report(folder / f"rank{r:05d}.crash")
        if crash:
            rec["crash"] = crash
        if rec["state"] == "running" and crash:
            rec["verdict"] = f"process crashed: {crash}"
        elif rec["state"] == "running":
            state = process_state(int(rec["pid"])) if rec.get("host") == here else ""
            if state == "gone":
                rec["verdict"] = (
                    "process gone without a word (killed: SIGKILL, out of memory, a crash)"
                )
            elif state:
                rec["verdict"] = ALIVE_VERDICT.get(state, "process alive but not answering (stuck)")
            else:
                rec["verdict"] = "no final record (the process or its node died, or it is stuck)"
        elif rec["state"] == "no record":
            rec["verdict"] = "never started"
        else:
            rec["verdict"] = (
                f"{rec['state']} (exit {rec.get('exit_code')}): {rec.get('message', '')}"
            )
        out.append(rec)
    return out


def crash_report(path: Path) -> str:
    """'Fatal Python error: Aborted, in <function> (<file>:<line>)' from a fault-handler file, or ''."""
    try:
        lines = [
            line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()
        ]
    except OSError:
        return ""
    if not lines:
        return ""
    frames = [line for line in lines if line.startswith("File ")]
    # the innermost frame comes first
    where = f", in {frames[0].removeprefix('File ')}" if frames else ""
    return f"{lines[0]}{where}"


def failed_ranks(records: list[dict], me: int) -> list[dict]:
    """The ranks to blame: silent (still 'running' on record), then those that recorded a failure."""
    silent = [r for r in records if r["rank"] != me and r["state"] in ("running", "no record")]
    if silent:
        return silent
    return [
        r
        for r in records
        if r["rank"] != me and r["state"] not in ("done", "lost_peer", "preempted")
    ]


def describe_lost(records: list[dict], me: int, what: str, timeout_s: float) -> str:
    blamed = failed_ranks(records, me)
    if blamed:
        who = "; ".join(
            f"rank {r['rank']} (pid {r.get('pid', '?')} on {r.get('host', '?')}): {r['verdict']}"
            for r in blamed[:4]
        )
        who = who.rstrip(".") + (f" and {len(blamed) - 4} more" if len(blamed) > 4 else "")
    else:
        cut = [r for r in records if r["rank"] != me and r["state"] == "lost_peer"]
        who = (
            "; ".join(f"rank {r['rank']} (on {r.get('host', '?')})" for r in cut[:4])
            + (f" and {len(cut) - 4} more" if len(cut) > 4 else "")
            + " lost contact too and none crashed: the network between the ranks failed, or a "
            "node stalled"
            if cut
            else "no peer recorded a failure"
        )
    return (
        f"lost contact with another rank: {who}. The collective failed with: {what} "
        f"(fault.collective_timeout_s={timeout_s:g})"
    )


def wait_for_records(records: RankRecords, seconds: float = 3.0) -> list[dict]:
    """Peers that failed on their own write their record within moments; give them that long."""
    deadline = time.monotonic() + seconds
    while True:
        peers = records.peers()
        stuck = [r for r in peers if r["rank"] != records.rank and "alive" in r.get("verdict", "")]
        if not stuck or time.monotonic() > deadline:
            return peers
        time.sleep(0.25)
