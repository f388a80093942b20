"""What every process a test starts runs first: DeepSpeed's import guard, the exit dstrain's
commands make, and fault injection.

tests/conftest.py puts this folder on PYTHONPATH for every process the tests start; Python imports
``sitecustomize`` at start-up (every rank a launcher starts, and the launcher's own processes).

It installs dstrain/core/import_guard.py (loaded by its path: no dstrain import, no change to
``sys.path``), so that DeepSpeed's launcher processes, which import DeepSpeed before any dstrain
code, do not load MLflow through DeepSpeed's autotuner either (dstrain's ranks install it
themselves). And it spares those launcher processes most of the interpreter's teardown at exit,
as dstrain's commands skip it (dstrain/core/process.py): after their last ``atexit`` handler the
collector is frozen, so the teardown does not walk DeepSpeed's and torch's heap (half a second a
process; a launched run waits for its launch process, then for DeepSpeed's runner, to end). Their
exit status is theirs, so they are not ended by ``os._exit`` as dstrain's commands are.

Where a test sets one of the variables below, it patches dstrain's modules as they are imported:

``DSTRAIN_FAULT_KILL_AT_STEP=N``
    SIGKILL the process right after optimizer step N (before the step's checks).
``DSTRAIN_FAULT_KILL_IN_CHECKPOINT=TAG:PHASE``
    SIGKILL rank 0 inside the save of checkpoint TAG: ``written`` (every rank's files are in
    TAG.partial, not yet renamed) or ``renamed`` (TAG is complete, ``latest`` not yet moved).
``DSTRAIN_FAULT_STALL=PHASE:SECONDS[:RANK[:STEP]]``
    the main thread hangs for SECONDS the first time it enters PHASE (dstrain/loop/watchdog.py's
    PHASES) after at least STEP optimizer steps, on rank RANK only (default: every rank).
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

KILL_AT_STEP_ENV = "DSTRAIN_FAULT_KILL_AT_STEP"
KILL_IN_CHECKPOINT_ENV = "DSTRAIN_FAULT_KILL_IN_CHECKPOINT"
STALL_ENV = "DSTRAIN_FAULT_STALL"
VARIABLES = (KILL_AT_STEP_ENV, KILL_IN_CHECKPOINT_ENV, STALL_ENV)
log = logging.getLogger("dstrain.tests.inject")


@dataclass
class InjectedStall:
    """``DSTRAIN_FAULT_STALL``, parsed: hang in ``phase`` for ``seconds`` once ``after_step``
    optimizer steps are done."""

    phase: str
    seconds: float
    after_step: int = 0

    @classmethod
    def from_env(cls, rank: int) -> InjectedStall | None:
        spec = os.environ.get(STALL_ENV, "")
        if not spec:
            return None
        phase, seconds, *rest = spec.split(":")
        only_rank, after_step = (rest + ["", ""])[:2]
        if only_rank and int(only_rank) != rank:
            return None
        return cls(phase, float(seconds), int(after_step or 0))

    def due(self, phase: str, step: int) -> bool:
        return phase == self.phase and step >= self.after_step

    def hang(self) -> None:
        log.warning("%s: hanging for %g s in phase %s", STALL_ENV, self.seconds, self.phase)
        end = time.monotonic() + self.seconds
        # a Python signal handler runs between the sleeps and the hang goes on, as in native code
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def patch_trainer(module) -> None:
    trainer = module.Trainer
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV) or 0)
    if kill_at:
        after_step = trainer.after_step

        def killing_after_step(self):
            if self.state.step == kill_at:
                _kill()
            return after_step(self)

        trainer.after_step = killing_after_step
    if os.environ.get(STALL_ENV):
        from dstrain.core import dist

        phase, pending = trainer.phase, {}

        def stalling_phase(self, name: str) -> None:
            phase(self, name)
            stall = pending.setdefault("stall", InjectedStall.from_env(dist.rank()))
            if stall is not None and stall.due(name, self.state.step):
                pending["stall"] = None
                stall.hang()

        trainer.phase = stalling_phase


def patch_checkpoint(module) -> None:
    spec = os.environ.get(KILL_IN_CHECKPOINT_ENV)
    if not spec:
        return
    tag, where = spec.rsplit(":", 1)
    agree, write = module._agree_or_fail, module.atomic_write_text

    def agree_then_kill(partial, error):
        agree(partial, error)
        # the first agreement: every rank's files are in TAG.partial (then the manifest, the rename)
        if where == "written" and partial.name == f"{tag}.partial" and partial.exists():
            if module.dist.is_main():
                _kill()

    def kill_then_write(path, text, *args, **kwargs):
        if where == "renamed" and path.name == module.POINTER and text.strip() == tag:
            _kill()  # TAG renamed into place, ``latest`` not yet moved
        return write(path, text, *args, **kwargs)

    module._agree_or_fail, module.atomic_write_text = agree_then_kill, kill_then_write


PATCHES = {"dstrain.loop.trainer": patch_trainer, "dstrain.loop.checkpoint": patch_checkpoint}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Run PATCHES[name] on module ``name`` right after it is first executed."""

    busy = False

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _install_import_guard() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "dstrain" / "core" / "import_guard.py"
    spec = importlib.util.spec_from_file_location("_dstrain_import_guard", path)
    if spec is None or spec.loader is None:  # another checkout's layout: nothing to guard
        return
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    guard.install()


def _freeze_in_deepspeeds_launcher() -> None:
    """At exit (argv[0] is then the script or module run): freeze the collector in DeepSpeed's
    runner (the ``deepspeed`` command) and its per-node launch (``deepspeed.launcher.launch``)."""
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "deepspeed" or script.endswith(
        os.path.join("deepspeed", "launcher", "launch.py")
    ):
        gc.freeze()


_install_import_guard()
atexit.register(_freeze_in_deepspeeds_launcher)  # registered first, so it runs last
if any(os.environ.get(v) for v in VARIABLES):
    sys.meta_path.insert(0, _PatchOnImport())
