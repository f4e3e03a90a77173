"""``dadfl.workloads.breast_cancer`` — breast cancer Wisconsin (scikit-learn's bundled table, 30 features, 2 classes): an MLP.

A small tabular workload close to the hospital use case. Features are standardised
with statistics of the training split only, so nothing about the test rows leaks in.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .base import Split, Workload
from .common import check_positive, classification, scikit_learn_table, stratified_split, two_hidden_mlp

NUM_CLASSES = 2


def mlp(hidden: int = 32, seed: int = 0, test_fraction: float = 0.25) -> Workload:
    """Two hidden ReLU layers on the standardised feature vector."""
    check_positive(hidden=hidden)
    features, labels = scikit_learn_table("breast_cancer")
    train_x, test_x, train_y, test_y = stratified_split(features, labels, test_fraction, seed)
    mean, std = train_x.mean(axis=0), train_x.std(axis=0)

    def standardise(features: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((features - mean) / std).astype(np.float32))

    train = Split(standardise(train_x), torch.from_numpy(train_y).long())
    test = Split(standardise(test_x), torch.from_numpy(test_y).long())
    num_features = train.inputs.shape[1]

    def make() -> nn.Module:
        return two_hidden_mlp(num_features, hidden, NUM_CLASSES)

    return classification("breast-cancer-mlp", make, seed, train, test, {"hidden": hidden, "seed": seed, "test_fraction": test_fraction})
