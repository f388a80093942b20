"""Held-out validation: part of the training set stands in for the test set while tuning.

``data.holdout=N`` removes N training images, chosen by a fixed permutation that does not depend
on ``seed`` (every tuning run, whatever its seed, holds out the same images), and evaluates on them
with the validation transform; the test set is not read. Choose hyperparameters this way and report
the test set only for the final runs, trained on the whole training set (``data.holdout=0``).
"""

from __future__ import annotations

import torch

from dstrain.core.errors import ConfigError

SPLIT_SEED = 20190312  # fixed: the split is part of the data set, not of a run


def holdout_split(n_train: int, holdout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices kept for training, indices held out), each sorted, from ``n_train`` images."""
    if holdout >= n_train:
        raise ConfigError(
            f"data.holdout={holdout} leaves no training images out of {n_train}: "
            f"hold out fewer (e.g. {n_train // 10}, a tenth)"
        )
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(SPLIT_SEED))
    return order[holdout:].sort().values, order[:holdout].sort().values
