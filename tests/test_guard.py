"""dstrain/guard.py in isolation: FP16 skip limit, NaN tracking, rank records and who gets blamed."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from dstrain import guard


def test_consecutive_fp16_skips_stop_the_run_at_the_limit():
    skips = guard.SkipCounter(limit=3)
    totals = [0, 1, 2, 2, 3, 4]  # the engine's running skipped_steps after steps 1..6: a good step at 4
    for step, total in enumerate(totals, 1):
        skips.update(total, step, scale=2.0 ** -step)
    assert skips.total == 4 and skips.consecutive == 2
    with pytest.raises(guard.Diverged, match=r"3 consecutive FP16 steps skipped .*steps 5-7.*"
                                             r"fault.max_consecutive_skips=3"):
        skips.update(5, 7)
    assert guard.Diverged.exit_code == 3


def test_no_skip_limit_when_zero():
    skips = guard.SkipCounter(limit=0)
    for step in range(1, 200):
        skips.update(step, step)
    assert skips.consecutive == 199


def test_nonfinite_watch_remembers_the_first_bad_step_without_host_syncs():
    watch = guard.NonFiniteWatch(torch.device("cpu"))
    for step, loss in enumerate([1.0, 0.5, float("nan"), float("inf"), 0.3], 1):
        watch.observe(torch.tensor(loss), step)
    assert watch.first_bad_step(lambda t: t) == 3
    clean = guard.NonFiniteWatch(torch.device("cpu"))
    clean.observe(torch.tensor(1.0), 1)
    assert clean.first_bad_step(lambda t: t) is None


def test_params_finite():
    model = torch.nn.Linear(3, 2)
    assert guard.params_finite(model)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert not guard.params_finite(model)


@pytest.mark.parametrize("text, expected", [
    ("[/x/gloo/pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer. This is typically caused by",
     True),
    ("[/x/gloo/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete", True),
    ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", False),
])
def test_collective_failures_are_told_from_bugs(text, expected):
    assert guard.is_collective_failure(RuntimeError(text)) is expected
    if expected:
        assert not guard.first_line(RuntimeError(text)).startswith("[")
        assert "typically" not in guard.first_line(RuntimeError(text))


def write_record(run_dir, rank, **fields):
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    rec = {"rank": rank, "host": os.uname().nodename, "pid": os.getpid(), "time": 0, **fields}
    (run_dir / "ranks" / f"rank{rank:05d}.json").write_text(json.dumps(rec))


def test_records_blame_the_silent_rank_whose_process_is_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: the pid no longer exists
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        write_record(tmp_path, 0, state="lost_peer", exit_code=4, message="lost")
        write_record(tmp_path, 1, state="running", pid=dead.pid)
        write_record(tmp_path, 2, state="running", pid=stopped.pid)
        write_record(tmp_path, 3, state="running", host="elsewhere", pid=1)
        records = guard.read_records(tmp_path, world=5)
        verdicts = [r["verdict"] for r in records]
        assert verdicts[1].startswith("process gone without a word")
        assert verdicts[2].startswith("process alive but stopped")
        assert verdicts[3].startswith("no final record")
        assert verdicts[4] == "never started"
        assert [r["rank"] for r in guard.failed_ranks(records, me=0)] == [1, 2, 3, 4]
        msg = guard.describe_lost(records, 0, "Connection reset by peer", 600)
        assert msg.startswith(f"lost contact with another rank: rank 1 (pid {dead.pid}")
    finally:
        stopped.kill()
        stopped.wait()


def test_when_nobody_is_silent_the_first_recorded_failure_is_blamed(tmp_path):
    write_record(tmp_path, 0, state="lost_peer", exit_code=4, message="lost")
    write_record(tmp_path, 1, state="bad_input", exit_code=2, message="corrupt image: /d/x.JPEG (truncated)")
    blamed = guard.failed_ranks(guard.read_records(tmp_path, 2), me=0)
    assert [r["rank"] for r in blamed] == [1] and "corrupt image" in blamed[0]["verdict"]


def test_launcher_report_and_exit_status(tmp_path, capsys):
    from dstrain.launch import report

    write_record(tmp_path, 0, state="preempted", exit_code=75, message="stopped")
    write_record(tmp_path, 1, state="preempted", exit_code=75, message="stopped")
    assert report(tmp_path, 1) == 75  # DeepSpeed's launcher says 1 after a SIGTERM; the ranks say 75
    write_record(tmp_path, 1, state="diverged", exit_code=3, message="non-finite loss")
    assert report(tmp_path, 1) == 3
    out = capsys.readouterr().out
    assert "rank 1 (pid" in out and "diverged (exit 3): non-finite loss  <- failed first" in out
    assert report(None, 7) == 7  # no records (the run never got that far): the launcher's own status


def test_stop_signals_only_record_the_first_signal():
    signals = guard.StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # e.g. a launcher forwarding, then Ctrl-C: still one stop
        assert signals.name == "SIGTERM"
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
