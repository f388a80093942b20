"""dstrain/loop/watchdog.py: a stalled run ends itself (exit 6), a stop signal gets a bounded grace (exit 75).

In-process: the Watchdog with a replaced exit. Real runs: DSTRAIN_FAULT_STALL hangs the main thread in a
phase (a sleep loop that Python signal handlers do not break, as a native hang would not), and the
real os._exit ends the process. Each run records what it observed in the evidence table."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from dstrain.core.errors import ConfigError
from dstrain.loop import checkpoint, fault
from dstrain.loop.watchdog import Watchdog
from dstrain.settings.config import load_config, validate
from tests.conftest import TINY, deepspeed_launcher, run_cli
from tests.inject.sitecustomize import STALL_ENV, InjectedStall
from tests.test_faults import Running, clean_env, records, user_lines


# ---------------------------------------------------------------- the Watchdog in this process
class Fired:
    """What the watchdog's thread did instead of exiting: the exit status, the rank record, its stderr."""

    def __init__(self, tmp_path: Path):
        self.codes: list[int] = []
        self.reports: list[tuple[str, int, str]] = []
        self.done = threading.Event()
        self.stream = open(
            tmp_path / "stderr.txt", "w+"
        )  # a real file: faulthandler writes to its fd

    def exit_process(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()

    def report(self, state: str, code: int, message: str) -> None:
        self.reports.append((state, code, message))

    def text(self) -> str:
        self.stream.seek(0)
        return self.stream.read()


@pytest.fixture
def fired(tmp_path):
    f = Fired(tmp_path)
    yield f
    f.stream.close()


def watchdog(fired: Fired, stall_s: float, grace_s: float = 0.0, signals=None) -> Watchdog:
    dog = Watchdog(stall_s, grace_s, signals, exit_process=fired.exit_process, stream=fired.stream)
    dog.start(fired.report, lambda: "at step 7; no checkpoint was written yet")
    return dog


def test_a_phase_that_does_not_end_fires_with_its_name_and_every_stack(fired):
    dog = watchdog(fired, stall_s=0.3)
    t0 = time.monotonic()
    dog.phase("collective")
    assert fired.done.wait(5)
    waited = time.monotonic() - t0
    dog.stop()
    assert fired.codes == [6] and 0.3 <= waited < 2
    state, code, message = fired.reports[0]
    assert (state, code) == ("stalled", 6)
    assert re.search(
        r"no progress for [01] s in phase collective \(fault.stall_timeout_s=0.3\)", message
    )
    assert "another rank" in message and "raise fault.stall_timeout_s" in message
    text = fired.text()
    assert "Thread 0x" in text and 'File "' in text  # faulthandler's dump of every thread
    assert text.rstrip().splitlines()[-1] == f"dstrain: error: {message}"


def test_no_fire_while_phases_keep_changing_and_stop_ends_the_thread(fired):
    dog = watchdog(fired, stall_s=0.4)
    thread = dog._thread
    for _ in range(12):  # 1.2 s in all, three times the limit
        dog.phase("data")
        time.sleep(0.1)
        dog.phase("forward/backward")
    dog.stop()
    assert not thread.is_alive() and dog._thread is None
    time.sleep(0.6)
    assert fired.codes == [] and fired.reports == []


@pytest.fixture
def signals():
    """Our handlers and wake-up socket in this process (pytest runs tests in the main thread)."""
    stop = fault.StopSignals()
    stop.install()
    yield stop
    stop.restore()


def test_a_signal_the_loop_does_not_acknowledge_within_the_grace_exits_75(fired, signals):
    dog = watchdog(fired, stall_s=0, grace_s=0.5, signals=signals)
    dog.phase("forward/backward")
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    assert fired.done.wait(5)
    waited = time.monotonic() - t0
    dog.stop()
    assert fired.codes == [75] and 0.5 <= waited < 2
    state, code, message = fired.reports[0]
    assert (state, code) == ("preempted", 75)
    assert re.match(
        r"SIGTERM received [01] s ago and the step in flight \(phase forward/backward\) did not "
        r"finish within fault.signal_grace_s=0.5: exiting without a new checkpoint at step 7",
        message,
    )
    assert fired.text().rstrip().splitlines()[-1] == f"dstrain: stopped: {message}"


def test_an_acknowledged_stop_has_no_grace_limit_but_a_second_signal_exits(fired, signals):
    dog = watchdog(fired, stall_s=0, grace_s=0.3, signals=signals)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # the same stop (Ctrl-C reaching every process): ignored
    signals.acknowledge()  # the loop stopped stepping and writes its checkpoint
    dog.phase("checkpoint")
    assert not fired.done.wait(2.2)  # past the grace and past the 2 s of the same stop
    assert signals.name == "SIGTERM"
    os.kill(os.getpid(), signal.SIGTERM)
    assert fired.done.wait(2)
    dog.stop()
    assert fired.codes == [75]
    message = fired.reports[0][2]
    assert message.startswith("second signal (SIGTERM, 2 s after SIGTERM) in phase checkpoint")
    assert "exiting at once without a new checkpoint" in message


def test_restored_signals_are_not_watched(fired, signals):
    dog = watchdog(fired, stall_s=0, grace_s=0.2, signals=signals)
    signals.restore()  # polish: default handlers again; the watchdog still runs
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert not fired.done.wait(0.6)
    finally:
        signal.signal(signal.SIGTERM, previous)
    dog.stop()
    assert fired.codes == []


def test_injected_stall_spec(monkeypatch):
    monkeypatch.setenv(STALL_ENV, "collective:30:1:17")
    assert InjectedStall.from_env(rank=0) is None
    stall = InjectedStall.from_env(rank=1)
    assert stall == InjectedStall("collective", 30.0, 17)
    assert (
        not stall.due("collective", 16)
        and not stall.due("data", 17)
        and stall.due("collective", 17)
    )
    monkeypatch.setenv(STALL_ENV, "forward/backward:2.5")
    assert InjectedStall.from_env(rank=3) == InjectedStall("forward/backward", 2.5, 0)
    monkeypatch.delenv(STALL_ENV)
    assert InjectedStall.from_env(rank=0) is None


@pytest.mark.parametrize("key", ["stall_timeout_s", "signal_grace_s"])
def test_negative_bounds_are_refused(key):
    validate(load_config(None, [f"fault.{key}=0"]), 1)  # 0 = off
    with pytest.raises(ConfigError, match=rf"fault\.{key}=-1\.0: must be >= 0"):
        validate(load_config(None, [f"fault.{key}=-1"]), 1)


# ---------------------------------------------------------------- real runs
FP32 = ["--deepspeed_config", "ds_configs/fp32.json"]
HANG_S = 600  # the injected hang: far longer than any of these runs may take


def common(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*FP32, *TINY, f"data.root={data}", f"run_dir={run_dir}", "epochs=2", *extra]


def stall_env(spec: str) -> dict:
    return {STALL_ENV: spec}


def error_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("dstrain: error: stalled"))


def seconds_in(pattern: str, text: str) -> int:
    """The whole seconds a message states where ``pattern`` has ``N s``."""
    before, after = pattern.split(" N s")
    match = re.search(re.escape(before) + r" (\d+) s" + re.escape(after), text)
    assert match, f"{pattern!r} not in {text!r}"
    return int(match.group(1))


@pytest.mark.slow
def test_a_data_stall_exits_6_with_the_stacks_and_keeps_the_last_checkpoint(
    fake_fmnist, tmp_path, evidence
):
    run_dir = tmp_path / "run"
    # hangs fetching the second batch of epoch 2, after epoch 1's checkpoint
    proc = run_cli(
        common(fake_fmnist, run_dir, "fault.stall_timeout_s=4"),
        env=stall_env(f"data:{HANG_S}::17"),
        timeout=240,
    )
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Thread 0x" in proc.stderr and 'File "' in proc.stderr and "in hang" in proc.stderr
    line = error_line(proc.stderr)
    assert 4 <= seconds_in("no progress for N s in phase data (fault.stall_timeout_s=4)", line) < 8
    ckpt = run_dir / "checkpoints"
    assert f"at step 17; the last complete checkpoint is {ckpt / 'epoch0001'} (resume=auto" in line
    record = records(run_dir)[0]
    assert (record["state"], record["exit_code"], record["step"]) == ("stalled", 6, 17)
    # the watchdog wrote nothing: epoch 1's checkpoint is complete and what resume=auto loads
    assert (ckpt / "latest").read_text().strip() == "epoch0001"
    assert checkpoint.newest_complete(ckpt) == "epoch0001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch0001", "latest"]
    evidence(
        "fault: stall",
        "the data loader hangs in epoch 2 (fault.stall_timeout_s=4)",
        exit=6,
        seen=line,
        disk="`latest` = epoch0001 (complete; resume=auto loads it); every thread's stack on stderr",
    )


@pytest.mark.slow
def test_a_forward_backward_stall_exits_6_naming_the_phase(fake_fmnist, tmp_path, evidence):
    run_dir = tmp_path / "run"
    proc = run_cli(
        common(fake_fmnist, run_dir, "epochs=1", "fault.stall_timeout_s=4"),
        env=stall_env(f"forward/backward:{HANG_S}::3"),
        timeout=240,
    )
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert 4 <= seconds_in("no progress for N s in phase forward/backward", line) < 8
    assert "DeepSpeed's gradient all-reduce runs inside backward" in line
    assert "at step 3; no checkpoint was written yet" in line
    assert records(run_dir)[0]["state"] == "stalled"
    # no checkpoint: the directory is marked failed, as any run stopped before its first one
    assert json.loads((run_dir / "failed.json").read_text())["exit_code"] == 6
    evidence(
        "fault: stall",
        "forward/backward hangs at step 4 (fault.stall_timeout_s=4)",
        exit=6,
        seen=line,
        disk="no checkpoint yet (none is written by the watchdog); run directory marked failed",
    )


@pytest.mark.slow
def test_a_collective_stall_on_one_rank_ends_both_ranks(fake_fmnist, tmp_path, evidence):
    """Rank 1 hangs before dstrain's gradient all-reduce (comm_sign.json: our collective, uncompressed
    for its first 20 steps); rank 0 waits in it. Both end within the stall timeout, long before the
    collective timeout."""
    run_dir = tmp_path / "run"
    args = [
        "--deepspeed_config",
        "ds_configs/comm_sign.json",
        *TINY,
        f"data.root={fake_fmnist}",
        f"run_dir={run_dir}",
        "epochs=1",
        "fault.stall_timeout_s=5",
        "fault.collective_timeout_s=300",
    ]
    t0 = time.monotonic()
    proc = run_cli(
        args, launcher=deepspeed_launcher(2), env=stall_env(f"collective:{HANG_S}:1"), timeout=240
    )
    seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode in (4, 6), out[-4000:]
    ranks = records(run_dir)
    assert ranks[1]["state"] == "stalled" and "in phase collective" in ranks[1]["message"], ranks
    assert ranks[0]["state"] in ("stalled", "lost_peer"), ranks
    if ranks[0]["state"] == "stalled":
        assert "in phase collective" in ranks[0]["message"]
    assert seconds < 200  # start-up and the first steps, then the stall timeout: not the hang
    lines = user_lines(out)
    assert 5 <= seconds_in(
        "[rank 1]: error: stalled: no progress for N s in phase collective", lines
    )
    evidence(
        "fault: stall",
        "rank 1 of 2 hangs before dstrain's gradient all-reduce (fault.stall_timeout_s=5, "
        "fault.collective_timeout_s=300)",
        exit=proc.returncode,
        seen=lines,
        disk=f"records: rank 0 {ranks[0]['state']}, rank 1 stalled; no checkpoint yet",
        seconds=seconds,
    )


def start_hung_run(data: Path, run_dir: Path, *extra: str) -> Running:
    """A run whose main thread hangs in forward/backward in epoch 2, after epoch 1's checkpoint."""
    cmd = [sys.executable, "-m", "dstrain", *common(data, run_dir, *extra)]
    run = Running(cmd, clean_env(**stall_env(f"forward/backward:{HANG_S}::17")))
    run.wait_for(f"{STALL_ENV}: hanging")
    time.sleep(1)  # well inside the step
    return run


@pytest.mark.slow
def test_sigterm_during_a_hung_step_exits_75_after_the_grace(fake_fmnist, tmp_path, evidence):
    run_dir = tmp_path / "run"
    run = start_hung_run(
        fake_fmnist, run_dir, "fault.signal_grace_s=3", "fault.stall_timeout_s=300"
    )
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=60) == 75, run.output[-3000:]
    seconds = time.monotonic() - t0
    # waits out the 3 s grace, then exits: room for a loaded machine's process teardown, yet below
    # the default 20 s grace (an ignored override fails), the 300 s stall timeout and the 600 s hang
    assert 3 <= seconds < 15
    lines = user_lines(run.output)
    said = (
        "dstrain: stopped: SIGTERM received N s ago and the step in flight (phase forward/backward) "
        "did not finish within fault.signal_grace_s=3: exiting without a new checkpoint at step 17"
    )
    assert 3 <= seconds_in(said, lines) < 15
    ckpt = run_dir / "checkpoints"
    assert f"the last complete checkpoint is {ckpt / 'epoch0001'} (resume=auto" in lines
    assert "Thread 0x" in run.output
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch0001", "latest"]
    record = records(run_dir)[0]
    assert (record["state"], record["exit_code"]) == ("preempted", 75)
    evidence(
        "fault: preemption",
        "SIGTERM while forward/backward hangs (fault.signal_grace_s=3)",
        exit=75,
        seen=lines,
        disk="no new checkpoint; `latest` = epoch0001 (complete)",
        seconds=seconds,
    )


@pytest.mark.slow
def test_a_second_signal_during_a_hung_step_exits_at_once(fake_fmnist, tmp_path, evidence):
    run_dir = tmp_path / "run"
    run = start_hung_run(
        fake_fmnist, run_dir, "fault.signal_grace_s=60", "fault.stall_timeout_s=300"
    )
    run.proc.send_signal(signal.SIGTERM)
    time.sleep(3)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=60) == 75, run.output[-3000:]
    seconds = time.monotonic() - t0
    # "at once": well inside the 60 s grace the first signal started (a loaded machine gets the margin)
    assert seconds < 30
    lines = user_lines(run.output)
    said = (
        "dstrain: stopped: second signal (SIGTERM, N s after SIGTERM) in phase forward/backward: "
        "exiting at once without a new checkpoint at step 17"
    )
    assert 3 <= seconds_in(said, lines) < 15  # the 3 s between the signals, on a loaded machine
    assert json.loads((run_dir / "ranks" / "rank00000.json").read_text())["state"] == "preempted"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch0001"
    evidence(
        "fault: preemption",
        "a second SIGTERM 3 s after the first while forward/backward hangs "
        "(fault.signal_grace_s=60)",
        exit=75,
        seen=lines,
        disk="no new checkpoint; `latest` = epoch0001 (complete)",
        seconds=seconds,
    )
