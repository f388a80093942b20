"""dstrain/loop/fault.py piece by piece, in one process: FP16 skip limit, NaN tracking, rank records and
who gets blamed, stop signals, native crashes (the faults injected into real runs: test_faults.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dstrain.core.errors import Diverged, first_line
from dstrain.loop import fault


def test_consecutive_fp16_skips_stop_the_run_at_the_limit():
    skips = fault.SkipCounter(limit=3)
    totals = [
        0,
        1,
        2,
        2,
        3,
        4,
    ]  # the engine's running skipped_steps after steps 1..6: a good step at 4
    for step, total in enumerate(totals, 1):
        skips.update(total, step, scale=2.0**-step)
    assert skips.total == 4 and skips.consecutive == 2
    with pytest.raises(
        Diverged,
        match=r"3 consecutive FP16 steps skipped .*steps 5-7.*"
        r"fault.max_consecutive_skips=3",
    ):
        skips.update(5, 7)
    assert Diverged.exit_code == 3


def test_no_skip_limit_when_zero():
    skips = fault.SkipCounter(limit=0)
    for step in range(1, 200):
        skips.update(step, step)
    assert skips.consecutive == 199


def test_nonfinite_watch_remembers_the_first_bad_step_without_host_syncs():
    watch = fault.NonFiniteWatch(torch.device("cpu"))
    for step, loss in enumerate([1.0, 0.5, float("nan"), float("inf"), 0.3], 1):
        watch.observe(torch.tensor(loss), step)
    assert watch.first_bad_step(lambda t: t) == 3
    clean = fault.NonFiniteWatch(torch.device("cpu"))
    clean.observe(torch.tensor(1.0), 1)
    assert clean.first_bad_step(lambda t: t) is None


def test_params_finite():
    model = torch.nn.Linear(3, 2)
    assert fault.params_finite(model)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert not fault.params_finite(model)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "[/x/gloo/pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer. This is typically caused by",
            True,
        ),
        (
            "[/x/gloo/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete",
            True,
        ),
        # no source-file prefix: what a rank whose link was cut got in CI (gloo's
        # context->signalException after another pair's recv timed out)
        ("Application timeout caused pair closure", True),
        ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", False),
    ],
)
def test_collective_failures_are_told_from_bugs(text, expected):
    assert fault.is_collective_failure(RuntimeError(text)) is expected
    if expected:
        assert not first_line(RuntimeError(text)).startswith("[")
        assert "typically" not in first_line(RuntimeError(text))


def write_record(run_dir, rank, **fields):
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    rec = {"rank": rank, "host": os.uname().nodename, "pid": os.getpid(), "time": 0, **fields}
    (run_dir / "ranks" / f"rank{rank:05d}.json").write_text(json.dumps(rec))


def test_records_blame_the_silent_rank_whose_process_is_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: the pid no longer exists
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(stopped.pid, signal.SIGSTOP)
    for _ in range(100):  # the signal is delivered asynchronously: on a busy machine, wait for it
        if Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            break
        time.sleep(0.05)
    try:
        write_record(tmp_path, 0, state="lost_peer", exit_code=4, message="lost")
        write_record(tmp_path, 1, state="running", pid=dead.pid)
        write_record(tmp_path, 2, state="running", pid=stopped.pid)
        write_record(tmp_path, 3, state="running", host="elsewhere", pid=1)
        records = fault.read_records(tmp_path, world=5)
        verdicts = [r["verdict"] for r in records]
        assert verdicts[1].startswith("process gone without a word")
        assert verdicts[2].startswith("process alive but stopped")
        assert verdicts[3].startswith("no final record")
        assert verdicts[4] == "never started"
        assert [r["rank"] for r in fault.failed_ranks(records, me=0)] == [1, 2, 3, 4]
        msg = fault.describe_lost(records, 0, "Connection reset by peer", 600)
        assert msg.startswith(f"lost contact with another rank: rank 1 (pid {dead.pid}")
    finally:
        stopped.kill()
        stopped.wait()


def test_when_nobody_is_silent_the_first_recorded_failure_is_blamed(tmp_path):
    write_record(tmp_path, 0, state="lost_peer", exit_code=4, message="lost")
    write_record(
        tmp_path, 1, state="bad_input", exit_code=2, message="corrupt image: /d/x.JPEG (truncated)"
    )
    blamed = fault.failed_ranks(fault.read_records(tmp_path, 2), me=0)
    assert [r["rank"] for r in blamed] == [1] and "corrupt image" in blamed[0]["verdict"]


def test_launcher_report_and_exit_status(tmp_path, capsys):
    from dstrain.run.launch import report

    write_record(tmp_path, 0, state="preempted", exit_code=75, message="stopped")
    write_record(tmp_path, 1, state="preempted", exit_code=75, message="stopped")
    assert (
        report(tmp_path, 1) == 75
    )  # DeepSpeed's launcher says 1 after a SIGTERM; the ranks say 75
    assert "every rank stopped with a checkpoint" in capsys.readouterr().out
    late = "SIGTERM received 20 s ago ...: exiting without a new checkpoint at step 7"
    write_record(tmp_path, 1, state="preempted", exit_code=75, message=late)
    assert report(tmp_path, 1) == 75  # the grace ran out on rank 1: said, not hidden
    assert "1 without waiting for a new checkpoint" in capsys.readouterr().out
    write_record(tmp_path, 1, state="diverged", exit_code=3, message="non-finite loss")
    assert report(tmp_path, 1) == 3
    out = capsys.readouterr().out
    assert "rank 1 (pid" in out and "diverged (exit 3): non-finite loss  <- failed first" in out
    assert (
        report(None, 7) == 7
    )  # no records (the run never got that far): the launcher's own status


def test_stop_signals_only_record_the_first_signal():
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    signals = fault.StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(
            os.getpid(), signal.SIGINT
        )  # e.g. a launcher forwarding, then Ctrl-C: still one stop
        assert signals.name == "SIGTERM"
        # CPython's C-level handler wrote both to the wake-up socket: what the watchdog's thread reads
        assert signals.received() == [signal.SIGTERM, signal.SIGINT]
        assert signals.received() == []
    finally:
        signals.restore()
    assert signals.wakeup is None and signals.received() == []
    assert signal.set_wakeup_fd(before) == before  # the previous wake-up fd is back


def _custom_handler(signum, frame):  # pragma: no cover - never called
    pass


@pytest.mark.parametrize(
    "before",
    [signal.SIG_IGN, signal.SIG_DFL, signal.default_int_handler, _custom_handler],
    ids=["ignored", "default", "python-default", "custom"],
)
def test_stop_signals_restore_exactly_the_handlers_that_were_there(before):
    """A run started where SIGINT is ignored (a background job) gets SIG_IGN back, not Python's default."""
    saved = {s: signal.getsignal(s) for s in fault.StopSignals.SIGNALS}
    try:
        for s in fault.StopSignals.SIGNALS:
            signal.signal(s, before)
        signals = fault.StopSignals()
        signals.install()
        assert all(signal.getsignal(s) == signals._handle for s in fault.StopSignals.SIGNALS)
        signals.restore()
        assert all(signal.getsignal(s) is before for s in fault.StopSignals.SIGNALS)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


CRASH_PROBE = """
import os, sys
from pathlib import Path
from dstrain.loop.fault import RankRecords
RankRecords(Path(sys.argv[1]), rank=1, world=2).start(step=7)
def deep_in_a_library():
    os.abort()  # what glibc does on "free(): invalid pointer"
deep_in_a_library()
"""


def test_a_native_crash_is_named_with_its_rank_signal_and_place(tmp_path, capsys):
    """A rank killed by a native crash (SIGABRT here) leaves a fault-handler report the launcher names it by."""
    from dstrain.run.launch import report

    proc = subprocess.run(
        [sys.executable, "-c", CRASH_PROBE, str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGABRT
    write_record(tmp_path, 0, state="lost_peer", exit_code=4, message="lost")
    records = fault.read_records(tmp_path, world=2)
    assert records[1]["verdict"].startswith("process crashed: Fatal Python error: Aborted, in ")
    assert "deep_in_a_library" in records[1]["verdict"]
    assert [r["rank"] for r in fault.failed_ranks(records, me=0)] == [1]
    assert report(tmp_path, 1) == 4  # a rank that vanished: the job lost a rank
    assert "rank 1 (pid" in capsys.readouterr().out


def test_a_crash_after_a_finished_run_is_reported_and_the_job_succeeds(tmp_path, capsys):
    from dstrain.run.launch import report

    for rank in (0, 1):
        write_record(tmp_path, rank, state="done", exit_code=0)
    (tmp_path / "ranks" / "rank00001.crash").write_text(
        'Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n  File "x.py", line 3 in f\n'
    )
    assert report(tmp_path, 1) == 0
    out = capsys.readouterr().out
    assert (
        "rank 1 (pid" in out
        and 'crashed while exiting: Fatal Python error: Aborted, in "x.py"' in out
    )


def test_a_resume_on_fewer_ranks_drops_the_records_of_ranks_not_in_the_job(tmp_path, monkeypatch):
    """2 ranks ran (rank 1 lost on its node); the resume runs 1: launch.sh must not blame rank 1
    again (found by tests/test_multihost.py's resume on the remaining host)."""
    monkeypatch.setattr(fault.faulthandler, "enable", lambda **kw: None)  # pytest keeps its own
    old = fault.RankRecords(tmp_path, rank=1, world=2)
    old.start(step=16)
    old._crash_file.close()
    assert (tmp_path / "ranks" / "rank00001.json").is_file()
    now = fault.RankRecords(tmp_path, rank=0, world=1)
    now.start(step=16)
    now.finish("done", 0)
    now._crash_file.close()
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == [
        "rank00000.crash",
        "rank00000.json",
    ]
    records = fault.read_records(tmp_path)
    assert [(r["rank"], r["state"]) for r in records] == [(0, "done")]
    assert records[0]["env"] == {
        k: v for k, v in os.environ.items() if k.startswith(fault.RECORDED_ENV)
    }
