"""Experiment tracking beyond TensorBoard: MLflow (``log.mlflow``) and Weights & Biases (``log.wandb``).

Cluster users compare dozens of runs side by side in the tracker they already run; both work
without network: MLflow with a local file store (``RUN_DIR/mlruns`` unless ``log.mlflow_uri``
names a server or database), W&B offline (``RUN_DIR/wandb``, uploaded later by ``wandb sync``).
Each sink gets exactly what TensorBoard gets, through :class:`dstrain.loop.monitor.Monitor`:
``train/*`` at the global step, ``epoch/*`` and ``polish/*`` at the epoch; the resolved config
when the run starts (MLflow params, W&B config) and summary.json when it ends (an MLflow artifact
and ``summary/*`` metrics; the W&B summary). A resumed run continues the same tracked run: the
ids are kept in ``RUN_DIR/tracking.json``. Rank 0 only; the packages are an optional extra
(``pip install -e '.[tracking]'`` in a checkout), refused in one line at start-up when asked for and missing.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

from dstrain.core.errors import ConfigError
from dstrain.core.files import atomic_write_text
from dstrain.settings.config import LogConfig

log = logging.getLogger(__name__)
IDS_FILE = "tracking.json"
EXTRA_HINT = (
    "install the tracking extra (in a dstrain checkout: .venv/bin/pip install -e '.[tracking]')"
)


def require_packages(cfg: LogConfig) -> None:
    """The trackers asked for are importable: a start-up check (the run and ``--check``)."""
    for wanted, module, key in (
        (cfg.mlflow, "mlflow", "log.mlflow"),
        (cfg.wandb, "wandb", "log.wandb"),
    ):
        if not wanted:
            continue
        try:
            __import__(module)
        except ImportError as err:
            raise ConfigError(
                f"{key}=true: the {module} package is not installed ({err}); {EXTRA_HINT}, or "
                f"set {key}=false"
            ) from None


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"optim": {"base_lr": 0.1}}`` -> ``{"optim.base_lr": 0.1}``; lists kept whole."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def numbers(tree: dict) -> dict[str, float]:
    """The numeric leaves of summary.json (not its per-epoch history), flattened."""
    flat = flatten({k: v for k, v in tree.items() if k != "history"})
    return {
        k: float(v)
        for k, v in flat.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and v == v  # not NaN
    }


class Ids:
    """RUN_DIR/tracking.json: each tracker's run id, so a resumed run continues its tracked run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / IDS_FILE
        self.ids = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def get(self, key: str) -> str | None:
        return self.ids.get(key)

    def set(self, key: str, value: str) -> None:
        self.ids[key] = value
        atomic_write_text(self.path, json.dumps(self.ids, indent=2) + "\n")


class MLflowSink:
    """One MLflow run per dstrain run, through MlflowClient (no global active run)."""

    def __init__(self, cfg: LogConfig, run_dir: Path, name: str, config: dict, ids: Ids) -> None:
        uri = cfg.mlflow_uri or f"file:{(run_dir / 'mlruns').absolute()}"
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told: a local store is what a node without
            # a server has (log.mlflow_uri names a database or server instead)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        self.uri = uri
        experiment = cfg.mlflow_experiment or name
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = ids.get("mlflow_run_id")
        if self.run_id is None:
            run = self.client.create_run(experiment_id, run_name=run_dir.name)
            self.run_id = run.info.run_id
            ids.set("mlflow_run_id", self.run_id)
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=params[start : start + 100])
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        log.info("MLflow: run %s in experiment %r at %s", self.run_id, experiment, uri)

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, summary: dict | None) -> None:
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "summary.json")
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            metrics = [Metric(f"summary/{k}", v, now, 0) for k, v in numbers(summary).items()]
            for start in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
        self.client.set_terminated(self.run_id, "FINISHED" if summary is not None else "KILLED")


class WandbSink:
    """One W&B run per dstrain run (offline by default); ``train/*`` against ``global_step``,
    ``epoch/*`` and ``polish/*`` against ``epoch`` (W&B's own step must only grow)."""

    def __init__(self, cfg: LogConfig, run_dir: Path, name: str, config: dict, ids: Ids) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run_id = ids.get("wandb_run_id") or uuid.uuid4().hex[:12]
        ids.set("wandb_run_id", run_id)
        self.run = wandb.init(
            project=cfg.wandb_project,
            name=run_dir.name,
            group=name,
            id=run_id,
            resume="allow",
            mode=cfg.wandb_mode,
            dir=str(run_dir),
            config=config,
        )
        self.run.define_metric("global_step")
        self.run.define_metric("epoch")
        self.run.define_metric("train/*", step_metric="global_step")
        for prefix in ("epoch", "polish"):
            self.run.define_metric(f"{prefix}/*", step_metric="epoch")
        log.info("W&B: run %s (%s) in %s", run_id, cfg.wandb_mode, run_dir / "wandb")

    def scalars(self, values: dict[str, float], step: int) -> None:
        axis = "global_step" if next(iter(values)).startswith("train/") else "epoch"
        self.run.log({**values, axis: step})

    def close(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update(numbers(summary))
        self.run.finish(exit_code=0 if summary is not None else 1)


def sinks(cfg: LogConfig, run_dir: Path, name: str, config: dict) -> list:
    """The trackers ``cfg`` asks for, started (rank 0 calls it)."""
    ids = Ids(run_dir)
    out: list = []
    if cfg.mlflow:
        out.append(MLflowSink(cfg, run_dir, name, config, ids))
    if cfg.wandb:
        out.append(WandbSink(cfg, run_dir, name, config, ids))
    return out
