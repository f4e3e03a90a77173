"""The effective rank read off the factors is that of the autograd gradient."""

import pytest
import torch

from dadfl.strategies import local_step, probe_layout, reference_update
from dadfl.strategies.payload import Factors
from dadfl.strategies.introspect import energy_rank, factor_energies, gradient_ranks

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches

RTOL = 1e-5  # σ below this fraction of the largest: rounding, not a component


def block_diagonal(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped layer's gradient as the map it is: one block per group."""
    rows = grad.reshape(grad.shape[0], -1).double()
    return torch.block_diag(*rows.chunk(groups, dim=0))


def numerical_rank(energies: torch.Tensor) -> int:
    return int((energies.sqrt() > RTOL * energies[0].sqrt()).sum())


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gru", "transformer"])
def test_energies_from_factors_are_the_squared_singular_values_of_autograds_gradient(kind):
    model = build(kind)
    x, y = site_batches(kind, sizes=(6,))[0]
    layout = probe_layout(model, x)
    local = local_step(model, layout, per_sample_cross_entropy, x, y)
    checked = 0
    for layer in layout.layers:
        factors = local.factors.get(layer.module)
        if factors is None:
            continue
        gradient = block_diagonal(local.grads[layer.weight], layer.groups)
        expected = torch.linalg.svdvals(gradient) ** 2
        energies = factor_energies(factors, layer.out_per_group, layer.in_per_group)
        common = min(len(expected), len(energies))
        assert torch.allclose(energies[:common], expected[:common], rtol=1e-4, atol=1e-9 * float(expected[0])), layer.module
        assert float(energies[common:].sum()) <= 1e-9 * float(expected[0])  # the rest is zero
        assert numerical_rank(energies) == int(torch.linalg.matrix_rank(gradient, rtol=RTOL)), layer.module
        for fraction in (0.9, 0.99):
            assert energy_rank(energies, fraction) == energy_rank(expected, fraction), (layer.module, fraction)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("true_rank,rows,m,k", [(3, 40, 24, 30), (2, 200, 24, 30), (5, 9, 64, 48)])
def test_a_low_rank_gradient_has_its_rank(true_rank, rows, m, k):
    """Inputs on a true_rank-dimensional subspace: Δᵀ A has rank true_rank, by either route
    (n×n kernels when rows ≤ min(m, k), the smaller Gram of W otherwise)."""
    g = torch.Generator().manual_seed(true_rank)
    A = (torch.randn(rows, true_rank, generator=g) @ torch.randn(true_rank, k, generator=g))[None]
    D = torch.randn(1, rows, m, generator=g)
    gradient = (D[0].T @ A[0]).double()
    energies = factor_energies(Factors(A, D), m, k)
    assert numerical_rank(energies) == int(torch.linalg.matrix_rank(gradient, rtol=RTOL)) == true_rank
    assert energy_rank(energies, 0.99) <= true_rank
    expected = torch.linalg.svdvals(gradient) ** 2
    assert torch.allclose(energies[:true_rank], expected[:true_rank], rtol=1e-4)


def test_lookups_and_a_tied_head_count_together():
    """An embedding's lookups plus a head tied to it: the table's gradient is their sum."""
    g = torch.Generator().manual_seed(0)
    V, d = 20, 6
    for rows, head_rows in ((12, 7), (3, 2)):  # the W route, then the kernels' route (rows < d)
        ids, delta_rows = torch.randint(0, V, (rows,), generator=g), torch.randn(rows, d, generator=g)
        A, D = torch.randn(1, head_rows, d, generator=g), torch.randn(1, head_rows, V, generator=g)
        gradient = (D[0].T @ A[0]).double().index_add(0, ids, delta_rows.double())
        energies = factor_energies(Factors(A, D, ids, delta_rows), V, d)
        expected = torch.linalg.svdvals(gradient) ** 2
        common = min(len(expected), len(energies))
        assert torch.allclose(energies[:common], expected[:common], rtol=1e-6, atol=1e-12 * float(expected[0]))


def test_gradient_ranks_per_site_and_of_the_sum():
    model = build("mlp")
    batches = site_batches("mlp", sizes=(5, 1, 3))
    layout = probe_layout(model, batches[0][0])
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches]
    ranks = gradient_ranks(layout, [local.factors for local in locals_])
    parts = ("site0", "site1", "site2", "sum")
    assert set(ranks) == {f"rank{p}/{layer.module}/{part}" for layer in layout.layers for p in (90, 99) for part in parts}
    reference = reference_update(model, per_sample_cross_entropy, batches)
    for layer in layout.layers:
        expected = torch.linalg.svdvals(reference[layer.weight].double()) ** 2
        assert ranks[f"rank99/{layer.module}/sum"] == energy_rank(expected, 0.99)
        assert ranks[f"rank90/{layer.module}/site1"] == 1  # one sample: a rank-1 gradient
    # A bounded cost: a gradient whose rows, outputs and inputs all exceed max_size is skipped;
    # the one-sample site's (one row) is still read.
    bounded = gradient_ranks(layout, [local.factors for local in locals_], max_size=2)
    assert set(bounded) == {key for key in ranks if key.endswith("/site1")}
