"""``dadfl.strategies.power_iteration`` — structured power iteration: a rank-r factorisation of Dᵀ A without forming Dᵀ A.

A captured layer's summed-loss weight gradient per group is G = Dᵀ A (m × k), with
A (n × k) its input rows and D (n × m) its output deltas. Subspace (block power)
iteration needs G only through the products

    G Q  = Dᵀ (A Q)        n·k·r + n·m·r flops, never m·k memory
    Gᵀ U = Aᵀ (D U)

so a rank-r factorisation costs O(n·(k + m)·r) per pass instead of O(n·k·m) for G.
One pass (``iterations`` counts them, at least 1):

    U     = orth(Dᵀ (A Q))          (m × r), orthonormal range estimate
    Q R   = qr(Aᵀ (D U))            (k × r) and (r × r); Uᵀ G = Rᵀ Qᵀ

The last pass ends with a Rayleigh–Ritz step on the small r × r matrix:
Rᵀ = Uᵣ Σ Vᵣᵀ gives G ≈ U Uᵀ G = (U Uᵣ Σ)(Q Vᵣ)ᵀ, so the result is

    P = U Uᵣ Σ   (m × r, scaled: sum units of G),   Q = Q Vᵣ   (k × r, orthonormal)

with components ordered by the singular-value estimates Σ. Exactly
r' = min(r, m, k) components are returned — an m × k matrix has no more — never
r' − 1. When r' ≥ rank(G) (for factors: rank(G) ≤ min(n, m, k)) the range is found
in one pass and P Qᵀ reproduces G to fp32 rounding. With ``tol`` > 0, components
with σ ≤ tol·σ_max (in every group) are dropped and ``rank`` says how many were kept.

Everything is batched over the groups of a grouped convolution: A (G, n, k),
D (G, n, m) -> P (G, m, r'), Q (G, k, r'), S (G, r').

**Embeddings.** A table E (V × d) looked up at ``ids`` with delta rows R has the gradient
G = onehot(ids)ᵀ R (V × d); ``Lookups`` applies it without building the one-hot:
G Q = scatter_add(ids, R Q) and Gᵀ U = Rᵀ U[ids]. ``power_iteration(..., lookups=...)``
adds it to Dᵀ A (a head tied to the table), or takes it alone (A, D None).

**Re-reduction.** A sum of rank-r products is itself a structured product:
Σ_s P_s Q_sᵀ = Dᵀ A with D = [P_1 … P_S]ᵀ and A = [Q_1 … Q_S]ᵀ (S·r rows), so the
server re-reduces the sites' factors to rank r with the same call (``reduce_sum``).

**Dense matrices.** ``dense_power_iteration`` runs the same passes on a matrix that is
dense anyway: the gradient of a parameter no factor capture covers, or a gradient plus an
error-feedback memory, which rank-dAD forms once because the memory update needs it.

**Randomness.** The random start comes from a seeded ``torch.Generator`` on the
tensors' device (``make_generator``), so runs are reproducible on CPU and CUDA; a
warm start (the previous step's Q) replaces it and usually needs fewer passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class LowRank:
    """G ≈ P Qᵀ per group: P (G, m, r) scaled, Q (G, k, r) orthonormal columns, S (G, r)."""

    P: torch.Tensor
    Q: torch.Tensor
    S: torch.Tensor

    @property
    def rank(self) -> int:
        """Components kept (columns of P and Q)."""
        return self.P.shape[-1]

    def dense(self) -> torch.Tensor:
        """P Qᵀ (G, m, k): what the factors approximate (rank-dAD's residual subtracts it)."""
        return torch.bmm(self.P, self.Q.transpose(1, 2))


@dataclass
class Lookups:
    """The gradient onehot(ids)ᵀ rows of a (V × d) table, applied by gather/scatter only."""

    ids: torch.Tensor  # (n,) integer
    rows: torch.Tensor  # (n, d)
    num_embeddings: int  # V

    def times(self, Q: torch.Tensor) -> torch.Tensor:
        """G Q for Q (1, d, r): (1, V, r), a scatter-add of rows·Q."""
        projected = self.rows @ Q[0]
        return projected.new_zeros(self.num_embeddings, Q.shape[2]).index_add_(0, self.ids.long(), projected)[None]

    def transposed_times(self, U: torch.Tensor) -> torch.Tensor:
        """Gᵀ U for U (1, V, r): (1, d, r), rowsᵀ times the gathered U[ids]."""
        return (self.rows.transpose(0, 1) @ U[0][self.ids.long()])[None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: same seed, same random start."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def power_iteration(
    A: torch.Tensor | None,
    D: torch.Tensor | None,
    rank: int,
    *,
    iterations: int = 2,
    warm_start: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    tol: float = 0.0,
    scale: float = 1.0,
    lookups: Lookups | None = None,
) -> LowRank:
    """Rank-``rank`` factors of M = scale·Dᵀ A per group, from A (G, n, k) and D (G, n, m).

    ``warm_start`` (G, k, c): the Q of a previous call; missing columns (c < r') are
    drawn at random, extra ones ignored. ``generator``: for the random start, on the
    tensors' device (default: seed 0). ``tol``: relative threshold below which
    components are dropped (0 keeps all r' = min(rank, m, k)). 2-D A (n, k)
    and D (n, m) are one group; the results keep the group axis. Cost: ``iterations`` ×
    2·G·n·(k + m)·r' flops plus QR/SVD of (m × r'), (k × r') and
    (r' × r') blocks. ``lookups``: an embedding's part of the same (one-group) matrix,
    added to Dᵀ A before scaling; with A and D None it is the whole structured product.
    """
    if A is None and D is None and lookups is not None:  # one group, the table's m × k
        m, k = lookups.num_embeddings, lookups.rows.shape[1]
        A, D = lookups.rows.new_zeros(1, 0, k), lookups.rows.new_zeros(1, 0, m)
    if A.dim() == 2 and D.dim() == 2:  # one group
        A, D = A.unsqueeze(0), D.unsqueeze(0)
        if warm_start is not None and warm_start.dim() == 2:
            warm_start = warm_start.unsqueeze(0)
    if A.dim() != 3 or D.dim() != 3 or A.shape[:2] != D.shape[:2]:
        raise ValueError(
            f"power_iteration needs A (G, n, k) and D (G, n, m) with the same G and n; "
            f"got A {tuple(A.shape)} and D {tuple(D.shape)}"
        )
    groups, _, k = A.shape
    m = D.shape[2]
    dtype = A.dtype
    if dtype in LOW_PRECISION:  # QR and SVD need single precision at least
        A, D = A.float(), D.float()
        if lookups is not None:
            lookups = Lookups(lookups.ids, lookups.rows.float(), lookups.num_embeddings)
    Dt, At = D.transpose(1, 2), A.transpose(1, 2)

    def times(Q: torch.Tensor) -> torch.Tensor:  # M Q
        out = torch.bmm(Dt, torch.bmm(A, Q))
        if lookups is not None:
            out = out + lookups.times(Q)
        if scale != 1.0:
            out = out * scale
        return out

    def transposed_times(U: torch.Tensor) -> torch.Tensor:  # Mᵀ U
        out = torch.bmm(At, torch.bmm(D, U))
        if lookups is not None:
            out = out + lookups.transposed_times(U)
        if scale != 1.0:
            out = out * scale
        return out

    return _subspace_iteration(
        times, transposed_times, A, groups, m, k, rank, iterations, warm_start, generator, tol, dtype
    )


def dense_power_iteration(
    M: torch.Tensor,
    rank: int,
    *,
    iterations: int = 2,
    warm_start: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    tol: float = 0.0,
) -> LowRank:
    """Rank-``rank`` factors of a dense M (G, m, k) (or (m, k)) by the same passes.

    For matrices that are dense anyway (gradients no factor capture covers).
    Cost: ``iterations`` × 4·G·m·k·r' flops plus the same small QR/SVDs.
    """
    if M.dim() == 2:
        M = M.unsqueeze(0)
        if warm_start is not None and warm_start.dim() == 2:
            warm_start = warm_start.unsqueeze(0)
    if M.dim() != 3:
        raise ValueError(f"dense_power_iteration needs M (G, m, k); got {tuple(M.shape)}")
    dtype = M.dtype
    if dtype in LOW_PRECISION:
        M = M.float()
    groups, m, k = M.shape
    Mt = M.transpose(1, 2)
    return _subspace_iteration(
        lambda Q: thin_product(M, Q), lambda U: thin_product(Mt, U), M, groups, m, k, rank, iterations, warm_start,
        generator, tol, dtype,
    )


def thin_product(M: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """M X for a dense M (G, m, k) and a thin X (G, k, r): the same sums, in an operand order
    the CPU BLAS runs at memory speed. With r ≥ 2, M X as written makes MKL pack the whole of
    M for a handful of columns unless M is row-major and X column-major (as QR returns it):
    measured at 1024 × 1024, r = 2 and 4, 4-60x slower. Every other layout runs as (Xᵀ Mᵀ)ᵀ.
    At r = 1 both orders are one matrix-vector product; on the benchmark the floats are
    also unchanged at r = 2 and differ in the last bits at r = 4."""
    if M.is_contiguous() and X.transpose(1, 2).is_contiguous():
        return torch.bmm(M, X)
    return torch.bmm(X.transpose(1, 2), M.transpose(1, 2)).transpose(1, 2)


def _subspace_iteration(
    times, transposed_times, like: torch.Tensor, groups: int, m: int, k: int, rank: int, iterations: int,
    warm_start: torch.Tensor | None, generator: torch.Generator | None, tol: float, dtype: torch.dtype,
) -> LowRank:
    """The passes and the Rayleigh–Ritz step, given M Q (``times``) and Mᵀ U."""
    if rank < 1:
        raise ValueError(f"power_iteration: rank must be at least 1, got {rank}")
    if iterations < 1:
        raise ValueError(f"power_iteration: iterations must be at least 1, got {iterations}")
    if tol < 0:
        raise ValueError(f"power_iteration: tol must be >= 0, got {tol}")
    r = min(rank, m, k)
    Q = _start(like, groups, k, r, warm_start, generator)
    for _ in range(iterations):
        U, _ = torch.linalg.qr(times(Q))  # (G, m, r)
        Q, R = torch.linalg.qr(transposed_times(U))  # (G, k, r), (G, r, r)
    if not bool(torch.isfinite(R).all()):  # finite factors whose products overflow: the SVD would raise LinAlgError
        raise ValueError("power_iteration: the products of the factors are not finite (they overflow their float type)")
    # Rayleigh–Ritz: Uᵀ M = Rᵀ Qᵀ; the SVD of the small Rᵀ orders the components.
    Ur, S, Vh = torch.linalg.svd(R.transpose(1, 2))
    P = torch.bmm(U, Ur) * S.unsqueeze(1)
    Q = torch.bmm(Q, Vh.transpose(1, 2))

    if tol > 0:
        keep = kept_components(S, tol)
        P, Q, S = P[..., :keep], Q[..., :keep], S[..., :keep]
    return LowRank(P.to(dtype), Q.to(dtype), S.to(dtype))


def kept_components(S: torch.Tensor, tol: float) -> int:
    """Components with σ > tol·σ_max in some group (S sorted descending); at least 1."""
    top = S[..., :1]
    count = int((S > tol * top).sum(dim=-1).max()) if S.numel() else 0
    return max(1, count)


def reduce_sum(
    Ps: Sequence[torch.Tensor],
    Qs: Sequence[torch.Tensor],
    rank: int,
    *,
    iterations: int = 2,
    warm_start: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    tol: float = 0.0,
    scale: float = 1.0,
) -> LowRank:
    """Rank-``rank`` factors of scale·Σ_s P_s Q_sᵀ (each (G, m, r_s), (G, k, r_s)).

    The sum is Dᵀ A with D = [P_1 … P_S]ᵀ, A = [Q_1 … Q_S]ᵀ: the same structured
    power iteration, on S·r rows.
    """
    D = torch.cat(list(Ps), dim=2).transpose(1, 2)
    A = torch.cat(list(Qs), dim=2).transpose(1, 2)
    return power_iteration(
        A, D, rank, iterations=iterations, warm_start=warm_start, generator=generator, tol=tol, scale=scale,
    )


def _start(
    A: torch.Tensor, groups: int, k: int, r: int, warm_start: torch.Tensor | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Initial Q (G, k, r): the warm start, completed with random columns if short."""
    have = 0
    if warm_start is not None:
        if warm_start.dim() != 3 or warm_start.shape[0] != groups or warm_start.shape[1] != k:
            raise ValueError(
                f"power_iteration: warm_start must be ({groups}, {k}, r); got {tuple(warm_start.shape)}"
            )
        have = min(r, warm_start.shape[2])
        if have == r:
            return warm_start[..., :r].to(device=A.device, dtype=A.dtype)
    if generator is None:
        generator = make_generator(0, A.device)
    fresh = torch.randn((groups, k, r - have), generator=generator, device=A.device, dtype=A.dtype)
    if have == 0:
        return fresh
    return torch.cat([warm_start[..., :have].to(device=A.device, dtype=A.dtype), fresh], dim=2)
