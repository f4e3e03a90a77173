"""``dadfl.client.data`` — a site's training data, as a map-style ``torch.utils.data.Dataset``, and its minibatches.

Three sources, one code path (``data.source`` in the site config):

- ``partition``: the site's share of the workload's own training set (demos, simulations);
- ``file``: a ``.npz`` (arrays ``inputs`` and ``targets``), ``.pt`` (dict of tensors) or
  ``.csv`` (a header row, numeric columns, class labels in ``data.target_column``);
- ``dataset``: the operator's own ``package.module:function`` called with ``data.options``,
  returning a map-style Dataset of ``(inputs, target)`` items. The factory is named by the
  site's own config, never by the coordinator, so it runs on the operator's authority.

Every source becomes a :class:`~dadfl.workloads.StepBatches`: a DataLoader (``num_workers``,
pinned memory on CUDA) whose batch at step t depends only on (batch seed, t), so a
replayed step after a restart or rejoin trains on the same samples.

Held-out data for federated evaluation (``[evaluation]``) is a file of its own or a
seeded share of the training Dataset, which training then never sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import Dataset, IterableDataset, Subset

from dadfl.data_files import read_data_file
from dadfl.workloads import Split, SplitDataset, StepBatches, Workload, partition
from dadfl.workloads.base import import_user_module

from .config import DatasetData, EvaluationData, FileData, SiteConfig


def site_dataset(config: SiteConfig, workload: Workload, data_file: Split | None = None) -> tuple[Dataset, int]:
    """The site's training Dataset and the seed of its minibatch order (``data_file``: the
    contents of ``data.path`` when already read)."""
    data = config.data
    if isinstance(data, FileData):
        if data_file is None:
            data_file = read_data_file(data.path, data.target_column)
        return SplitDataset(data_file), data.batch_seed
    if isinstance(data, DatasetData):
        return dataset_from_factory(data, config.workload_path), data.batch_seed
    train = workload.training_data()
    indices = partition(data.num_sites, len(train), data.scheme, labels=workload.labels, alpha=data.alpha, seed=data.seed)
    seed = data.batch_seed if data.batch_seed is not None else data.seed + data.site_index
    return SplitDataset(train, indices[data.site_index]), seed


def load_site_batches(
    config: SiteConfig, workload: Workload, batch_size: int, device: torch.device, data_file: Split | None = None
) -> tuple[StepBatches, Dataset | None]:
    """The site's minibatch of any step (see the module doc) and its held-out Dataset
    (None without ``[evaluation]``)."""
    dataset, seed = site_dataset(config, workload, data_file)
    dataset, held_out = hold_out(dataset, config.evaluation, getattr(config.data, "target_column", "target"))
    batches = StepBatches(dataset, batch_size, seed, num_workers=config.data.num_workers, pin_memory=device.type == "cuda")
    return batches, held_out


def hold_out(dataset: Dataset, evaluation: EvaluationData | None, target_column: str = "target") -> tuple[Dataset, Dataset | None]:
    """Training and held-out Datasets: a held-out file, or a seeded share of ``dataset``."""
    if evaluation is None:
        return dataset, None
    if evaluation.path is not None:
        return dataset, SplitDataset(read_data_file(evaluation.path, target_column, field="evaluation.path"))
    count = round(len(dataset) * evaluation.fraction)
    if not 1 <= count < len(dataset):
        raise ValueError(
            f"evaluation.fraction {evaluation.fraction} of this site's {len(dataset)} samples leaves no held-out or no "
            "training samples; change evaluation.fraction or use evaluation.path"
        )
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(evaluation.seed))
    return Subset(dataset, order[count:].sort().values.tolist()), Subset(dataset, order[:count].sort().values.tolist())


def data_source(config: SiteConfig, workload: Workload) -> str:
    """How messages name the site's data: the config field and its value."""
    data = config.data
    if isinstance(data, FileData):
        return f"data.path {data.path}"
    if isinstance(data, DatasetData):
        return f"data.factory {data.factory}"
    return f"share {data.site_index} of {workload.name}'s training data"


def held_out_source(config: SiteConfig, source: str) -> str:
    """How messages name the site's held-out data."""
    if config.evaluation is not None and config.evaluation.path is not None:
        return f"evaluation.path {config.evaluation.path}"
    return f"the held-out share of {source}"


def dataset_from_factory(data: DatasetData, search_path: Sequence[Path] = ()) -> Dataset:
    """Call the configured ``package.module:function`` (looked up in the site's
    ``workload_path`` first) and check it returned a usable Dataset."""
    module_name, function_name = data.factory.split(":", 1)
    module = import_user_module(
        module_name, search_path, f"data.factory {data.factory!r}",
        "install the package that provides it in the site's environment (pip install -e <your package>) or name its "
        "parent folder in workload_path",
    )
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
