"""Partitioning a training set across sites, and one site's minibatch of any step."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dadfl.workloads import Split, batch_positions, partition, site_batches


@pytest.fixture(scope="module")
def digit_labels() -> torch.Tensor:
    return torch.from_numpy(load_digits().target).long()


def label_distributions(parts: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """One row per site: the share of each class among the site's samples."""
    counts = torch.stack([torch.bincount(labels[part], minlength=10) for part in parts]).double()
    return counts / counts.sum(dim=1, keepdim=True)


def mean_distance_from_global(parts: list[torch.Tensor], labels: torch.Tensor) -> float:
    """Mean total-variation distance between each site's label mix and the whole set's."""
    overall = torch.bincount(labels, minlength=10).double() / len(labels)
    return (label_distributions(parts, labels) - overall).abs().sum(dim=1).div(2).mean().item()


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "quantity"])
def test_sites_are_disjoint_and_cover_every_sample(scheme, digit_labels):
    parts = partition(7, len(digit_labels), scheme, labels=digit_labels, alpha=0.3, seed=3)
    assert len(parts) == 7
    assert all(part.dtype == torch.int64 and torch.equal(part, part.sort().values) for part in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(len(digit_labels)))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "quantity"])
def test_partition_is_reproduced_by_its_seed(scheme, digit_labels):
    first = partition(5, len(digit_labels), scheme, labels=digit_labels, seed=11)
    again = partition(5, len(digit_labels), scheme, labels=digit_labels, seed=11)
    other = partition(5, len(digit_labels), scheme, labels=digit_labels, seed=12)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_iid_sites_differ_in_size_by_at_most_one():
    sizes = [len(part) for part in partition(7, 100, "iid")]
    assert max(sizes) - min(sizes) <= 1


def test_small_alpha_dirichlet_skews_the_labels(digit_labels):
    n = len(digit_labels)
    skewed = partition(5, n, "dirichlet", labels=digit_labels, alpha=0.1, seed=0)
    nearly_iid = partition(5, n, "dirichlet", labels=digit_labels, alpha=1000.0, seed=0)
    iid = partition(5, n, "iid", seed=0)
    assert mean_distance_from_global(skewed, digit_labels) > 0.4
    assert mean_distance_from_global(nearly_iid, digit_labels) < 0.1
    assert mean_distance_from_global(iid, digit_labels) < 0.1


def test_quantity_skew_gives_unequal_sizes_with_iid_labels(digit_labels):
    parts = partition(5, len(digit_labels), "quantity", alpha=0.5, seed=0)
    sizes = sorted(len(part) for part in parts)
    assert sizes[-1] > 3 * sizes[0]
    largest = max(parts, key=len)
    assert mean_distance_from_global([largest], digit_labels) < 0.1


@pytest.mark.parametrize("scheme", ["dirichlet", "quantity"])
def test_every_site_gets_min_per_site_samples(scheme):
    labels = torch.arange(200) % 10
    unconstrained = partition(20, 200, scheme, labels=labels, alpha=0.05, seed=0, min_per_site=0)
    assert min(len(part) for part in unconstrained) < 5  # so the fix-up has work to do
    parts = partition(20, 200, scheme, labels=labels, alpha=0.05, seed=0, min_per_site=5)
    assert min(len(part) for part in parts) >= 5
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(200))


def test_labels_may_be_a_numpy_array(digit_labels):
    from_tensor = partition(4, len(digit_labels), "dirichlet", labels=digit_labels, seed=5)
    from_numpy = partition(4, len(digit_labels), "dirichlet", labels=digit_labels.numpy(), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(from_tensor, from_numpy))


@pytest.mark.parametrize(
    ("arguments", "options", "message"),
    [
        ((3, 10, "shards"), {}, "'shards'; valid schemes are 'iid', 'dirichlet', 'quantity'"),
        ((3, 10, "dirichlet"), {"labels": np.zeros(10), "alpha": 0.0}, "alpha must be a positive"),
        ((3, 10, "quantity"), {"alpha": -1.0}, "alpha must be a positive"),
        ((11, 10, "iid"), {}, "more sites than samples"),
        ((0, 10, "iid"), {}, "n_sites must be at least 1"),
        ((3, 10, "dirichlet"), {}, "needs labels="),
        ((3, 10, "dirichlet"), {"labels": np.zeros(9)}, r"labels must have shape \(10,\)"),
        ((3, 10, "quantity"), {"min_per_site": 4}, "need 12 samples"),
    ],
)
def test_bad_arguments_get_clear_errors(arguments, options, message):
    with pytest.raises(ValueError, match=message):
        partition(*arguments, **options)


@pytest.fixture()
def numbered_split() -> Split:
    """A split whose inputs are each sample's own index, so batches show what they hold."""
    return Split(torch.arange(50).float().unsqueeze(1), torch.arange(50))


def test_site_batches_draw_only_the_sites_samples_a_full_epoch_at_a_time(numbered_split):
    index = torch.arange(0, 50, 2)  # 25 samples
    batches = site_batches(numbered_split, index, batch_size=8, seed=0)
    epoch = [batches.at(step) for step in range(3)]
    assert all(inputs.shape == (8, 1) and targets.shape == (8,) for inputs, targets in epoch)
    drawn = torch.cat([targets for _, targets in epoch])
    assert len(drawn.unique()) == 24 and set(drawn.tolist()) <= set(index.tolist())
    next_epoch = torch.cat([batches.at(step)[1] for step in range(3, 6)])
    assert not torch.equal(drawn, next_epoch)  # reshuffled


def test_site_batches_are_reproduced_by_their_seed(numbered_split):
    index = torch.arange(30)
    first = site_batches(numbered_split, index, batch_size=4, seed=7)
    again = site_batches(numbered_split, index, batch_size=4, seed=7)
    other = site_batches(numbered_split, index, batch_size=4, seed=8)
    first_targets = [first.at(step)[1] for step in range(20)]
    assert all(torch.equal(t, again.at(step)[1]) for step, t in enumerate(first_targets))
    assert not all(torch.equal(t, other.at(step)[1]) for step, t in enumerate(first_targets))


def test_the_batch_of_a_step_does_not_depend_on_what_was_drawn_before(numbered_split):
    index = torch.arange(3, 40)  # 37 samples, 9 batches of 4 per epoch: steps cross epochs
    in_order = site_batches(numbered_split, index, batch_size=4, seed=5)
    expected = [in_order.at(step) for step in range(25)]
    for start in (0, 7, 9, 17):
        resumed = site_batches(numbered_split, index, batch_size=4, seed=5)
        for step in range(start, 25):
            inputs, targets = resumed.at(step)
            assert torch.equal(inputs, expected[step][0]) and torch.equal(targets, expected[step][1]), (start, step)
    replayed = [in_order.at(step)[1] for step in (3, 4, 3, 12)]  # going back (an aborted step, a restart)
    assert all(torch.equal(t, expected[s][1]) for t, s in zip(replayed, (3, 4, 3, 12)))
    positions = batch_positions(len(index), 4, seed=5, step=11)
    assert torch.equal(index[positions], expected[11][1])


def test_a_site_smaller_than_the_batch_gets_all_its_samples_each_time(numbered_split):
    index = torch.tensor([3, 9, 40])
    batches = site_batches(numbered_split, index, batch_size=16, seed=0)
    for step in range(3):
        inputs, targets = batches.at(step)
        assert sorted(targets.tolist()) == [3, 9, 40]
        assert torch.equal(inputs.squeeze(1).long(), targets)


def test_site_batches_reject_an_empty_site_or_a_bad_batch_size(numbered_split):
    with pytest.raises(ValueError, match="no samples"):
        site_batches(numbered_split, torch.tensor([], dtype=torch.int64), batch_size=4, seed=0)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        site_batches(numbered_split, torch.arange(5), batch_size=0, seed=0)


def test_in_memory_batches_equal_the_dataloaders_bit_for_bit():
    """A SplitDataset is collated in place, not through a DataLoader: the same tensors (values,
    dtype, shape, strides) for sequential steps, replays and Poisson draws."""
    from dadfl.workloads import SplitDataset, StepBatches
    from dadfl.workloads.batches import PoissonBatches

    class ThroughTheLoader(SplitDataset):  # a subclass takes the DataLoader's path
        pass

    digits = load_digits()
    split = Split(torch.as_tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8), torch.as_tensor(digits.target))
    index = torch.arange(3, 700, 2)
    fast, loader = StepBatches(SplitDataset(split, index), 32, seed=5), StepBatches(ThroughTheLoader(split, index), 32, seed=5)
    for step in [*range(15), 3, 400, 401, 0]:
        for a, b in zip(fast.at(step), loader.at(step)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    fast, loader = PoissonBatches(SplitDataset(split, index), 0.05, seed=5), PoissonBatches(ThroughTheLoader(split, index), 0.05, seed=5)
    for step in range(10):
        assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(fast.at(step), loader.at(step)))
