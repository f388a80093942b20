"""dstrain: a DeepSpeed-backed, config-driven trainer for large-minibatch image classification."""

__version__ = "0.1.0"
