"""Site data as a torch Dataset from the site's own factory, batched by a DataLoader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from dadfl.client.config import DatasetData
from dadfl.client.data import dataset_from_factory
from dadfl.workloads import load_workload, partition
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config


class DigitsShare(Dataset):
    """A hospital's own Dataset: its share of the digits training set, one sample per item."""

    def __init__(self, site_index: int, num_sites: int):
        workload = load_workload("digits-mlp", hidden=16)
        index = partition(num_sites, len(workload.train), "iid", labels=workload.labels, seed=0)[site_index]
        self.inputs, self.targets = workload.train.inputs[index], workload.train.targets[index]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.inputs[i], int(self.targets[i])  # a plain int label, as many Datasets return


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(3), 0


def digits_share(site_index: int, num_sites: int) -> Dataset:
    return DigitsShare(site_index, num_sites)


def stream() -> IterableDataset:
    return Stream()


def not_a_dataset() -> list:
    return [1, 2]


def run(tmp_path, data_of_site_1: dict) -> tuple[str, list]:
    training = {"steps": 12, "eval_every": 12, "checkpoint_every": 0}
    config = server_config(tmp_path, strategy={"name": "powersgd", "options": {"rank": 1, "start_iter": 2}}, training=training, threads=1)
    server = ServerThread(config).start()
    sites = [
        SiteThread(site_config(tmp_path, "site-0", server.endpoint, 0, 2)).start(),
        SiteThread(site_config(tmp_path, "site-1", server.endpoint, 1, 2, data=data_of_site_1)).start(),
    ]
    summaries = [site.join() for site in sites]
    server.join()
    return summaries[0].fingerprint, summaries


@pytest.mark.network
def test_a_dataset_factory_trains_exactly_like_the_same_samples_from_a_partition(tmp_path):
    partition_data = {"source": "partition", "site_index": 1, "num_sites": 2, "batch_seed": 7}
    from_partition, _ = run(tmp_path / "partition", partition_data)
    factory_data = {
        "source": "dataset", "factory": "tests.workloads.test_site_dataset:digits_share",
        "options": {"site_index": 1, "num_sites": 2}, "batch_seed": 7, "num_workers": 1,
    }
    from_factory, summaries = run(tmp_path / "factory", factory_data)
    assert {s.fingerprint for s in summaries} == {from_factory}
    assert from_factory == from_partition, "same samples, same (seed, step) order: the same model"


@pytest.mark.parametrize(
    "factory,options,message",
    [
        ("tests.workloads.test_site_dataset:stream", {}, "not a map-style"),
        ("tests.workloads.test_site_dataset:not_a_dataset", {}, "not a map-style"),
        ("tests.workloads.test_site_dataset:missing", {}, "has no function 'missing'"),
        ("no_such_package.data:train", {}, "cannot import module 'no_such_package.data'"),
        ("tests.workloads.test_site_dataset:digits_share", {"site": 1}, "does not accept data.options"),
    ],
)
def test_a_bad_factory_is_one_clear_error(factory, options, message):
    with pytest.raises(ValueError, match=message) as error:
        dataset_from_factory(DatasetData(factory=factory, options=options))
    assert factory in str(error.value)
