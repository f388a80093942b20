"""dstrain: a DeepSpeed-backed, config-driven trainer for large-minibatch image classification."""

from dstrain.core import import_guard

__version__ = "0.1.0"

import_guard.install()  # before anything imports DeepSpeed: its autotuner would load MLflow
