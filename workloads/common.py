"""``dadfl.workloads.common`` — pieces every built-in workload shares: seeded model building, splits, loss, metric."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
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
    """Seeded train/test split that keeps every class's share equal in both parts.

    The same split, index for index, as scikit-learn's ``train_test_split(..., stratify=classes,
    random_state=seed)`` (its ``StratifiedShuffleSplit``), so splits and results made before stay
    as they were, computed here without importing scikit-learn (about a second of CPU in every
    site and coordinator process): ``ceil(fraction · n)`` test rows; each class's train and test
    counts from its share, the rows left over going to the largest remainders (ties drawn at
    random); each class's rows shuffled, its first rows to train, the next to test; both parts
    shuffled. One ``RandomState(seed)`` draws everything, in that order.
    """
    check_test_fraction(test_fraction)
    n_test = math.ceil(test_fraction * len(classes))
    n_train = len(classes) - n_test
    labels, label_of_row, counts = np.unique(classes, return_inverse=True, return_counts=True)
    if counts.min() < 2:
        raise ValueError(f"class {labels[counts.argmin()]} has 1 row: a stratified split needs at least 2 rows of every class")
    if min(n_train, n_test) < len(labels):
        raise ValueError(f"test_fraction {test_fraction} leaves {n_train} train and {n_test} test rows for {len(labels)} classes: "
                         "each part needs a row of every class")
    rows_of_class = np.split(np.argsort(label_of_row, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    train_counts = _share(counts, n_train, rng)
    test_counts = _share(counts - train_counts, n_test, rng)
    train, test = [], []
    for rows, n_i, t_i in zip(rows_of_class, train_counts, test_counts):
        shuffled = rows.take(rng.permutation(len(rows)), mode="clip")
        train.extend(shuffled[:n_i])
        test.extend(shuffled[n_i:n_i + t_i])
    train, test = rng.permutation(train), rng.permutation(test)
    return features[train], features[test], classes[train], classes[test]


def _share(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """``draws`` rows spread over classes in proportion to ``counts``: each class's share rounded
    down, the rows still missing given to the classes with the largest fractional part (among
    equal parts, drawn with ``rng``)."""
    exact = counts / counts.sum() * draws
    shares = np.floor(exact)
    missing = int(draws - shares.sum())
    fractions = exact - shares
    for fraction in np.sort(np.unique(fractions))[::-1]:
        if missing <= 0:
            break
        (tied,) = np.where(fractions == fraction)
        chosen = rng.choice(tied, size=min(len(tied), missing), replace=False)
        shares[chosen] += 1
        missing -= len(chosen)
    return shares.astype(int)


def packaged_data_file(package: str, relative: str) -> Path:
    """A data file shipped inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the built-in workloads read data shipped with {package!r}, which is not installed: pip install {package}")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but does not ship {relative}: reinstall it")
    return path


def scikit_learn_table(name: str) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled ``digits`` (64 pixel columns) or ``breast_cancer`` (30 features)
    table as (float64 features, int labels), the arrays its ``load_digits`` and
    ``load_breast_cancer`` return, read without importing scikit-learn."""
    if name == "digits":
        with gzip.open(packaged_data_file("sklearn", "datasets/data/digits.csv.gz"), "rt", encoding="utf-8") as file:
            table = np.loadtxt(file, delimiter=",")
        return table[:, :-1], table[:, -1].astype(int)
    with packaged_data_file("sklearn", f"datasets/data/{name}.csv").open(encoding="utf-8") as file:
        rows = csv.reader(file)
        next(rows)  # rows, columns and class names
        table = [(np.asarray(row[:-1], dtype=np.float64), int(row[-1])) for row in rows]
    return np.stack([features for features, _ in table]), np.array([label for _, label in table], dtype=int)


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
