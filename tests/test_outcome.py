"""dstrain/run/outcome.py: how a run ended, recorded once (the rank's record, the failed mark, closers)."""

from __future__ import annotations

import json

import pytest

from dstrain.core.errors import Diverged, PeerLost
from dstrain.loop import fault
from dstrain.run import rundir
from dstrain.run.outcome import Outcome, ending_of


def record(run_dir) -> dict:
    return json.loads((run_dir / fault.RANKS_DIR / "rank00000.json").read_text())


def test_a_block_that_returns_is_done_and_closes_once(tmp_path):
    closed = []
    with Outcome(tmp_path, 0, 1, step=lambda: 7) as outcome:
        outcome.on_end(lambda: closed.append(1))
        assert record(tmp_path)["state"] == "running"
    outcome.end("error", 1, "a second ending is ignored")
    assert closed == [1]
    r = record(tmp_path)
    assert (r["state"], r["exit_code"], r["step"]) == ("done", 0, 7)
    assert not (tmp_path / rundir.FAILED).exists()


@pytest.mark.parametrize(
    "err, state, code",
    [
        (Diverged("loss is nan at step 3"), "diverged", 3),
        (PeerLost("lost contact with rank 1"), "lost_peer", 4),
        (ValueError("boom\nTraceback detail"), "error", 1),
    ],
)
def test_an_exception_is_recorded_with_its_state_and_marks_a_run_without_checkpoints(
    tmp_path, err, state, code
):
    closed = []
    with pytest.raises(type(err)):
        with Outcome(tmp_path, 0, 1) as outcome:
            outcome.on_end(lambda: closed.append(1))
            raise err
    r = record(tmp_path)
    assert (r["state"], r["exit_code"]) == (state, code)
    assert (ending_of(err).state, ending_of(err).exit_code) == (state, code)
    assert r["message"] == ending_of(err).message and "\n" not in r["message"]
    failed = json.loads((tmp_path / rundir.FAILED).read_text())
    assert (failed["state"], failed["exit_code"]) == (state, code)
    assert closed == [1]


def test_the_watchdogs_ending_wins_and_closes_nothing(tmp_path):
    """The watchdog records from its own thread (close=False: the main thread may hold the writer)
    just before it ends the process; what the main thread raises afterwards changes nothing."""
    closed = []
    with pytest.raises(RuntimeError):
        with Outcome(tmp_path, 0, 1) as outcome:
            outcome.on_end(lambda: closed.append(1))
            outcome.end("stalled", 6, "no progress in the data phase", close=False)
            raise RuntimeError("interrupted")
    assert record(tmp_path)["state"] == "stalled" and closed == []
