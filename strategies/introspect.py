"""``dadfl.strategies.introspect`` — effective rank of a layer's gradient, read off its factors: introspection into training.

A captured layer's summed-loss gradient is W = Δᵀ A per group (``base.Factors``), plus
onehot(ids)ᵀ rows for an embedding's lookups. The nonzero eigenvalues of (A Aᵀ)(Δ Δᵀ) — an
n × n product, n the rows — are the squared singular values σ_i² of W, the energy of its
components, and W is never formed to get them: with the thin QR factorisations Δᵀ = Q_D R_D
and Aᵀ = Q_A R_A, W = Q_D (R_D R_Aᵀ) Q_Aᵀ, so the σ_i are those of the small core R_D R_Aᵀ
(min(m, n) × min(k, n); its Gram matrix R_D (A Aᵀ) R_Dᵀ has the eigenvalues of
(A Aᵀ)(Δ Δᵀ)), in float64. A grouped layer's gradient is block-diagonal (each group maps its
own inputs to its own outputs): its σ_i² are every group's together. With lookups (an
embedding, a head tied to it) the left rows X = [Δ; onehot(ids)] and right rows
Y = [A; Δ rows] give W = Xᵀ Y; the eigenvalues of Hᵀ (X Xᵀ) H with Y Yᵀ = H Hᵀ are read
from the n × n kernels (X Xᵀ from the ids, never the one-hot), or from W's smaller Gram
matrix when W has a side shorter than n.

``energy_rank(σ², f)`` is the number of leading components holding the fraction f of the
energy (``FRACTIONS``: 90% and 99%): a gradient whose energy sits in a few directions has a
small one, and a rank-r method with r at least that keeps most of that step's gradient.
Read per site and for the sum over sites during training, it shows how the gradient's
rank moves, and which rank a layer needs.

Cost per layer and group: two thin QRs, (m + k)·n·min(m, k, n) flops, and the SVD of the
core, min(m, n)·min(k, n)²; a layer with min(n, m, k) > ``max_size`` (``MAX_SIZE``, 512)
is skipped, so the cost stays bounded whatever the batch (convolutions have batch ×
positions rows, but small m and k). On a small model one reading costs about what the
sites' forward/backward passes cost (``docs/strategies.md``), which is why the simulation
reads them every ``rank_every`` = 5 steps by default.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .base import group_rows, weight_from_factors, weight_from_lookups
from .layout import Layout
from .payload import Factors

FRACTIONS = (0.90, 0.99)
MAX_SIZE = 512


def factor_energies(factors: Factors, out_size: int, in_size: int, max_size: int = MAX_SIZE) -> torch.Tensor | None:
    """σ_i² of the gradient whose factors these are (float64, descending), or None when
    there are none or min(rows, out, in) > ``max_size``. ``out_size`` × ``in_size`` is one
    group's m × k (a table's V × d); a grouped layer maps each group's inputs to its own
    outputs, so its gradient is block-diagonal and its σ_i² are every group's together."""
    linear = factors.A is not None and factors.D is not None
    lookups = factors.ids is not None and factors.rows is not None
    rows = (factors.A.shape[1] if linear else 0) + (factors.ids.shape[0] if lookups else 0)
    if rows == 0 or min(rows, out_size, in_size) > max_size:
        return None
    if not lookups:  # (G, min(m, n), min(k, n)) cores, one per group
        R_D = torch.linalg.qr(factors.D.double().transpose(1, 2), mode="r").R
        R_A = torch.linalg.qr(factors.A.double().transpose(1, 2), mode="r").R
        return (torch.linalg.svdvals(R_D @ R_A.transpose(1, 2)) ** 2).flatten().sort(descending=True).values
    if min(out_size, in_size) < rows:  # W's smaller side beats the rows: form W and decompose its smaller Gram
        W = _weight(factors, out_size, in_size)
        return _descending(torch.linalg.eigvalsh(W @ W.T if out_size <= in_size else W.T @ W))
    left, right = _kernels(factors)
    values, vectors = torch.linalg.eigh(right)
    half = vectors * values.clamp(min=0).sqrt()  # Y Yᵀ = half halfᵀ
    return _descending(torch.linalg.eigvalsh(half.T @ left @ half))


def _weight(factors: Factors, out_size: int, in_size: int) -> torch.Tensor:
    """One group's W = Dᵀ A + onehot(ids)ᵀ rows, float64."""
    W = torch.zeros(out_size, in_size, dtype=torch.float64, device=(factors.A if factors.A is not None else factors.rows).device)
    if factors.A is not None and factors.D is not None:
        W += weight_from_factors(factors.A.double(), factors.D.double(), W.shape)  # one group
    if factors.ids is not None and factors.rows is not None:
        W += weight_from_lookups(factors.ids, factors.rows.double(), W.shape)
    return W


def _kernels(factors: Factors) -> tuple[torch.Tensor, torch.Tensor]:
    """X Xᵀ and Y Yᵀ (float64) over the rows (one group): linear/conv rows first, then lookups."""
    lefts, rights = [], []
    if factors.A is not None and factors.D is not None:
        D = factors.D[0].double()
        rights.append(factors.A[0].double())
        lefts.append(D @ D.T)
    if factors.ids is not None and factors.rows is not None:
        ids = factors.ids.long()
        rights.append(factors.rows.double())
        lefts.append((ids[:, None] == ids[None, :]).double())  # onehot(ids) onehot(ids)ᵀ
    Y = torch.cat(rights)
    if len(lefts) == 1:
        return lefts[0], Y @ Y.T
    # A head tied to the table: its Δ rows meet the one-hot rows in the looked-up columns.
    cross = D[:, ids]
    left = torch.cat([torch.cat([lefts[0], cross], 1), torch.cat([cross.T, lefts[1]], 1)])
    return left, Y @ Y.T


def _descending(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(min=0).flip(0)


def energy_rank(energies: torch.Tensor, fraction: float) -> int:
    """Leading components holding ``fraction`` of Σ σ_i² (0 for a zero gradient)."""
    total = float(energies.sum())
    if total <= 0:
        return 0
    cumulative = torch.cumsum(energies, 0) / total
    return int((cumulative < fraction - 1e-12).sum()) + 1


def energy_ranks(energies: torch.Tensor | None, key: str, fractions: Sequence[float] = FRACTIONS) -> dict[str, float]:
    """``rank<percent>/<key>`` for each fraction: the metrics' keys."""
    if energies is None:
        return {}
    return {f"rank{round(f * 100)}/{key}": float(energy_rank(energies, f)) for f in fractions}


def gradient_ranks(layout: Layout, sites: Sequence[Mapping[str, Factors]], max_size: int = MAX_SIZE) -> dict[str, float]:
    """Per captured layer, the energy ranks of each site's gradient Δ_sᵀA_s
    (``rank90/<module>/site<s>``) and of their sum (``…/sum``, the rows of every site
    stacked), from the sites' factors (``LocalResult.factors``)."""
    out: dict[str, float] = {}
    for layer in layout.layers:
        present = [(s, f[layer.module]) for s, f in enumerate(sites) if layer.module in f]
        size = (layer.out_per_group, layer.in_per_group)
        for s, factors in present:
            out.update(energy_ranks(factor_energies(factors, *size, max_size), f"{layer.module}/site{s}"))
        if len(present) > 1:
            out.update(energy_ranks(factor_energies(pool([f for _, f in present]), *size, max_size), f"{layer.module}/sum"))
    return out


def pool(parts: Sequence[Factors]) -> Factors:
    """The sites' factors as one set of rows: Σ_s Δ_sᵀA_s is the pooled rows' Δᵀ A."""
    def cat(values, rows):
        present = [v for v in values if v is not None]
        return None if not present else (group_rows(present) if rows else torch.cat(present))
    return Factors(cat([p.A for p in parts], True), cat([p.D for p in parts], True),
                   cat([p.ids for p in parts], False), cat([p.rows for p in parts], False))
