"""Experiment tracking (dstrain/loop/tracking.py): a run logged to MLflow (a local file store) and
W&B (offline), each read back with the library's own reader and compared with TensorBoard's
scalars, config.yaml and summary.json."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dstrain.core.errors import ConfigError
from dstrain.loop import tracking
from dstrain.settings.config import LogConfig
from tests.conftest import INJECT, REPO, TINY, run_cli


def tensorboard(run_dir, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def wandb_records(run_dir) -> dict:
    """The offline run file, read with wandb's own DataStore: history rows, config, summary."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    store = datastore.DataStore()
    store.open_for_scan(path)
    out: dict = {"history": [], "config": {}, "summary": {}}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "run":
            out["config"].update(
                {i.key: json.loads(i.value_json) for i in record.run.config.update}
            )
        elif kind == "summary":
            out["summary"].update(
                {i.key: json.loads(i.value_json) for i in record.summary.update if i.key}
            )
    return out


@pytest.mark.slow
def test_mlflow_and_wandb_get_tensorboards_scalars_the_config_and_the_summary(
    fake_fmnist, tmp_path, monkeypatch
):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    args = [*TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}", "log.mlflow=true"]
    args += ["log.wandb=true", "polish.enabled=true", "polish.images=64"]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    loss, top1 = tensorboard(run_dir, "train/loss"), tensorboard(run_dir, "epoch/val_top1")
    assert len(loss) == 12 and len(top1) == 3  # TINY: 48 steps logged every 4, 3 epochs
    ids = json.loads((run_dir / "tracking.json").read_text())

    # MLflow, read by its client from the run directory's file store (which MLflow 3 opens only
    # when told, as dstrain tells it)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file:{run_dir / 'mlruns'}")
    run = client.get_run(ids["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(loss, rel=1e-6)  # TensorBoard keeps FP32
    epochs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "epoch/val_top1")}
    assert epochs == pytest.approx(top1, rel=1e-6)
    params = run.data.params
    assert params["optim.base_lr"] == str(config["optim"]["base_lr"])
    assert params["model.width"] == "8" and params["name"] == config["name"]
    saved = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(open(saved).read()) == summary
    assert run.data.metrics["summary/final_top1"] == summary["final_top1"]
    assert (
        run.data.metrics["summary/polish.after.val_top1"] == summary["polish"]["after"]["val_top1"]
    )

    # W&B, read from its offline run file
    wb = wandb_records(run_dir)
    train = {row["global_step"]: row["train/loss"] for row in wb["history"] if "train/loss" in row}
    assert train == pytest.approx(loss, rel=1e-6)
    val = {row["epoch"]: row["epoch/val_top1"] for row in wb["history"] if "epoch/val_top1" in row}
    assert val == pytest.approx(top1, rel=1e-6)
    assert wb["config"]["optim"]["base_lr"] == config["optim"]["base_lr"]
    assert wb["summary"]["final_top1"] == summary["final_top1"]

    # a resumed run continues the same tracked runs (nothing left to train here)
    again = run_cli([*args, "resume=auto"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((run_dir / "tracking.json").read_text()) == ids
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_tracker_asked_for_and_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    with pytest.raises(
        ConfigError, match=r"log.mlflow=true: the mlflow package is not installed"
    ) as err:
        tracking.require_packages(OmegaConf.structured(LogConfig(mlflow=True)))
    # the install a checkout can do (the extra is not on the package index under this name)
    assert "pip install -e '.[tracking]'" in str(err.value)
    tracking.require_packages(OmegaConf.structured(LogConfig()))  # none asked for


def test_the_summary_numbers_a_tracker_gets():
    summary = {"final_top1": 0.9, "history": [{"x": 1}], "polish": {"after": {"val_top1": 0.91}}}
    summary |= {"name": "run", "flag": True, "nan": float("nan")}
    assert tracking.numbers(summary) == {"final_top1": 0.9, "polish.after.val_top1": 0.91}


def probed(stdout: str) -> list[str]:
    """The words of a probe's ``probe ...`` lines (DeepSpeed logs to stdout too)."""
    return [
        w for line in stdout.splitlines() if line.startswith("probe ") for w in line.split()[1:]
    ]


@pytest.mark.slow  # two fresh processes importing DeepSpeed: over ~5 s on 2 cores
def test_deepspeeds_import_leaves_mlflow_unloaded_and_mlflow_still_imports():
    """DeepSpeed's autotuner imports MLflow when it is installed (1-2 s in every rank); after
    ``import dstrain`` it does not (dstrain/core/import_guard.py), and MLflow itself imports as usual
    for log.mlflow. Both processes run without tests/inject on PYTHONPATH: its sitecustomize installs
    the same guard in every process the tests start, which would hide dstrain's own."""
    pytest.importorskip("mlflow")
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if Path(p) != INJECT)}
    probe = (
        "import sys, deepspeed.autotuning.autotuner as tuner\n"
        "print('probe', 'mlflow' in sys.modules, tuner.has_mlflow)\n"
    )
    # the control: DeepSpeed alone loads MLflow, so what the guard is checked to prevent happens
    alone = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert probed(alone.stdout) == ["True", "True"], alone.stdout
    code = "import dstrain\n" + probe + "import mlflow\nprint('probe', mlflow.set_tracking_uri)\n"
    guarded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert guarded.returncode == 0, guarded.stderr[-2000:]
    assert probed(guarded.stdout)[:2] == ["False", "False"], guarded.stdout
    assert "function set_tracking_uri" in guarded.stdout  # MLflow imported after all
