"""Structured power iteration: rank-r factors of Dᵀ A from A and D alone."""

import pytest
import torch

from dadfl.strategies.power_iteration import (
    Lookups,
    make_generator,
    power_iteration,
    reduce_sum,
    thin_product,
)


def factors(groups=1, n=40, k=30, m=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(groups, n, k, generator=g), torch.randn(groups, n, m, generator=g)


def gram(A, D):
    return torch.bmm(D.transpose(1, 2), A)


def rel(x, y):
    return float((x - y).norm() / y.norm())


def low_rank_plus_noise(rank=4, n=60, k=30, m=25, noise=1e-2, seed=1):
    """A, D with Dᵀ A = (rank-`rank` signal with decaying spectrum) + small full-rank noise."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(1, n, m, generator=g)
    A = torch.zeros(1, n, k)
    scales = torch.tensor([2.0**-i for i in range(rank)])
    A[0, :rank] = torch.randn(rank, k, generator=g) * scales[:, None] * 10
    A[0, rank:] = noise * torch.randn(n - rank, k, generator=g)
    D[0, :rank] = torch.linalg.qr(torch.randn(m, rank, generator=g)).Q.T * 5
    return A, D


@pytest.mark.parametrize("rank", [1, 2, 3, 7])
def test_returns_exactly_rank_components_ordered(rank):
    A, D = factors()
    result = power_iteration(A, D, rank)
    assert result.P.shape == (1, 20, rank) and result.Q.shape == (1, 30, rank)
    assert result.S.shape == (1, rank) and result.rank == rank
    assert bool((result.S[0, :-1] >= result.S[0, 1:]).all()), "components are ordered by σ"
    # Q has orthonormal columns; P's column norms are the singular values.
    assert torch.allclose(result.Q[0].T @ result.Q[0], torch.eye(rank), atol=1e-5)
    assert torch.allclose(result.P[0].norm(dim=0), result.S[0], rtol=1e-5)


@pytest.mark.parametrize("n,rank", [(5, 5), (5, 8), (3, 20), (1, 1), (1, 4)])
def test_full_rank_reproduces_gram(n, rank):
    """rank(Dᵀ A) ≤ n: at r ≥ n the product is reproduced to fp32 rounding."""
    A, D = factors(n=n)
    result = power_iteration(A, D, rank)
    assert result.rank == min(rank, 20, 30)
    assert rel(result.dense(), gram(A, D)) <= 1e-5


def test_rank_beyond_matrix_size_is_clipped_and_exact():
    A, D = factors(n=50, k=6, m=4)
    result = power_iteration(A, D, 10)
    assert result.rank == 4, "an m × k matrix has min(m, k) components"
    assert rel(result.dense(), gram(A, D)) <= 1e-5


def test_error_decreases_with_rank():
    A, D = low_rank_plus_noise()
    target = gram(A, D)
    errors = [rel(power_iteration(A, D, r, iterations=4).dense(), target) for r in (1, 2, 3, 4, 6)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.2 and errors[3] < 1e-2, errors
    # Close to the best rank-r error (Eckart–Young).
    sv = torch.linalg.svdvals(target[0])
    best = [float(sv[r:].norm() / sv.norm()) for r in (1, 2, 3, 4, 6)]
    assert all(e <= 1.03 * b + 1e-6 for e, b in zip(errors, best)), (errors, best)


def test_singular_values_estimate_the_true_ones():
    A, D = low_rank_plus_noise()
    result = power_iteration(A, D, 4, iterations=3)
    true = torch.linalg.svdvals(gram(A, D)[0])[:4]
    assert torch.allclose(result.S[0], true, rtol=1e-3)


def test_tol_drops_negligible_components_and_reports_rank():
    A, D = factors(n=3)  # rank 3
    result = power_iteration(A, D, 8, tol=1e-4)
    assert result.rank == 3 and result.P.shape[-1] == 3 and result.Q.shape[-1] == 3
    assert rel(result.dense(), gram(A, D)) <= 1e-5
    assert power_iteration(A, D, 8).rank == 8, "tol=0 keeps every requested component"


def test_same_seed_same_result_other_seed_differs():
    A, D = factors()
    first = power_iteration(A, D, 3, generator=make_generator(7))
    again = power_iteration(A, D, 3, generator=make_generator(7))
    other = power_iteration(A, D, 3, generator=make_generator(8))
    assert torch.equal(first.P, again.P) and torch.equal(first.Q, again.Q)
    assert not torch.equal(first.P, other.P)


def test_groups_are_independent():
    A, D = factors(groups=3, n=6, k=10, m=8)
    batched = power_iteration(A, D, 6)
    assert batched.P.shape == (3, 8, 6)
    assert rel(batched.dense(), gram(A, D)) <= 1e-5
    for g in range(3):
        true = torch.linalg.svdvals(gram(A[g : g + 1], D[g : g + 1])[0])
        assert torch.allclose(batched.S[g], true[:6], rtol=1e-4, atol=1e-4)
        alone = power_iteration(A[g : g + 1], D[g : g + 1], 6)
        assert rel(batched.dense()[g], alone.dense()[0]) <= 1e-5


def test_warm_start_converges_faster_than_random():
    A, D = low_rank_plus_noise(noise=0.5)
    target = gram(A, D)
    previous = power_iteration(A, D, 2, iterations=6)
    warm = power_iteration(A, D, 2, iterations=1, warm_start=previous.Q)
    cold = power_iteration(A, D, 2, iterations=1)
    assert rel(warm.dense(), target) < rel(cold.dense(), target)
    # A short warm start is completed with random columns.
    assert power_iteration(A, D, 4, warm_start=previous.Q).rank == 4


def test_reduce_sum_is_rank_r_approximation_of_the_sum():
    sites = [low_rank_plus_noise(rank=3, seed=s, noise=1e-3) for s in range(3)]
    parts = [power_iteration(A, D, 3, iterations=3) for A, D in sites]
    total = sum(p.dense() for p in parts)
    # Full rank of the concatenation: exact.
    full = reduce_sum([p.P for p in parts], [p.Q for p in parts], 9)
    assert rel(full.dense(), total) <= 1e-5
    # Rank 4 < 9: the best rank-4 approximation of the sum, by SVD of the dense sum.
    reduced = reduce_sum([p.P for p in parts], [p.Q for p in parts], 4, iterations=6)
    S = torch.linalg.svdvals(total[0])
    assert reduced.rank == 4
    best_error = float(S[4:].norm())  # Eckart–Young
    assert float((reduced.dense() - total).norm()) <= 1.02 * best_error
    assert torch.allclose(reduced.S[0], S[:4], rtol=2e-2)


def test_bad_shapes_are_refused():
    A, D = factors()
    with pytest.raises(ValueError, match="same G and n"):
        power_iteration(A, D[:, :5], 2)
    with pytest.raises(ValueError, match="rank must be at least 1"):
        power_iteration(A, D, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_deterministic_and_exact():
    A, D = (t.cuda() for t in factors(n=5))
    first = power_iteration(A, D, 5, generator=make_generator(3, "cuda"))
    again = power_iteration(A, D, 5, generator=make_generator(3, "cuda"))
    assert first.P.is_cuda and torch.equal(first.P, again.P)
    assert rel(first.dense(), gram(A, D)) <= 1e-5
    assert power_iteration(A, D, 2).P.is_cuda, "default generator lives on the tensors' device"


def lookups(n=50, vocab=12, d=9, seed=2):
    g = torch.Generator().manual_seed(seed)
    return Lookups(torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32), torch.randn(n, d, generator=g), vocab)


def one_hot_gradient(table: Lookups) -> torch.Tensor:
    """onehot(ids)ᵀ rows, built explicitly (what the gather/scatter must equal)."""
    return torch.nn.functional.one_hot(table.ids.long(), table.num_embeddings).float().T @ table.rows


def test_embedding_lookups_alone_full_rank_reproduce_the_table_gradient():
    table = lookups()
    result = power_iteration(None, None, 9, lookups=table)
    assert result.P.shape == (1, 12, 9) and result.Q.shape == (1, 9, 9)
    assert rel(result.dense()[0], one_hot_gradient(table)) < 1e-5


def test_tied_head_and_lookups_add_up():
    """A head Linear tied to the table (Dᵀ A, m = vocabulary) plus the lookups, at full rank and at rank 2."""
    table = lookups()
    A, D = factors(n=30, k=9, m=12, seed=3)
    full = gram(A, D)[0] + one_hot_gradient(table)
    assert rel(power_iteration(A, D, 9, lookups=table).dense()[0], full) < 1e-5
    best = torch.linalg.svdvals(full)[:2]
    approx = power_iteration(A, D, 2, iterations=20, lookups=table)
    torch.testing.assert_close(approx.S[0], best, rtol=1e-4, atol=0)


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("column_major", [False, True])
def test_thin_product_is_the_product_in_every_layout(rank, transposed, column_major):
    """M X in every memory order of M (row-major or a transposed view) and X (row- or
    column-major, as QR returns it), against the product in double precision."""
    g = torch.Generator().manual_seed(rank)
    M = torch.randn(2, 70, 50, generator=g)
    if transposed:
        M = torch.randn(2, 50, 70, generator=g).transpose(1, 2)
    X = torch.randn(2, rank, 50, generator=g).transpose(1, 2) if column_major else torch.randn(2, 50, rank, generator=g)
    product = thin_product(M, X)
    assert product.shape == (2, 70, rank)
    assert rel(product.double(), torch.bmm(M.double(), X.double())) < 1e-6
