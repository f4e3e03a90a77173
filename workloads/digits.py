"""``dadfl.workloads.digits`` — handwritten digits (scikit-learn's bundled 8x8 images, 10 classes): an MLP and a CNN.

The MLP is a plain ``nn.Sequential`` of Linear layers and elementwise activations, the
shape edAD needs. The CNN mixes a strided, padded convolution with a grouped one, the
cases convolution factor capture must get right.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .base import Split, Workload
from .common import check_positive, classification, scikit_learn_table, stratified_split, two_hidden_mlp

NUM_CLASSES = 10
IMAGE_SIDE = 8


def _splits(seed: int, test_fraction: float) -> tuple[Split, Split]:
    """Pixels scaled to [0, 1] as flat 64-vectors, split stratified by digit."""
    pixels, labels = scikit_learn_table("digits")
    pixels = (pixels / 16.0).astype(np.float32)
    train_x, test_x, train_y, test_y = stratified_split(pixels, labels, test_fraction, seed)
    return (
        Split(torch.from_numpy(train_x), torch.from_numpy(train_y).long()),
        Split(torch.from_numpy(test_x), torch.from_numpy(test_y).long()),
    )


def _as_images(split: Split) -> Split:
    """Flat 64-vectors as one-channel 8x8 images, ``(n, 1, 8, 8)``."""
    return Split(split.inputs.view(-1, 1, IMAGE_SIDE, IMAGE_SIDE), split.targets)


def mlp(hidden: int = 256, seed: int = 0, test_fraction: float = 0.25) -> Workload:
    """Two hidden ReLU layers on the flat 64-pixel vector."""
    check_positive(hidden=hidden)
    train, test = _splits(seed, test_fraction)

    def make() -> nn.Module:
        return two_hidden_mlp(IMAGE_SIDE * IMAGE_SIDE, hidden, NUM_CLASSES)

    return classification("digits-mlp", make, seed, train, test, {"hidden": hidden, "seed": seed, "test_fraction": test_fraction})


def cnn(seed: int = 0, test_fraction: float = 0.25, channels: int = 16) -> Workload:
    """Strided padded conv (8x8 -> 4x4), grouped conv (2 groups), linear head."""
    check_positive(channels=channels)
    if channels % 2:
        raise ValueError(f"channels must be even (the second convolution has 2 groups), got {channels}")
    train, test = _splits(seed, test_fraction)
    train, test = _as_images(train), _as_images(test)

    def make() -> nn.Module:
        pooled_side = IMAGE_SIDE // 2
        return nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1, groups=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(channels * pooled_side * pooled_side, NUM_CLASSES),
        )

    return classification("digits-cnn", make, seed, train, test, {"seed": seed, "test_fraction": test_fraction, "channels": channels})
