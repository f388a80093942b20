"""Keep DeepSpeed's import from pulling in MLflow.

DeepSpeed imports its autotuner with the package, and the autotuner imports MLflow whenever it is
installed (dstrain's ``tracking`` extra): 1-2 s added to every process that imports DeepSpeed, each
rank of every run, for an autotuner dstrain never runs. :class:`NoMlflowForDeepSpeedsAutotuner`
answers that one import (``mlflow`` asked for by ``deepspeed.autotuning.autotuner``) with
ImportError, which the autotuner takes as "no MLflow"; every other importer gets MLflow as usual
(dstrain's tracking imports it when a run sets ``log.mlflow``). ``dstrain/__init__.py`` installs it.
"""

from __future__ import annotations

import sys

IMPORTER = "deepspeed.autotuning.autotuner"


class NoMlflowForDeepSpeedsAutotuner:
    """A meta-path finder that refuses ``import mlflow`` from :data:`IMPORTER` alone."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == IMPORTER:
                raise ImportError("mlflow is not imported for DeepSpeed's autotuner (dstrain)")
            frame = frame.f_back
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once a process."""
    # by name: the tests' sitecustomize installs a copy loaded from this file's path
    if not any(type(f).__name__ == NoMlflowForDeepSpeedsAutotuner.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, NoMlflowForDeepSpeedsAutotuner())
