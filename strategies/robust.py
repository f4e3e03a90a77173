"""``dadfl.strategies.robust`` — bounded influence: from the Gram matrix of the sites' updates, a factor in [0, 1] per site.

Input: G (S × S, float64), G_ij = ⟨g_i, g_j⟩ of the sites' updates in mean units (``gram.py``
computes it from the factors). Output: s_i ∈ [0, 1] and a factor b ∈ [1, ``MAX_UNDILUTED``]
common to the kept sites; the coordinator scales site i's upload by b · s_i
(``Strategy.scale``) before aggregating, so the update is b Σ_i (n_i/N) s_i g_i, N the samples
of the sites of nonzero weight.

1. **Clip** to a robust reference: with ‖g_i‖ = √G_ii, m_i the median of the *other*
   sites' norms this step (with 2 sites: the other site's norm) and H_i the median, over
   the other sites j, of Q_j, the ``CLIP_QUANTILE`` (0.9) of site j's norms in its last
   ``CLIP_HISTORY_STEPS`` (50) committed steps (sites with ``MIN_CLIP_HISTORY`` or more;
   0 when no other site has them yet, and without the runtime's site ids),

       a_i = min(1, c · max(m_i, H_i) / ‖g_i‖)

   so no site moves the model further than c honest-sized contributions, however it
   scales its factors; an honest spike is clipped instead of refused. H_i is there because
   honest norms become heavy-tailed once most samples are fitted: a site's batch that holds
   one of the few misclassified samples has many times the gradient of one that does not,
   and this step's median alone then clipped some honest site in most late steps. A site's
   own history never sets its own bound, and a median over the others' quantiles is a
   majority's: with 3 or more sites an attacker can neither raise its own bound nor shrink
   an honest site's, only raise an honest site's H_i within the honest sites' range. What
   the history costs: an attacker may send c times the honest sites' recent 0.9 quantile
   instead of c times this step's median (``docs/robustness.md``). With 2 sites it can
   shrink the other's (by sending a tiny update), never enlarge its own: the price of
   having no majority.
2. **Agree** (3 or more sites): with u_i the direction of the sum of the *other* sites'
   clipped updates, site i's push-back this step is

       p_i = −⟨a_i g_i, u_i⟩ / m_i      (units of m_i; honest sites pull forward: p_i < 0 on average).

   It keeps a **standing** h_i, the exponential average of its push-back, and the **peers'
   standing** r_i, the same average of the median push-back of the *other* sites among
   themselves, measured without site i (the median over j ≠ i of p_j against the sum of the
   sites kept other than i and j); both 0 for a site not seen before. A site whose score
   reaches its bound,

       λ · h_i + (1 − λ) · p_i ≥ max(r_i + β, r_i / 3),      λ = ``standing_weight``,  β = ``agreement_margin``,

   that is, pushes back β more than its peers do among themselves or, where they pull each
   other forward by more than 1.5 β, keeps less than a third of their pull (``MIN_PULL_SHARE``),
   gets weight 0 (:func:`agreement_bound`); greedily, the furthest over its bound first, the directions then
   recomputed among the sites left, while 3 or more are left (a site pulled past its bound
   by the attacker's share of u_i alone recovers once the attacker is out). Once the step is
   committed, h_i ← λ · h_i + (1 − λ) · p_i against the sites kept, and r_i likewise with
   this step's median among the kept sites other than i (:func:`updated_standing`).

   Why relative to the peers: a site kept may push back by up to its bound on average, in
   the steps where its own batch hides it best (an attacker that knows every upload does).
   A fixed bound above 0 lets it push the model back every step; a fixed bound below 0
   zeroes honest hospitals whose data differ, which push back on each other honestly (under
   label skew every site's average push-back is above 0, on IID data near −0.3). A site is
   held to what the other sites do among themselves: on IID data it must pull forward
   nearly as they do, and one that adds nothing (an update of 0, a free rider that would
   dilute the mean) pushes back by 0, past r_i + β, and leaves the mean. r_i never includes
   site i, so no site can raise its own bound; a site can raise the others' bounds only.
   The share is there for peers that pull each other forward strongly (PowerSGD's Q_s, about
   −0.7): a fixed β is then a small share of their pull, and an honest site whose memory
   carries less of the common direction fell past it.
   λ is long (about ten steps) because the bound sits close to the honest sites' average:
   a short average would zero honest sites for one step's noise. Karimireddy, He and Jaggi
   (ICML 2021, "Learning from history for Byzantine robust optimization") show that a rule
   looking at one step at a time cannot tell an attacker from gradient noise.

   This is FLTrust's trust score (Cao et al., NDSS 2021: weight ReLU(cos) against a reference
   direction) with the other sites' sum as reference (no server data), measured as a length
   rather than a cosine, averaged over steps and relative to the peers. A site within its
   bound keeps factor 1, so the update stays bit-identical to plain averaging. A site of
   weight 0 leaves the step's aggregate (``Screening.weigh``): the others' mean is not diluted
   by it. With 2 sites there is no majority: the rule is off. Without site ids (no standing)
   the step alone decides: λ = 0, r_i this step's median among all sites other than i.
   The standings are the coordinator's state (its checkpoint keeps them: a resumed run is
   bit-identical); a site keeps them across disconnects, so leaving and rejoining resets nothing.

   **Momentum** (μ = ``momentum``, with site ids, where the strategy says honest momenta agree:
   ``Strategy.momenta_agree``): the push-backs above are measured on
   the sites' momenta instead of this step's updates,

       m_i' = μ m_i + a_i g_i,      ⟨m_i', m_j'⟩ = μ² ⟨m_i, m_j⟩ + μ (a_j ⟨m_i, g_j⟩ + a_i ⟨m_j, g_i⟩) + a_i a_j G_ij

   (:class:`Momentum`: the coordinator forms each site's update in parameter space,
   ``gram.formed``, and keeps m_i); m_i records what site i sent, clipped, zeroed or not,
   so an honest site zeroed once recovers and a zeroed attacker's past stays on its record.
   On momenta, p_i is in units of m_i / (1 − μ), m_i of this step's clipped norms (what a site
   sending one direction every step reaches), not of the momenta's own norms: once the
   model fits, the common direction is gone and each momentum holds its site's own optimum,
   which against the momenta's norms pushes back by O(1) and zeroed honest sites in a
   large share of late steps (``docs/robustness.md``).
   Why: agreement on one step measures a site only along that step's others' sum, and an
   honest gradient is mostly noise across it (cosine about 0.3), so an attacker that
   undoes its own gradient's part *across* the others' sum looks honest in every step.
   Over steps the honest noise cancels and the common direction adds up: the momenta of
   honest sites pull each other forward steadily, and an attacker's past undoing shows
   against the others' later progress. The bound is
   then r_i + β alone (``MOMENTUM_PULL_SHARE`` 1: the share below is for one step's noisy
   pull). Without momentum (μ = 0, no site ids, PowerSGD, FedAvg, DiLoCo, a federation
   above ``MAX_MOMENTUM_ELEMENTS`` in ``screening.py``) the rule reads each step's updates.

   What it does not bound: a site kept pulls forward along the others' momenta as they do;
   what it sends across them is bounded by the clip alone (``docs/robustness.md``, "The
   attacker across the others' sum").

3. **Count** (with site ids, on each step's updates, 3 or more sites kept): a kept site counts
   in the mean by the share of its peers' pull forward it keeps,

       c_i = min(1, max(0, score_i / (k · r_i)))  where r_i < 0, else 1,      k = ``FULL_COUNT_SHARE`` (2/3),

   score_i its score of step 2 (:func:`pull_count`), and every kept upload is multiplied by
   Σ n_i / Σ c_i n_i over the kept sites, at most ``MAX_UNDILUTED`` (:func:`undiluted`): the
   mean is over the samples that count. The update's direction is plain averaging's; only its
   length changes, and only upwards.
   Why: a site within its bound may keep as little as a third of its peers' pull, every step,
   and stay in the mean with all its samples: the honest sites' step then shrinks by about two
   thirds of its share of the samples. No rule can zero it without zeroing an honest hospital
   whose samples the model already fits (a small gradient pointing the same way); counting it
   less gives back the step length it withholds, whoever it is. At k of its peers' pull or more
   a site counts 1, so alike honest sites count less only by their standing's noise (a few
   percent of the step's length); where the peers push back on each other every site counts 1.
   A hospital whose data differ from alike peers' (label skew) keeps little of their pull and
   counts less: its step and theirs are lengthened, up to ``MAX_UNDILUTED``.

s_i = a_i · w_i (times the count's factor where step 3 applies). A clean step (every site
within c× the others' median and its agreement bound, none counting less) gives every site 1:
the coordinator then aggregates the uploads untouched.

Not under differential privacy: the factors depend on every site's data, so one record
could move a whole site's weight, a sensitivity the noise is not calibrated for (the
coordinator turns the rule off with ``[dp]``; per-sample clipping bounds each site there).

Tuning: ``CLIP_HISTORY_STEPS`` and ``CLIP_QUANTILE`` say what an honest spike is: a site
may send c times what the others' recent norms reached one step in ten. ``standing_weight``
(λ) is how long a site's past counts (about 1 / (1 − λ) steps); 0 is the per-step rule.
``momentum`` (μ, ``federation.agreement_momentum``) how many steps of a site's updates add up
before they are weighed (about 1 / (1 − μ)); 0 (the default) weighs each step's updates. Momenta
also add up what makes honest sites' data differ (label skew), so 0.9 where the sites' data are
alike: it holds against an attacker that sees every upload, and zeroes skewed hospitals more.
``clip_ratio`` (c) trades how much one site can move the model (c honest contributions)
against how often honest sites are clipped; ``agreement_margin`` (β,
``federation.agreement_margin``) how much more a site may push back on average than its peers
do among themselves, against how often an honest site is zeroed: a hospital whose data differ
from all the others' (label skew) pushes back more than they do on each other, so raise it
there, or turn agreement off. ``FULL_COUNT_SHARE`` (k) trades how much step length a site that
withholds can take from the others (its share of the samples times 1 − k, at most) against how
often alike honest sites' steps are lengthened for their standing's noise; ``MAX_UNDILUTED`` bounds
that lengthening. ``docs/robustness.md`` has the measurements behind the defaults.
Non-finite entries of G are the checks' business (``influence_outliers`` refuses non-finite
norms before this runs); here they raise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from .checks import medians_of_the_others

DEFAULT_CLIP_RATIO = 1.5  # measured: docs/robustness.md
DEFAULT_AGREEMENT_MARGIN = 0.2  # β, measured: docs/robustness.md
# c in a phase that only chooses a basis (``Strategy.chooses_basis``): no site outweighs a median
# one in the directions; the step's size does not depend on it. Measured: docs/robustness.md
BASIS_CLIP_RATIO = 1.0
DEFAULT_STANDING_WEIGHT = 0.9  # the weight of a site's past steps in its score, measured: docs/robustness.md
# The least share of its peers' pull forward a site keeps within its bound (module text, step 2),
# measured: docs/robustness.md
MIN_PULL_SHARE = 1 / 3
# The share of its peers' pull at or above which a kept site counts as a whole site in the mean
# (module text, step 3), measured: docs/robustness.md
FULL_COUNT_SHARE = 2 / 3
# The most a step's mean is scaled by for the sites that count less (1.5: one of 3 alike sites
# counting 0); what ``Strategy.scale`` accepts
MAX_UNDILUTED = 1.5
MOMENTUM_PULL_SHARE = 1.0  # the same on momenta, whose pull is steadier: r_i + β alone, measured: docs/robustness.md
# μ: 0, agreement on each step's updates; 0.9 where sites' data are alike (IID), measured: docs/robustness.md
DEFAULT_MOMENTUM = 0.0
# The clip's reference from history (module text, step 1), measured: docs/robustness.md
CLIP_HISTORY_STEPS = 50  # a site's norms kept, its last committed steps
CLIP_QUANTILE = 0.9
MIN_CLIP_HISTORY = 10  # a site with fewer recorded norms sets no one's reference yet


def check_clip_ratio(value: float) -> float:
    """``clip_ratio`` as the configs take it: 0 (no clipping) or at least 1 (below 1 every
    site, the median one included, would be clipped)."""
    if not (value == 0 or 1 <= value < math.inf):
        raise ValueError(f"clip_ratio={value!r} must be 0 (no clipping) or a finite number >= 1")
    return value


@dataclass(frozen=True)
class Momentum:
    """The sites' momenta before this step, as the agreement rule reads them (module text, step 2):
    ``before[i][j]`` = ⟨m_i, m_j⟩ and ``with_update[i][j]`` = ⟨m_i, g_j⟩, g_j this step's update
    (G's), μ = ``weight``. A site with no momentum yet has a row and column of zeros."""

    weight: float
    before: list[list[float]]
    with_update: list[list[float]]

    def gram(self, clip: Sequence[float], G: list[list[float]]) -> list[list[float]]:
        """⟨m_i', m_j'⟩ with m_i' = μ m_i + a_i g_i: the momenta after this step, each site's
        update clipped by ``clip``."""
        mu, M, C, S = self.weight, self.before, self.with_update, len(clip)
        return [
            [mu * mu * M[i][j] + mu * (clip[j] * C[i][j] + clip[i] * C[j][i]) + clip[i] * clip[j] * G[i][j] for j in range(S)]
            for i in range(S)
        ]


@dataclass(frozen=True)
class Weights:
    """Per site: the factor applied, the clip part a_i, whether agreement zeroed it."""

    factors: list[float]
    clip: list[float]  # each site's a_i (1: not clipped), zeroed or not: what its momentum records
    disagreeing: list[int]  # sites pushing back past their bound (weight 0)
    # each site's push-back against the sites kept (units of m_i), None where agreement was not weighed
    push_backs: list[float] | None = None
    norms: list[float] | None = None  # each site's ‖g_i‖, what its clip history records
    # per site, the median push-back of the kept sites other than it among themselves (None where
    # fewer than 2 of them are kept): what its peers' standing follows
    peer_push_backs: list[float | None] | None = None
    # each site's count in the mean (step 3; 0 for a site zeroed), None where the rule did not count
    counts: list[float] | None = None
    undiluted: float = 1.0  # what every kept site's factor is multiplied by for the counts (step 3)

    @property
    def clipped(self) -> list[int]:
        """The sites whose a_i < 1."""
        return [i for i, a in enumerate(self.clip) if a < 1.0]

    @property
    def untouched(self) -> bool:
        return self.undiluted == 1.0 and all(f == 1.0 for f in self.factors)


def robust_weights(
    G: torch.Tensor,
    clip_ratio: float | None = DEFAULT_CLIP_RATIO,
    agreement: bool = True,
    agreement_margin: float = DEFAULT_AGREEMENT_MARGIN,
    standing: Sequence[float] | None = None,
    standing_weight: float = DEFAULT_STANDING_WEIGHT,
    recent_norms: Sequence[Sequence[float]] | None = None,
    peer_standing: Sequence[float] | None = None,
    momentum: Momentum | None = None,
    samples: Sequence[float] | None = None,
    full_count_share: float = FULL_COUNT_SHARE,
) -> Weights:
    """The rule above on the Gram matrix ``G``; ``clip_ratio`` None or 0: no clipping.
    ``standing`` and ``peer_standing``: each site's standing and its peers' before this step
    (0 for a site not seen before; ``peer_standing`` None: all 0); ``standing`` None: the step
    alone decides (λ = 0, the peers as they are this step). ``recent_norms``: each site's norms
    in its last committed steps, oldest first (H_i); None: this step's median alone.
    ``momentum``: the sites' momenta before this step; agreement then reads them (module text).
    ``samples``: each site's sample count, what the mean weighs it by (None: all alike);
    ``full_count_share``: k of step 3; 0: every kept site counts whole."""
    S = G.shape[0]
    if not bool(torch.isfinite(G).all()):
        raise ValueError("the sites' Gram matrix is not finite")
    # Python floats: the agreement loops read every entry, some many times; clipping alone reads
    # the diagonal (S² entries as floats cost a thousand sites 60 ms a step)
    inner = G.tolist() if agreement else None
    norms = [math.sqrt(max(value, 0.0)) for value in G.diagonal().tolist()]
    clip = [1.0] * S
    if clip_ratio and S >= 2:
        references = medians_of_the_others(norms)
        if recent_norms is not None:
            references = [max(now, past) for now, past in zip(references, history_references(recent_norms))]
        for i, reference in enumerate(references):
            if norms[i] > clip_ratio * reference:
                clip[i] = clip_ratio * reference / norms[i]
    disagreeing: list[int] = []
    push_backs: list[float] | None = None
    peer_push_backs: list[float | None] | None = None
    if agreement:
        if momentum is not None:
            clipped = momentum.gram(clip, inner)
            # push-back on momenta in units of this step's clipped norms over 1 − μ (what a site
            # sending one direction every step reaches), not of the momenta's own norms: once the
            # model fits, the common direction is gone and the momenta are what is left, each
            # site's own optimum, which against their own norms pushed back by O(1)
            lengths = [clip[i] * norms[i] / (1 - momentum.weight) for i in range(S)]
        else:
            clipped = [[clip[i] * clip[j] * inner[i][j] for j in range(S)] for i in range(S)]
            lengths = [math.sqrt(max(clipped[i][i], 0.0)) for i in range(S)]
        remaining = list(range(S))  # a site that adds nothing is judged too: it pushes back by 0
        share = MIN_PULL_SHARE if momentum is None else MOMENTUM_PULL_SHARE
        if standing is None:  # the step alone decides: the peers as they are this step, among all sites
            past, weight, peers = [0.0] * S, 0.0, [value or 0.0 for value in _peer_push_backs(clipped, remaining, lengths)]
        else:
            past, weight = list(standing), standing_weight
            peers = list(peer_standing) if peer_standing is not None else [0.0] * S
        while len(remaining) >= 3:
            push = _push_backs(clipped, remaining, lengths)
            over = {i: updated_standing(past[i], push[i], weight) - agreement_bound(peers[i], agreement_margin, share) for i in remaining}
            worst = max(remaining, key=lambda i: (over[i], -i))
            if over[worst] < 0:
                break
            disagreeing.append(worst)
            remaining.remove(worst)
        if len(remaining) >= 2:  # every site measured against the sites kept
            kept = _push_backs(clipped, remaining, lengths)
            left_out = {i: _push_backs(clipped, sorted([*remaining, i]), lengths)[i] for i in disagreeing}
            push_backs = [kept.get(i, left_out.get(i, 0.0)) for i in range(S)]
            peer_push_backs = _peer_push_backs(clipped, remaining, lengths)
    factors = [0.0 if i in disagreeing else clip[i] for i in range(S)]
    counts, mean = None, 1.0
    if full_count_share and push_backs is not None and standing is not None and momentum is None and len(remaining) >= 3:
        counts = [
            pull_count(updated_standing(past[i], push_backs[i], weight), peers[i], full_count_share) if i in remaining else 0.0
            for i in range(S)
        ]
        weighed = samples if samples is not None else [1.0] * S
        mean = undiluted([counts[i] for i in remaining], [weighed[i] for i in remaining])
    return Weights(factors, clip, disagreeing, push_backs, norms, peer_push_backs, counts, mean)


def history_references(recent_norms: Sequence[Sequence[float]]) -> list[float]:
    """H_i for each site (module text, step 1): the median over the other sites j of Q_j, the
    ``CLIP_QUANTILE`` of j's recent norms, among sites with ``MIN_CLIP_HISTORY`` or more of
    them; 0 where no other site has that many."""
    quantiles = [recent_quantile(norms) if len(norms) >= MIN_CLIP_HISTORY else None for norms in recent_norms]
    known = [q for q in quantiles if q is not None]
    if not known:
        return [0.0] * len(quantiles)
    without_each = iter(medians_of_the_others(known) if len(known) >= 2 else [0.0])
    everyone = statistics.median(known)  # for a site whose own history is too short: all the others'
    return [everyone if q is None else next(without_each) for q in quantiles]


def recent_quantile(norms: Sequence[float]) -> float:
    """The ``CLIP_QUANTILE`` of ``norms`` (nearest rank)."""
    ordered = sorted(norms)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(CLIP_QUANTILE * len(ordered)) - 1))]


def recorded_norms(before: Sequence[float], norm: float) -> list[float]:
    """A site's recent norms after a committed step with ``norm``: the last ``CLIP_HISTORY_STEPS``."""
    return [*before, norm][-CLIP_HISTORY_STEPS:]


def agreement_bound(peer_standing: float, agreement_margin: float = DEFAULT_AGREEMENT_MARGIN, pull_share: float = MIN_PULL_SHARE) -> float:
    """The score at which a site whose peers' standing is ``peer_standing`` gets weight 0: past
    its peers by β, or, where they pull each other forward strongly, keeping less than
    ``MIN_PULL_SHARE`` of their pull (module text, step 2)."""
    return max(peer_standing + agreement_margin, pull_share * peer_standing)


def pull_count(score: float, peer_standing: float, full_share: float = FULL_COUNT_SHARE) -> float:
    """What a kept site counts for in the mean (module text, step 3): 1 where it keeps
    ``full_share`` or more of its peers' pull forward, or where they do not pull each other
    forward; less in proportion below that, 0 for a site that pulls nothing."""
    if peer_standing >= 0:
        return 1.0
    return min(1.0, max(0.0, score / (full_share * peer_standing)))


def undiluted(counts: Sequence[float], samples: Sequence[float]) -> float:
    """The factor every kept site's upload is multiplied by so that the mean is over the samples
    that count (module text, step 3): Σ n_i / Σ c_i n_i over the kept sites, at most
    ``MAX_UNDILUTED``."""
    total, counted = math.fsum(samples), math.fsum(c * n for c, n in zip(counts, samples))
    if not total or counted >= total:
        return 1.0
    return min(MAX_UNDILUTED, total / counted) if counted > 0 else MAX_UNDILUTED


def updated_standing(before: float, push_back: float, standing_weight: float = DEFAULT_STANDING_WEIGHT) -> float:
    """A standing after a step where the site (its peers) pushed back by ``push_back`` (units of m_i)."""
    return standing_weight * before + (1 - standing_weight) * push_back


def _peer_push_backs(G: list[list[float]], sites: list[int], lengths: list[float]) -> list[float | None]:
    """For each site i of ``G``: the median push-back of the sites of ``sites`` other than i,
    each against the others of them but i (None where fewer than 2 are left)."""
    peers: list[float | None] = []
    for i in range(len(G)):
        others = [j for j in sites if j != i]
        peers.append(statistics.median(_push_backs(G, others, lengths).values()) if len(others) >= 2 else None)
    return peers


def _push_backs(G: list[list[float]], sites: list[int], lengths: list[float]) -> dict[int, float]:
    """Per site i of ``sites``: −⟨g_i, u_i⟩ / m_i, u_i the unit direction of the other sites' sum,
    m_i the median of their norms (0 where the others sum to nothing). From G alone: with
    R_i = Σ_j G_ij and T = Σ_jk G_jk over ``sites``, ⟨g_i, Σ_{j≠i} g_j⟩ = R_i − G_ii and
    ‖Σ_{j≠i} g_j‖² = T − 2R_i + G_ii."""
    rows = {i: math.fsum(G[i][j] for j in sites) for i in sites}
    total = math.fsum(rows.values())
    medians = medians_of_the_others([lengths[i] for i in sites])
    push = {}
    for i, median in zip(sites, medians):
        others = math.sqrt(max(total - 2 * rows[i] + G[i][i], 0.0))
        push[i] = -(rows[i] - G[i][i]) / (others * median) if others and median else 0.0
    return push
