"""The failed-start rule (dstrain/rundir.py): a run with no checkpoint is marked failed and started over."""

import json

import pytest

from dstrain import rundir
from dstrain.config import load_config
from dstrain.errors import ConfigError


def test_a_run_without_a_checkpoint_is_marked_failed_and_reused(tmp_path):
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "config.yaml").write_text("epochs: 1\n")
    cfg = load_config("fashion_mnist", [f"run_dir={run}"])
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.choose(cfg)  # unmarked: looks like a run
    assert rundir.mark_failed(run, "bad_input", 2, "corrupt image: x.JPEG")
    assert json.loads((run / rundir.FAILED).read_text())["message"] == "corrupt image: x.JPEG"
    assert rundir.choose(cfg) == run  # marked: nothing to continue, a new run may start there
    rundir.create(run)
    assert list(run.iterdir()) == []  # emptied: no stale records or TensorBoard events


def test_a_run_with_a_checkpoint_is_never_marked_failed(tmp_path):
    run = tmp_path / "run"
    ckpt = run / rundir.CHECKPOINTS / "epoch0001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    assert not rundir.mark_failed(run, "error", 1, "later failure")
    assert not (run / rundir.FAILED).exists()
    (run / rundir.FAILED).write_text("{}")  # even a stray marker does not hide the checkpoint
    assert rundir.failed_start(run) is None
