"""``dadfl.workloads.batches`` — a site's minibatches: the batch of step t is a pure function of (seed, t, the data).

Each epoch of a site's n samples is its own permutation, drawn from a generator seeded by
(seed, epoch); epoch e serves steps e·k … e·k + k − 1 with k = n // b full batches of
b = min(batch_size, n) samples (the n − k·b left over are left out of that epoch only).
So a replayed step — after a restart, a rejoin, an aborted attempt — draws exactly the
batch it drew the first time, whatever was drawn before, in every mode (in-process
simulation, site processes, Flower).

Batches come from a ``torch.utils.data.DataLoader`` over a map-style ``Dataset`` with a
batch sampler that yields those positions, so worker processes and pinned memory work
as usual; without either, the same positions are collated in place (``collate``). Bit-identical replays need ``dataset[i]`` to be deterministic (no random
augmentation inside ``__getitem__``).
"""

from __future__ import annotations

import secrets
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from .base import Split

SEED_MASK = (1 << 64) - 1


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the samples in ``epoch``: one permutation per (seed, epoch)."""
    mixed = np.random.SeedSequence([seed & SEED_MASK, epoch]).generate_state(1, np.uint64)[0]
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(int(mixed)))


def batch_positions(num_samples: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Positions (0 … num_samples − 1) of the samples of the batch at ``step``."""
    return torch.tensor(next(iter(StepBatchSampler(num_samples, batch_size, seed, start=step))), dtype=torch.int64)


def check_batching(num_samples: int, batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if num_samples == 0:
        raise ValueError("site has no samples: cannot draw minibatches from an empty dataset")


class StepBatchSampler(Sampler[list[int]]):
    """Endless batches of dataset positions for steps ``start``, ``start + 1`` … (see module doc)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, start: int = 0):
        check_batching(num_samples, batch_size)
        self.num_samples, self.batch_size, self.seed, self.start = num_samples, batch_size, seed, start

    def __iter__(self) -> Iterator[list[int]]:
        return (positions.tolist() for positions in self.positions())

    def positions(self) -> Iterator[torch.Tensor]:
        """The batches as int64 tensors of positions (what ``collate`` gathers with)."""
        size = min(self.batch_size, self.num_samples)
        per_epoch = self.num_samples // size
        epoch, first = divmod(self.start, per_epoch)
        while True:
            order = epoch_permutation(self.num_samples, self.seed, epoch)
            for slot in range(first, per_epoch):
                yield order[slot * size : (slot + 1) * size]
            epoch, first = epoch + 1, 0


class SplitDataset(Dataset):
    """The samples ``index`` picks out of a :class:`Split` (all of them by default)."""

    def __init__(self, split: Split, index: torch.Tensor | None = None):
        self.split = split
        self.index = torch.arange(len(split)) if index is None else torch.as_tensor(index, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = int(self.index[position])
        return self.split.inputs[sample], self.split.targets[sample]


def collate(dataset: Dataset, positions: list[int] | torch.Tensor):
    """``default_collate([dataset[i] for i in positions])``. For a :class:`SplitDataset` (the
    data already in memory) one gather per tensor instead: the same values, without a Python
    call per sample (a step of a small model spent more time drawing its batch than training)."""
    if type(dataset) is SplitDataset:  # a subclass may change __getitem__
        chosen = dataset.index.index_select(0, torch.as_tensor(positions, dtype=torch.int64))
        return dataset.split.inputs.index_select(0, chosen), dataset.split.targets.index_select(0, chosen)
    return default_collate([dataset[i] for i in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)])


class StepBatches:
    """A site's minibatch of any step, served by a DataLoader (see module doc).

    ``at(step)`` continues the loader when steps come in order and starts it again at
    ``step`` otherwise (a replay), so workers prefetch the steps that follow.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int, num_workers: int = 0, pin_memory: bool = False
    ):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"{type(dataset).__name__} is not a map-style Dataset with __len__ and __getitem__: "
                "minibatches are drawn by position so that a step's batch depends only on (seed, step)"
            )
        check_batching(len(dataset), batch_size)
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._loader: Iterator | None = None
        self._next_step = -1

    def __len__(self) -> int:
        return len(self.dataset)

    def at(self, step: int):
        """The ``(inputs, targets)`` batch of ``step``."""
        if self._loader is None or step != self._next_step:
            sampler = StepBatchSampler(len(self.dataset), self.batch_size, self.seed, start=step)
            if not self.num_workers and not self.pin_memory:  # nothing for a DataLoader to add
                self._loader = (collate(self.dataset, positions) for positions in sampler.positions())
            else:
                # Workers start by spawn: a site forks after gRPC's threads exist, and a forked
                # child of a process with gRPC threads can hang.
                context = "spawn" if self.num_workers else None
                self._loader = iter(
                    DataLoader(
                        self.dataset, batch_sampler=sampler, num_workers=self.num_workers, pin_memory=self.pin_memory,
                        multiprocessing_context=context,
                    )
                )
        self._next_step = step + 1
        return next(self._loader)


POISSON_STREAM = 0x504F4953  # keeps Poisson draws apart from the epoch permutations of the same seed


def poisson_positions(num_samples: int, rate: float, seed: int | None, step: int) -> torch.Tensor:
    """Positions of the batch at ``step`` under Poisson sampling: each sample independently
    with probability ``rate`` (differential privacy's accountant assumes exactly this). With a
    ``seed``, from a generator seeded by (seed, step) alone: a replayed step draws the same
    batch (the in-process simulation, which never replays). With ``seed`` None, from the
    operating system's randomness at every call: a replayed step is a new sample (site
    processes, see ``dadfl.privacy``). The batch may be empty."""
    if not 0 < rate <= 1:
        raise ValueError(f"Poisson sampling rate must be in (0, 1], got {rate}")
    if seed is None:
        mixed = secrets.randbits(63)
    else:
        mixed = int(np.random.SeedSequence([seed & SEED_MASK, step, POISSON_STREAM]).generate_state(1, np.uint64)[0])
    draws = torch.rand(num_samples, generator=torch.Generator().manual_seed(mixed), dtype=torch.float64)
    return torch.nonzero(draws < rate).reshape(-1)


class PoissonBatches:
    """A site's Poisson-sampled batch of any step (``poisson_positions``), same interface as
    ``StepBatches``; an empty draw is an empty ``(inputs, targets)`` pair of the right shapes."""

    def __init__(self, dataset: Dataset, rate: float, seed: int | None):
        check_batching(len(dataset), 1)
        self.dataset, self.rate, self.seed = dataset, rate, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def at(self, step: int):
        positions = poisson_positions(len(self.dataset), self.rate, self.seed, step).tolist()
        if not positions:
            inputs, targets = collate(self.dataset, [0])
            return inputs[:0], targets[:0]
        return collate(self.dataset, positions)


def site_batches(split: Split, index: torch.Tensor, batch_size: int, seed: int) -> StepBatches:
    """The minibatches of the samples ``index`` picks out of ``split`` (simulations, demos)."""
    return StepBatches(SplitDataset(split, index), batch_size, seed)
