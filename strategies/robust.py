"""``dadfl.strategies.robust`` — bounded influence: from the Gram matrix of the sites' updates, a factor in [0, 1] per site.

Input: G (S × S, float64), G_ij = ⟨g_i, g_j⟩ of the sites' updates in mean units (``gram.py``
computes it from the factors). Output: s_i ∈ [0, 1]; the coordinator scales site i's upload
by s_i (``Strategy.scale``) before aggregating, so the update is Σ_i (n_i/N) s_i g_i, N the
samples of the sites of nonzero weight.

1. **Clip** to a robust reference: with ‖g_i‖ = √G_ii and m_i the median of the *other*
   sites' norms (with 2 sites: the other site's norm),

       a_i = min(1, c · m_i / ‖g_i‖)

   so no site moves the model further than c honest-sized contributions, however it
   scales its factors; an honest spike is clipped instead of refused. With 3 or more sites
   the median is a majority's: an attacker can neither raise its own bound nor shrink an
   honest site's. With 2 it can shrink the other's (by sending a tiny update), never
   enlarge its own: the price of having no majority.
2. **Agree** (3 or more sites): a site whose median cosine with the other sites,
   G_ij / √(G_ii G_jj), is ≤ 0 pushes against the majority and gets weight 0; greedily,
   the most disagreeing first, the cosines then recomputed among the sites left, while 3
   or more are left (a site pulled down by the attacker's cosine alone recovers once the
   attacker is out). This is FLTrust's trust score (Cao et al., NDSS 2021: weight ReLU(cos)
   against a reference direction) with the majority as reference (no server data) and a
   step instead of a ramp, so that a site agreeing with the majority keeps factor 1 and the
   update stays bit-identical to plain averaging. Cosines do not change under clipping.
   With 2 sites there is no majority: the rule is off. A site of weight 0 leaves the
   step's aggregate (``Screening.weigh``): the others' mean is not diluted by it.

s_i = a_i · w_i. A clean step (every site within c× the others' median, every median cosine
positive) gives every site 1: the coordinator then aggregates the uploads untouched.

Not under differential privacy: the factors depend on every site's data, so one record
could move a whole site's weight, a sensitivity the noise is not calibrated for (the
coordinator turns the rule off with ``[dp]``; per-sample clipping bounds each site there).

Tuning: ``clip_ratio`` (c) trades how much one site can move the model (c honest
contributions) against how often honest sites are clipped; ``docs/robustness.md`` has the
measurements behind the default. Non-finite entries of G are the checks' business
(``influence_outliers`` refuses non-finite norms before this runs); here they raise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from .checks import medians_of_the_others

DEFAULT_CLIP_RATIO = 2.0  # measured: docs/robustness.md


def check_clip_ratio(value: float) -> float:
    """``clip_ratio`` as the configs take it: 0 (no clipping) or at least 1 (below 1 every
    site, the median one included, would be clipped)."""
    if not (value == 0 or 1 <= value < math.inf):
        raise ValueError(f"clip_ratio={value!r} must be 0 (no clipping) or a finite number >= 1")
    return value


@dataclass(frozen=True)
class Weights:
    """Per site: the factor applied, the clip part a_i, whether agreement zeroed it."""

    factors: list[float]
    clipped: list[int]  # sites whose a_i < 1
    disagreeing: list[int]  # sites whose median cosine is ≤ 0 (weight 0)

    @property
    def untouched(self) -> bool:
        return all(f == 1.0 for f in self.factors)


def robust_weights(G: torch.Tensor, clip_ratio: float | None = DEFAULT_CLIP_RATIO, agreement: bool = True) -> Weights:
    """The rule above on the Gram matrix ``G``; ``clip_ratio`` None or 0: no clipping."""
    S = G.shape[0]
    if not bool(torch.isfinite(G).all()):
        raise ValueError("the sites' Gram matrix is not finite")
    # Python floats: the agreement loops read every entry, some many times; clipping alone reads
    # the diagonal (S² entries as floats cost a thousand sites 60 ms a step)
    inner = G.tolist() if agreement else None
    norms = [math.sqrt(max(value, 0.0)) for value in G.diagonal().tolist()]
    clip = [1.0] * S
    if clip_ratio and S >= 2:
        for i, reference in enumerate(medians_of_the_others(norms)):
            if norms[i] > clip_ratio * reference:
                clip[i] = clip_ratio * reference / norms[i]
    disagreeing: list[int] = []
    if agreement:
        remaining = [i for i in range(S) if norms[i]]  # a site that adds nothing pushes nowhere
        while len(remaining) >= 3:
            agreement_of = {
                i: statistics.median(inner[i][j] / (norms[i] * norms[j]) for j in remaining if j != i) for i in remaining
            }
            worst = min(remaining, key=lambda i: (agreement_of[i], i))
            if agreement_of[worst] > 0.0:
                break
            disagreeing.append(worst)
            remaining.remove(worst)
    factors = [0.0 if i in disagreeing else clip[i] for i in range(S)]
    return Weights(factors, [i for i in range(S) if clip[i] < 1.0], disagreeing)

