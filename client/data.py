"""A site's training data, as a map-style ``torch.utils.data.Dataset``, and its minibatches.

Three sources, one code path (``data.source`` in the site config):

- ``partition``: the site's share of the workload's own training set (demos, simulations);
- ``file``: a ``.npz`` (arrays ``inputs`` and ``targets``) or ``.pt`` (dict of tensors);
- ``dataset``: the operator's own ``package.module:function`` called with ``data.options``,
  returning a map-style Dataset of ``(inputs, target)`` items. The factory is named by the
  site's own config, never by the coordinator, so it runs on the operator's authority.

Every source becomes a :class:`~dadfl.workloads.StepBatches`: a DataLoader (``num_workers``,
pinned memory on CUDA) whose batch at step t depends only on (batch seed, t), so a
replayed step after a restart or rejoin trains on the same samples.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from dadfl.workloads import Split, SplitDataset, StepBatches, Workload, partition

from .config import DatasetData, FileData, SiteConfig


def site_dataset(config: SiteConfig, workload: Workload) -> tuple[Dataset, int]:
    """The site's training Dataset and the seed of its minibatch order."""
    data = config.data
    if isinstance(data, FileData):
        return SplitDataset(read_data_file(data.path)), data.batch_seed
    if isinstance(data, DatasetData):
        return dataset_from_factory(data), data.batch_seed
    indices = partition(
        data.num_sites, len(workload.train), data.scheme, labels=workload.labels, alpha=data.alpha, seed=data.seed
    )
    seed = data.batch_seed if data.batch_seed is not None else data.seed + data.site_index
    return SplitDataset(workload.train, indices[data.site_index]), seed


def load_site_batches(config: SiteConfig, workload: Workload, batch_size: int, device: torch.device) -> StepBatches:
    """The site's minibatch of any step (see the module doc)."""
    dataset, seed = site_dataset(config, workload)
    return StepBatches(
        dataset, batch_size, seed, num_workers=config.data.num_workers, pin_memory=device.type == "cuda"
    )


def read_data_file(path: Path) -> Split:
    """``inputs``/``targets`` from a .npz (numpy arrays) or .pt (dict of tensors) file."""
    if path.suffix == ".npz":
        with np.load(path) as arrays:
            data = {k: torch.from_numpy(arrays[k]) for k in arrays.files}
    elif path.suffix == ".pt":
        data = torch.load(path, weights_only=True)
    else:
        raise ValueError(f"data.path {path}: use a .npz or .pt file holding 'inputs' and 'targets'")
    missing = {"inputs", "targets"} - set(data)
    if missing:
        raise ValueError(f"data.path {path}: missing {', '.join(sorted(missing))} (found {', '.join(sorted(data)) or 'nothing'})")
    return Split(data["inputs"], data["targets"])


def dataset_from_factory(data: DatasetData) -> Dataset:
    """Call the configured ``package.module:function`` and check it returned a usable Dataset."""
    module_name, function_name = data.factory.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"data.factory {data.factory!r}: cannot import {module_name!r} ({exc}); install the package "
            "that provides it in the site's environment (pip install -e <your package>)"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"data.factory {data.factory!r}: module {module_name!r} has no function {function_name!r}")
    try:
        dataset = function(**data.options)
    except TypeError as exc:
        raise ValueError(f"data.factory {data.factory!r} does not accept data.options {sorted(data.options)}: {exc}") from None
    if not isinstance(dataset, Dataset) or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"data.factory {data.factory!r} returned {type(dataset).__name__}, not a map-style "
            "torch.utils.data.Dataset (with __len__ and __getitem__); return one of (inputs, target) items"
        )
    if len(dataset) == 0:
        raise ValueError(f"data.factory {data.factory!r} returned an empty dataset")
    return dataset
