"""``dadfl.strategies.gram`` — inner products of the updates sites' uploads add, from the factors, never forming ΔᵀA.

A site's upload adds to the update, per parameter, a sum of **terms** (mean units: a term
carries the weight 1/n_s that turns its sum-unit tensors into the site's mean gradient):

- ``Dense(t)``: a gradient as it is (dense parameters, biases read off Δ, PowerSGD's P_s
  and Q_s, which project on a shared orthonormal basis so ⟨P_i Qᵀ, P_j Qᵀ⟩ = ⟨P_i, P_j⟩);
- ``Factors(A, D)``: Σ_rows Dᵀ A per group, A (G, n, k), D (G, n, m);
- ``LowRank(P, Q)``: P Qᵀ per group, P (G, m, r), Q (G, k, r);
- ``Lookups(ids, rows)``: an embedding's onehot(ids)ᵀ rows, kept as the rows summed per
  distinct id (memory follows the lookups, not the table).

Between two sites' terms of the same parameter, in float64 (finite values near the float32
limit cannot overflow):

    ⟨D_iᵀA_i, D_jᵀA_j⟩   = Σ (A_i A_jᵀ) ⊙ (D_i D_jᵀ)        n_i × n_j Grams, when smaller than forming
    ⟨P_iQ_iᵀ, P_jQ_jᵀ⟩   = Σ (P_iᵀ P_j) ⊙ (Q_iᵀ Q_j)         r × r
    ⟨lookups_i, lookups_j⟩ = Σ over the ids both looked up of S_i[u]·S_j[u]
    ⟨lookups_i, D_jᵀA_j⟩  = Σ_u S_i[u] · (D_jᵀA_j)[u]          only the rows i looked up
    ⟨dense, D_jᵀA_j⟩      = ⟨dense, D_jᵀA_j formed⟩            as large as the dense term already is

:func:`formed` turns a site's terms into its update in parameter space, one flat float64
vector per parameter (or factored matrix): what the robust rule's momentum adds up across
steps (inner products within one step need no forming; across steps they do, since the
factors change every step).

A norm is the inner product of a site's terms with themselves (``sq_norm``): the
contribution bound and the robust rule (``robust.py``) read the same numbers. A pair of
forms with no rule here (a low-rank term against a dense one: a layer one site's batch
did not reach) raises :class:`UnpairedForms`; the caller decides what to do without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import torch

Terms = dict[str, list["Term"]]  # by parameter (or factored matrix) name


class UnpairedForms(ValueError):
    """Two sites sent one parameter in forms whose inner product has no rule here."""


@dataclass(frozen=True)
class Dense:
    tensor: torch.Tensor
    weight: float = 1.0


@dataclass(frozen=True)
class Factors:
    A: torch.Tensor  # (G, n, k)
    D: torch.Tensor  # (G, n, m)
    weight: float = 1.0

    def formed(self) -> torch.Tensor:
        return torch.bmm(self.D.double().transpose(1, 2), self.A.double())


@dataclass(frozen=True)
class LowRank:
    P: torch.Tensor  # (G, m, r)
    Q: torch.Tensor  # (G, k, r)
    weight: float = 1.0


@dataclass(frozen=True)
class Lookups:
    ids: torch.Tensor  # distinct ids, sorted
    sums: torch.Tensor  # (len(ids), d) float64: the rows summed per id
    weight: float = 1.0

    @classmethod
    def of(cls, ids: torch.Tensor, rows: torch.Tensor, weight: float = 1.0) -> "Lookups":
        unique, inverse = ids.long().unique(return_inverse=True)
        rows = rows.double().reshape(-1, rows.shape[-1])
        return cls(unique, rows.new_zeros(len(unique), rows.shape[-1]).index_add_(0, inverse, rows), weight)


Term = Union[Dense, Factors, LowRank, Lookups]


def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double().reshape(-1) * y.double().reshape(-1)).sum())


def _factors(a: Factors, b: Factors) -> float:
    n, m, k = a.A.shape[1], a.D.shape[2], a.A.shape[2]
    nb = b.A.shape[1]
    if n * nb * (k + m) < k * m * (n + nb + 1):
        A_a, A_b, D_a, D_b = a.A.double(), b.A.double(), a.D.double(), b.D.double()
        return float((torch.bmm(A_a, A_b.transpose(1, 2)) * torch.bmm(D_a, D_b.transpose(1, 2))).sum())
    return _dot(a.formed(), b.formed())


def _low_rank(a: LowRank, b: LowRank) -> float:
    P_a, P_b, Q_a, Q_b = a.P.double(), b.P.double(), a.Q.double(), b.Q.double()
    return float((P_a.transpose(-2, -1) @ P_b * (Q_a.transpose(-2, -1) @ Q_b)).sum())


def _lookups(a: Lookups, b: Lookups) -> float:
    if not len(a.ids) or not len(b.ids):
        return 0.0
    at = torch.searchsorted(b.ids, a.ids).clamp_(max=len(b.ids) - 1)
    common = b.ids[at] == a.ids
    return float((a.sums[common] * b.sums[at[common]]).sum())


def _lookups_factors(a: Lookups, b: Factors) -> float:
    """The looked-up rows of DᵀA (a head tied to the table), groups summed."""
    rows = torch.bmm(b.D.double()[:, :, a.ids].transpose(1, 2), b.A.double()).sum(dim=0)
    return float((rows.reshape(a.sums.shape) * a.sums).sum())


def _lookups_dense(a: Lookups, b: Dense) -> float:
    return float((b.tensor.double().reshape(-1, a.sums.shape[-1])[a.ids] * a.sums).sum())


def _dense_factors(a: Dense, b: Factors) -> float:
    formed = b.formed()
    return _dot(a.tensor.reshape(formed.shape), formed)


def inner(a: Term, b: Term) -> float:
    """⟨a, b⟩ in mean units (both weights applied), float64."""
    if isinstance(b, Dense) and not isinstance(a, Dense) or isinstance(a, Factors) and isinstance(b, Lookups):
        a, b = b, a  # each mixed rule is written once, in one order
    if isinstance(a, Dense) and isinstance(b, Dense):
        raw = _dot(a.tensor, b.tensor)
    elif isinstance(a, Factors) and isinstance(b, Factors):
        raw = _factors(a, b)
    elif isinstance(a, LowRank) and isinstance(b, LowRank):
        raw = _low_rank(a, b)
    elif isinstance(a, Lookups) and isinstance(b, Lookups):
        raw = _lookups(a, b)
    elif isinstance(a, Lookups) and isinstance(b, Factors):
        raw = _lookups_factors(a, b)
    elif isinstance(a, Dense) and isinstance(b, Factors):
        raw = _dense_factors(a, b)
    elif isinstance(a, Dense) and isinstance(b, Lookups):
        raw = _lookups_dense(b, a)
    else:
        raise UnpairedForms(f"no inner product between a {type(a).__name__} and a {type(b).__name__} term")
    return raw * a.weight * b.weight


def terms_inner(x: Terms, y: Terms) -> float:
    """⟨x, y⟩ over every parameter both hold (a parameter one of them lacks adds nothing)."""
    return math.fsum(inner(a, b) for name in x.keys() & y.keys() for a in x[name] for b in y[name])


def formed(x: Terms, numels: dict[str, int]) -> dict[str, torch.Tensor]:
    """Each parameter's (factored matrix's) update as one flat float64 vector (mean units, weights
    applied), its terms summed: Dᵀ A and P Qᵀ of every group in order, lookups scattered into the
    table's rows (``numels``: a table's number of elements, by name). Terms of one name whose
    sizes differ raise ``UnpairedForms``."""
    out = {}
    for name, held in x.items():
        total = None
        for term in held:
            if isinstance(term, Dense):
                vector = term.tensor.double().reshape(-1)
            elif isinstance(term, Factors):
                vector = term.formed().reshape(-1)
            elif isinstance(term, LowRank):
                vector = (term.P.double() @ term.Q.double().transpose(-2, -1)).reshape(-1)
            else:
                width, numel = term.sums.shape[-1], numels.get(name, 0)
                rows = numel // width if width else 0
                if len(term.ids) and int(term.ids[-1]) >= rows:
                    raise UnpairedForms(f"{name!r}: a lookup past the table's {rows} rows")
                vector = torch.zeros(rows, width, dtype=torch.float64).index_copy_(0, term.ids, term.sums).reshape(-1)
            if total is not None and vector.numel() != total.numel():
                raise UnpairedForms(f"{name!r}: terms of {total.numel()} and {vector.numel()} elements")
            total = vector * term.weight if total is None else total + vector * term.weight
        if total is not None:
            out[name] = total
    return out


STACKED_ELEMENTS = 1 << 20  # the most elements sq_norms squares as one stack (8 MiB in float64)


def sq_norm(x: Terms) -> float:
    """‖x‖² = ⟨x, x⟩: the same rules as between sites (:func:`sq_norms` of one site)."""
    return sq_norms([x])[0]


def sq_norms(sites: Sequence[Terms]) -> list[float]:
    """‖g_i‖² of every site: the diagonal of :func:`gram`, without the pairs between sites.

    A parameter that a site holds as one dense term (dSGD's gradients, biases) is squared
    together with the same parameter's term at the other sites, as one stack of rows (at
    most ``STACKED_ELEMENTS`` at a time): a few tensor calls per parameter instead of five
    per site and term, which at a thousand sites cost more than the arithmetic. Every other
    pair of a site's own terms goes through :func:`inner`; a site's parts are added with
    ``math.fsum``."""
    parts: list[list[float]] = [[] for _ in sites]
    stacks: dict[tuple, list[tuple[int, Dense]]] = {}
    for i, terms in enumerate(sites):
        for held in terms.values():
            if len(held) == 1 and isinstance(held[0], Dense):
                stacks.setdefault((held[0].tensor.shape, held[0].tensor.dtype), []).append((i, held[0]))
            else:
                parts[i].extend(inner(a, b) for a in held for b in held)
    for (shape, _), members in stacks.items():
        size = math.prod(shape)
        per_stack = max(1, STACKED_ELEMENTS // max(size, 1))
        for start in range(0, len(members), per_stack):
            part = members[start : start + per_stack]
            tensors = [t.tensor for _, t in part]
            rows = (torch.stack(tensors) if len(tensors) > 1 else tensors[0]).reshape(len(part), size).double()
            for (i, t), raw in zip(part, (rows * rows).sum(dim=1).tolist()):
                parts[i].append(raw * t.weight * t.weight)
    return [math.fsum(values) for values in parts]


def gram(sites: Sequence[Terms]) -> torch.Tensor:
    """The S × S float64 matrix of ⟨g_i, g_j⟩, each pair computed once.

    Per parameter, the dense terms of every site (when they have one size) are summed per site
    and multiplied as one matrix, Y Yᵀ with Y (S × size): one product instead of a Python call
    per pair (with 32 sites, 528 pairs per parameter); ⟨Σa, Σb⟩ = Σ⟨a, b⟩, in float64 in
    another summation order. Every other pair of terms goes through :func:`inner`."""
    S = len(sites)
    G = torch.zeros(S, S, dtype=torch.float64)
    for name in sorted(set().union(*(terms.keys() for terms in sites))):
        held = [(i, sites[i][name]) for i in range(S) if name in sites[i]]
        dense = [(i, t) for i, terms in held for t in terms if isinstance(t, Dense)]
        if len({t.tensor.numel() for _, t in dense}) == 1:
            rows = torch.stack([t.tensor.double().reshape(-1) * t.weight for _, t in dense])
            index = torch.tensor([i for i, _ in dense])
            per_site = rows.new_zeros(S, rows.shape[1]).index_add_(0, index, rows)
            product = per_site @ per_site.T
            G += product.triu() + product.triu(1).T  # each pair once, as the pairwise rule: symmetric to the bit
            stacked = {id(t) for _, t in dense}
        else:
            stacked = set()
        if len(stacked) == sum(len(terms) for _, terms in held):
            continue  # every term of it was in the product
        for a_at, (i, x) in enumerate(held):
            for j, y in held[a_at:]:
                value = math.fsum(inner(a, b) for a in x for b in y if not (id(a) in stacked and id(b) in stacked))
                G[i, j] += value
                if i != j:
                    G[j, i] += value
    return G
