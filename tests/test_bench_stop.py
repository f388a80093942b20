"""A bench stopped with SIGTERM stops the trainers it runs (bench/common.py).

``pkill -TERM -f results/harness/accuracy_study.py`` reaches the study's process only: before, its trainers
(children the signal does not reach) trained on alone, and a study started again beside them
trained the same run directory twice. Played with stand-in trainers (a Python process that
"checkpoints" on SIGTERM and exits 75, as dstrain does) run from two worker threads, as
``accuracy_study.py --jobs 2`` runs them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.conftest import REPO

TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    run_dir = Path(sys.argv[1])
    run_dir.mkdir(parents=True, exist_ok=True)
    def stop(signum, frame):
        (run_dir / "checkpointed").write_text(signal.Signals(signum).name)
        sys.exit(75)
    signal.signal(signal.SIGTERM, stop)
    (run_dir / "pid").write_text(str(os.getpid()))
    time.sleep(float(sys.argv[2]))
    (run_dir / "summary.json").write_text("{}")
    """
)

BENCH = textwrap.dedent(
    """
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from bench.common import run_trainer, stop_signals_forwarded
    trainer, root = sys.argv[2], Path(sys.argv[3])
    def one(name):
        run_trainer([sys.executable, trainer, str(root / name), "60"], root / name, what=name)
    with stop_signals_forwarded(), ThreadPoolExecutor(2) as pool:
        # two at once, then a third once one ends: it must not start after the stop
        for future in [pool.submit(one, name) for name in ("a", "b", "c")]:
            future.result()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_a_bench_checkpoints_its_trainers_and_starts_no_other(tmp_path):
    trainer, bench = tmp_path / "trainer.py", tmp_path / "driver.py"
    trainer.write_text(TRAINER)
    bench.write_text(BENCH)
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, str(bench), str(REPO), str(trainer), str(runs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid_files = [runs / "a" / "pid", runs / "b" / "pid"]
    deadline = time.monotonic() + 60
    while not all(f.is_file() and f.read_text() for f in pid_files):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the stand-in trainers did not start"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pid_files]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)

    assert proc.returncode != 0
    for name in ("a", "b"):
        assert (runs / name / "checkpointed").read_text() == "SIGTERM"
    assert not any(_alive(pid) for pid in pids)
    assert not (runs / "c").exists(), "a trainer started after the stop"
    assert "stopped (SIGTERM, exit 75)" in err and "runs again" in err, err


def test_the_handlers_before_a_bench_are_back_after_it(tmp_path):
    """In-process (a test calling a bench's main): the handlers are the caller's again after it."""
    from bench.common import stop_signals_forwarded

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_signals_forwarded():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
