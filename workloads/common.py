"""``dadfl.workloads.common`` — pieces every built-in workload shares: seeded model building, splits, loss, metric."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.model_selection import train_test_split
from torch import nn

from .base import Split, Workload


def seeded_builder(seed: int, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Wrap ``make`` so every call returns a bit-identical model initialised from ``seed``.

    The global torch RNG is forked around construction, so building a replica neither
    depends on nor disturbs the caller's random state.
    """

    def build_model() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return make()

    return build_model


def check_test_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def stratified_split(
    features: np.ndarray, classes: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seeded train/test split that keeps every class's share equal in both parts."""
    check_test_fraction(test_fraction)
    return train_test_split(
        features, classes, test_size=test_fraction, random_state=seed, stratify=classes
    )


def per_sample_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample, shape ``(n,)``; for sequences, the mean over positions.

    ``outputs`` is ``(n, classes)`` or ``(n, ..., classes)`` with ``targets`` ``(n, ...)``.
    """
    losses = F.cross_entropy(outputs.movedim(-1, 1), targets, reduction="none")
    return losses.reshape(len(losses), -1).mean(dim=1)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of predictions (argmax over the last dimension) that equal the targets."""
    return (outputs.argmax(dim=-1) == targets).float().mean().item()


def two_hidden_mlp(inputs: int, hidden: int, classes: int) -> nn.Sequential:
    """Linear, ReLU, Linear, ReLU, Linear: a plain chain, the shape edAD needs."""
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
    )


def classification(
    name: str, make: Callable[[], nn.Module], seed: int, train: Split, test: Split, options: dict,
    metric_name: str = "accuracy", label_skew: bool = True,
) -> Workload:
    """A classification workload: per-sample cross-entropy, accuracy, the training labels for
    label-skewed partitions (``label_skew``: targets are one class per sample), and ``make``
    built bit-identically from ``seed``."""
    return Workload(
        name=name, build_model=seeded_builder(seed, make), train=train, test=test, loss=per_sample_cross_entropy,
        metric=accuracy, metric_name=metric_name, labels=train.targets if label_skew else None, options=options,
    )
