"""Bounded influence: inner products of site updates from the factors, exact scaling of an
upload, and the robust rule (clip to c × the others' median, zero a site against the majority)."""

from __future__ import annotations

import statistics

import pytest
import torch

from dadfl.strategies import make_strategy
from dadfl.strategies.base import split_key
from dadfl.strategies.gram import Dense, Factors, Lookups, LowRank, UnpairedForms, formed, gram, inner
from dadfl.strategies.quantize import unpack
from dadfl.strategies.robust import (
    CLIP_HISTORY_STEPS, DEFAULT_AGREEMENT_MARGIN, DEFAULT_CLIP_RATIO, FULL_COUNT_SHARE, MAX_UNDILUTED, MIN_CLIP_HISTORY, MIN_PULL_SHARE,
    agreement_bound, history_references, recent_quantile, Momentum, pull_count, recorded_norms, robust_weights, undiluted,
    updated_standing,
)
from tests.strategies.test_strategy_checks import WORKLOADS, federation

EXACT = {  # strategies exact at these options: their decoded update is the autograd gradient
    "dsgd": ("dsgd", {}),
    "dad": ("dad", {}),
    "auto": ("auto", {}),
    "edad": ("edad", {}),
    "rankdad": ("rankdad", {"rank": 64, "raw_input": "low_rank", "reduce_on_server": False}),
    "powersgd": ("powersgd", {"rank": 64, "start_iter": 0, "min_compression_rate": 0.0}),
}
CODED = {  # factors as 8-bit codes and a scale per column
    "rankdad-8bit": ("rankdad", {"rank": 2, "raw_input": "low_rank", "factor_bits": 8}),
    "powersgd-8bit": ("powersgd", {"rank": 1, "start_iter": 0, "factor_bits": 8}),
}


def run_step(strategy, layout, model, locals_, factors):
    """One step's messages with each site's uploads scaled by its factor in every phase."""
    sites = [strategy.site(layout, model) for _ in locals_]
    server = strategy.server(layout, model)
    payloads = [site.begin(local, 0) for site, local in zip(sites, locals_)]
    messages = []
    while True:
        message = server.aggregate([strategy.scale(layout, p, f) for p, f in zip(payloads, factors)])
        messages.append(message)
        replies = [site.receive(message) for site in sites]
        if all(r is None for r in replies):
            return strategy.decode(layout, messages, model), payloads
        payloads = replies


def flat(update: dict) -> torch.Tensor:
    return torch.cat([t.double().reshape(-1) for key, t in sorted(update.items()) if ":" not in key])


@pytest.mark.parametrize("name", list(EXACT))
def test_a_scaled_upload_adds_its_update_times_the_factor(name):
    strategy_name, options = EXACT[name]
    _, layout, _, model, _, locals_ = federation("digits-mlp", "dsgd")
    strategy = make_strategy(strategy_name, **options)
    if strategy.needs_factors:
        _, layout, _, model, _, locals_ = federation("digits-mlp", "dad")
    factors = [MAX_UNDILUTED, 0.25, 0.0]  # up (the count's factor), down, out
    scaled, _ = run_step(strategy, layout, model, locals_, factors)
    N = sum(local.num_samples for local in locals_)
    alone = [flat(run_step(strategy, layout, model, [local], [1.0])[0]) for local in locals_]
    expected = sum(f * local.num_samples / N * g for f, local, g in zip(factors, locals_, alone))
    assert torch.allclose(flat(scaled), expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))
    buffers = [k for k in scaled if split_key(k)[1] == "buffer"]
    unscaled, _ = run_step(strategy, layout, model, locals_, [1.0, 1.0, 1.0])
    assert all(torch.equal(scaled[k], unscaled[k]) for k in buffers)  # statistics, not gradients


@pytest.mark.parametrize("name", list(CODED))
def test_coded_factors_are_scaled_by_their_column_scales(name):
    _, layout, _, model, _, locals_ = federation("digits-mlp", "dad")
    strategy = make_strategy(CODED[name][0], **CODED[name][1])
    sites = [strategy.site(layout, model) for _ in locals_]
    payloads = [site.begin(local, 0) for site, local in zip(sites, locals_)]
    if name.startswith("powersgd"):  # phase 1: Q_s
        message = strategy.server(layout, model).aggregate(payloads)
        payloads = [site.receive(message) for site in sites]
    original, scaled = payloads[1], strategy.scale(layout, payloads[1], 0.5)
    for key, tensor in scaled.tensors.items():
        assert tensor.dtype == original.tensors[key].dtype  # the codes stay codes: the same bytes travel
    before, after = unpack(original), unpack(scaled)
    roles = {split_key(k)[1] for k in after.tensors}
    assert roles & {"P", "Q"}
    for key, tensor in after.tensors.items():
        factor = 0.5 if split_key(key)[1] in ("grad", "P") or (split_key(key)[1] == "Q" and name.startswith("powersgd")) else 1.0
        assert torch.equal(tensor, before.tensors[key] * factor), key


@pytest.mark.parametrize("spec", list(WORKLOADS))
@pytest.mark.parametrize("name", ["dsgd", "dad", "auto", "edad"])
def test_gram_from_factors_equals_the_autograd_inner_products(spec, name):
    if name == "edad" and spec != "digits-mlp":
        pytest.skip("edad serves feed-forward chains only")
    strategy, layout, _, model, payloads, locals_ = federation(spec, name)
    G = gram([strategy.terms(layout, p, [], model)[0] for p in payloads])
    grads = [torch.cat([g.double().reshape(-1) for _, g in sorted(l.grads.items())]) / l.num_samples for l in locals_]
    expected = torch.stack([torch.stack([gi @ gj for gj in grads]) for gi in grads])
    assert torch.allclose(G, expected, rtol=1e-5, atol=1e-9 * float(expected.abs().max()))


@pytest.mark.parametrize("name", ["rankdad", "powersgd"])
def test_low_rank_gram_equals_the_autograd_inner_products_at_full_rank(name):
    _, layout, _, model, _, locals_ = federation("digits-mlp", "dad")
    strategy = make_strategy(EXACT[name][0], **EXACT[name][1])
    sites = [strategy.site(layout, model) for _ in locals_]
    payloads = [site.begin(local, 0) for site, local in zip(sites, locals_)]
    grads = [{k: g.double() / l.num_samples for k, g in l.grads.items()} for l in locals_]
    if name == "powersgd":  # Q_s = M_sᵀ P̂ with a square orthonormal P̂: ⟨Q_i, Q_j⟩ = ⟨M_i, M_j⟩
        message = strategy.server(layout, model).aggregate(payloads)
        payloads = [site.receive(message) for site in sites]
        compressed = {split_key(k)[0] for k in payloads[0].tensors}
        grads = [{k: g for k, g in site.items() if k in compressed} for site in grads]
    else:
        compressed = set(grads[0])
    G = gram([strategy.terms(layout, p, [], model)[0] for p in payloads])
    vectors = [torch.cat([site[k].reshape(-1) for k in sorted(compressed)]) for site in grads]
    expected = torch.stack([torch.stack([gi @ gj for gj in vectors]) for gi in vectors])
    assert torch.allclose(G, expected, rtol=1e-5, atol=1e-9 * float(expected.abs().max()))


def test_norm_is_the_inner_product_with_itself_and_unpaired_forms_say_so():
    generator = torch.Generator().manual_seed(0)
    P, Q = torch.randn(1, 5, 2, generator=generator), torch.randn(1, 4, 2, generator=generator)
    dense = torch.bmm(P.double(), Q.double().transpose(1, 2))
    assert inner(LowRank(P, Q), LowRank(P, Q)) == pytest.approx(float(dense.double().pow(2).sum()), rel=1e-9)
    with pytest.raises(UnpairedForms, match="LowRank"):
        inner(Dense(dense), LowRank(P, Q))


def test_gram_in_one_product_per_parameter_equals_the_pairwise_inner_products():
    """Dense terms go through one matrix product per parameter; weights, a parameter some site
    lacks, two dense terms of one site and factors beside them give each pair's ⟨g_i, g_j⟩ as the pairwise rule does, and a pair without a rule still says so."""
    from dadfl.strategies.gram import Factors, terms_inner

    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    sites = [
        {"w": [Dense(rand(2, 4), 0.25)], "b": [Dense(rand(2)), Dense(rand(2), 0.5)],
         "f": [Factors(rand(1, 5, 3), rand(1, 5, 2), 0.5), Dense(rand(2, 3), 2.0)]}
        for i in range(5)
    ]
    del sites[1]["b"]
    G = gram(sites)
    expected = torch.tensor([[terms_inner(x, y) for y in sites] for x in sites], dtype=torch.float64)
    assert torch.allclose(G, expected, rtol=1e-12, atol=0.0) and torch.equal(G, G.T)
    with pytest.raises(UnpairedForms, match="LowRank"):
        gram([{"w": [Dense(rand(5, 4))]}, {"w": [LowRank(rand(1, 5, 2), rand(1, 4, 2))]}])


def gram_of(vectors) -> torch.Tensor:
    V = torch.tensor(vectors, dtype=torch.float64)
    return V @ V.T


def test_clean_sites_keep_factor_one():
    weights = robust_weights(gram_of([[1.0, 0.2], [0.9, 0.4], [1.2, -0.1], [0.8, 0.3]]), clip_ratio=4.0)
    assert weights.factors == [1.0] * 4 and weights.untouched


def test_a_large_site_is_clipped_to_c_times_the_median_of_the_others():
    weights = robust_weights(gram_of([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [50.0, 50.0]]), clip_ratio=4.0)
    # the others' norms 1, 1, √2: median 1; the attacker's √5000 scaled to 4
    assert weights.clipped == [3] and weights.factors[3] == pytest.approx(4.0 / 5000**0.5)
    assert weights.factors[:3] == [1.0, 1.0, 1.0]


def test_a_sign_flipped_site_gets_weight_zero_and_the_honest_keep_theirs():
    honest = [[1.0, 0.1], [0.9, 0.3], [1.1, -0.2]]
    weights = robust_weights(gram_of([*honest, [-20.0, -2.0]]), clip_ratio=4.0)
    assert weights.factors == [1.0, 1.0, 1.0, 0.0] and weights.disagreeing == [3]


def test_two_sites_bound_each_other_and_agreement_needs_a_majority():
    weights = robust_weights(gram_of([[1.0, 0.0], [-10.0, 0.0]]), clip_ratio=4.0)
    assert weights.factors == [1.0, pytest.approx(0.4)] and weights.disagreeing == []
    tiny = robust_weights(gram_of([[1.0, 0.0], [0.01, 0.0]]), clip_ratio=4.0)  # a tiny site shrinks the other
    assert tiny.factors == [pytest.approx(0.04), 1.0]


def test_an_honest_spike_within_the_others_recent_quantile_is_not_clipped_and_no_site_sets_its_own_bound():
    G = gram_of([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [5.0, 0.0]])  # site 3's norm 5, the others' median 1
    usual = [1.0] * 40 + [4.0] * 10  # mostly 1, one step in five at 4: the 0.9 quantile is 4
    c = DEFAULT_CLIP_RATIO
    assert robust_weights(G).clipped == [3]  # this step's median alone: 5 > c × 1
    assert c * 4 >= 5 and robust_weights(G, recent_norms=[usual] * 4).untouched  # 5 ≤ c × 4
    # its own history never raises its bound: the others' recent quantile is 1
    assert robust_weights(G, recent_norms=[[1.0] * 50] * 3 + [[100.0] * 50]).factors[3] == pytest.approx(c / 5.0)
    # one site's large history among the others does not move an honest site's reference (a median)
    spike0 = gram_of([[5.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    assert robust_weights(spike0, recent_norms=[[1.0] * 50, [1.0] * 50, [1.0] * 50, [1000.0] * 50]).factors[0] == pytest.approx(c / 5.0)
    # fewer than MIN_CLIP_HISTORY norms set no one's reference yet
    assert robust_weights(G, recent_norms=[[4.0] * (MIN_CLIP_HISTORY - 1)] * 4).clipped == [3]


def test_history_references_and_the_recorded_window():
    assert history_references([[1.0] * 10, [2.0] * 10, [3.0] * 10, []]) == [2.5, 2.0, 1.5, 2.0]  # the last: everyone's median
    assert history_references([[1.0] * 10, []]) == [0.0, 1.0]  # no other site has a history: 0
    assert history_references([[], []]) == [0.0, 0.0]
    assert recent_quantile([float(v) for v in range(1, 11)]) == 9.0  # nearest rank: the 9th of 10
    window = []
    for norm in range(CLIP_HISTORY_STEPS + 5):
        window = recorded_norms(window, float(norm))
    assert window == [float(v) for v in range(5, CLIP_HISTORY_STEPS + 5)]  # the last CLIP_HISTORY_STEPS, oldest first


def test_a_site_with_no_update_leaves_the_mean_where_its_peers_pull_forward_and_off_means_off():
    # a free rider pushes back by 0; its peers pull each other forward by 1 (units of m): 0 ≥ −1 + β
    assert robust_weights(gram_of([[1.0], [1.0], [0.0]])).disagreeing == [2]
    assert robust_weights(gram_of([[1.0], [1.0], [0.0]]), standing=[-1.0, -1.0, 0.0], peer_standing=[-1.0] * 3).disagreeing == [2]
    off = robust_weights(gram_of([[1.0], [1.0], [-100.0]]), clip_ratio=None, agreement=False)
    assert off.factors == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="not finite"):
        robust_weights(torch.tensor([[float("nan")]], dtype=torch.float64))


def test_factors_that_overflow_together_raise_a_clear_error_not_linalg():
    from dadfl.strategies.payload import Factors
    from dadfl.strategies.introspect import energy_rank, factor_energies
    from dadfl.strategies.power_iteration import power_iteration

    huge = torch.full((1, 8, 4), 1e30)
    energies = factor_energies(Factors(huge.transpose(1, 2), huge.transpose(1, 2)), 8, 8)  # the update's σ², in float64
    assert bool(torch.isfinite(energies).all()) and energy_rank(energies, 0.99) == 1
    with pytest.raises(ValueError, match="not finite"):
        power_iteration(huge, huge, 2)


def test_agreement_is_greedy_an_honest_site_pulled_down_by_the_attacker_alone_keeps_its_weight():
    # site 2 is off the others' mean but with it (cosine 0.29); with the attacker (3) in the
    # others' sum it pushes back past the margin, once the attacker is out it does not
    honest = [[1.0, 0.3], [1.0, -0.3], [0.3, 1.0]]
    G = gram_of([*honest, [-1.5, -2.0]])
    assert push_back(G, 2, [0, 1, 2, 3]) > DEFAULT_AGREEMENT_MARGIN and push_back(G, 2, [0, 1, 2]) < 0
    assert push_back(G, 3, [0, 1, 2, 3]) > push_back(G, 2, [0, 1, 2, 3])  # the attacker goes first
    weights = robust_weights(G, clip_ratio=None)
    assert weights.disagreeing == [3] and weights.factors == [1.0, 1.0, 1.0, 0.0]


def push_back(G: torch.Tensor, i: int, sites: list[int]) -> float:
    """−⟨g_i, u_i⟩ / m_i written out with vectors' algebra on G (the rule's definition)."""
    others = [j for j in sites if j != i]
    along = sum(float(G[i, j]) for j in others) / sum(float(G[j, k]) for j in others for k in others) ** 0.5
    norms = sorted(float(G[j, j]) ** 0.5 for j in others)
    median = norms[len(norms) // 2] if len(norms) % 2 else (norms[len(norms) // 2 - 1] + norms[len(norms) // 2]) / 2
    return -along / median


# Four noisy honest gradients around one direction: μ = e_0 plus a tetrahedron's vertices (noise
# summing to 0) of squared length 3.3, so that every pair's cosine is (1 − 1.1) / 4.3 < 0.
NOISE = 1.1**0.5
NOISY_HONEST = [[1.0, NOISE, NOISE, NOISE], [1.0, NOISE, -NOISE, -NOISE], [1.0, -NOISE, NOISE, -NOISE], [1.0, -NOISE, -NOISE, NOISE]]


def test_honest_sites_with_noisy_but_aligned_gradients_keep_factor_one():
    G = gram_of(NOISY_HONEST)
    cosines = G / torch.outer(G.diagonal().sqrt(), G.diagonal().sqrt())
    assert bool((cosines[~torch.eye(4, dtype=torch.bool)] < 0).all())  # every pair disagrees a little
    assert all(0 < push_back(G, i, [0, 1, 2, 3]) < DEFAULT_AGREEMENT_MARGIN for i in range(4))
    weights = robust_weights(G)
    assert weights.untouched and weights.disagreeing == [] and weights.clipped == []


def test_an_attacker_flipped_at_the_clip_bound_gets_weight_zero_and_the_honest_keep_one():
    honest = NOISY_HONEST[:3]
    mean = [sum(column) / 3 for column in zip(*honest)]
    weights = robust_weights(gram_of([*honest, [-50.0 * x for x in mean]]))  # ×−50: clipped to c× the median, then flipped
    assert weights.clipped == [3] and weights.disagreeing == [3]
    assert weights.factors == [1.0, 1.0, 1.0, 0.0]


def test_a_site_past_its_bound_is_zeroed_and_one_within_it_is_not():
    base = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # the others' sum along e_0, their norms 1: they push back by −1 on each other
    assert all(push_back(gram_of(base), i, [0, 1, 2]) == pytest.approx(-1.0) for i in range(3))
    bound = agreement_bound(-1.0)  # peers pulling this hard: a third of their pull
    assert bound == pytest.approx(-1 / 3) and bound == pytest.approx(MIN_PULL_SHARE * -1.0)
    for push, zeroed in ((bound - 0.02, []), (bound + 0.02, [3])):
        site = [-push, (1.0 - push**2) ** 0.5]  # unit norm, −push along the others' direction
        weights = robust_weights(gram_of([*base, site]))
        assert weights.disagreeing == zeroed and weights.clipped == []
    # peers pulling weakly: β past them decides
    orthogonal = gram_of([*base, [0.0, 1.0]])  # pushes nowhere
    assert agreement_bound(-0.1) == pytest.approx(-0.1 + DEFAULT_AGREEMENT_MARGIN)
    assert robust_weights(orthogonal, standing=[-0.3, -0.3, -0.3, 0.0], peer_standing=[-0.1] * 4).disagreeing == []
    assert robust_weights(orthogonal, standing=[-0.3, -0.3, -0.3, 0.0], peer_standing=[-0.3] * 4).disagreeing == [3]
    narrow = robust_weights(orthogonal, agreement_margin=0.05, standing=[-0.3, -0.3, -0.3, 0.0], peer_standing=[-0.1] * 4)
    assert narrow.disagreeing == [3]  # the margin is β


def test_standing_zeroes_a_site_that_pushed_back_before_and_spares_one_that_pulled_forward():
    base = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # the others' sum along e_0, their norms 1
    peers = [-0.3] * 4  # the peers pull each other forward by 0.3 m on average: the bound is −0.3 + β = −0.1
    orthogonal = gram_of([*base, [0.0, 1.0]])  # pushes nowhere this step
    assert robust_weights(orthogonal, standing=[-0.3] * 4, peer_standing=peers).disagreeing == []  # 0.9 · (−0.3) + 0.1 · 0
    # a site that pushed back by 0.1 m on average: 0.9 · 0.1 + 0.1 · 0 ≥ −0.1
    assert robust_weights(orthogonal, standing=[-0.3, -0.3, -0.3, 0.1], peer_standing=peers).disagreeing == [3]
    spike = gram_of([*base, [-0.4, (1 - 0.16) ** 0.5]])  # pushes back by 0.4 m this step: past the step's peers (−1) + β
    assert robust_weights(spike).disagreeing == [3]
    # a site that pulled forward (−0.3 m) before: 0.9 · (−0.3) + 0.1 · 0.4 < −0.1
    assert robust_weights(spike, standing=[-0.3] * 4, peer_standing=peers).disagreeing == []
    assert robust_weights(spike, standing=[-0.3] * 4, peer_standing=peers, standing_weight=0.0).disagreeing == [3]  # λ = 0: the step alone


def test_push_backs_are_measured_against_the_sites_kept_and_the_standing_follows_them():
    honest = NOISY_HONEST[:3]
    mean = [sum(column) / 3 for column in zip(*honest)]
    G = gram_of([*honest, [-50.0 * x for x in mean]])
    weights = robust_weights(G, clip_ratio=None, standing=[0.1, -0.2, 0.0, 0.3], peer_standing=[0.0] * 4)
    assert weights.disagreeing == [3]
    for i in range(3):  # the kept sites against each other
        assert weights.push_backs[i] == pytest.approx(push_back(G, i, [0, 1, 2]), rel=1e-12)
    assert weights.push_backs[3] == pytest.approx(push_back(G, 3, [0, 1, 2, 3]), rel=1e-12)  # the zeroed one against all kept
    # each site's peers: the kept sites other than it, among themselves, never with it
    for i in range(4):
        peers = [j for j in (0, 1, 2) if j != i]
        expected = statistics.median(push_back(G, j, peers) for j in peers)
        assert weights.peer_push_backs[i] == pytest.approx(expected, rel=1e-12)
    assert updated_standing(0.3, weights.push_backs[3]) == 0.9 * 0.3 + (1 - 0.9) * weights.push_backs[3]
    assert robust_weights(G, agreement=False).push_backs is None


def four_uploads(strategy):
    """A digits-mlp coordinator and four sites' uploads of step 0 on its weights (large batches:
    aligned gradients), the fourth sign-flipped at 20×, clipped to c× the others' median."""
    from dadfl.replica import OptimizerConfig, Replica
    from dadfl.workloads import load_workload, partition, site_batches

    torch.manual_seed(0)
    workload = load_workload("digits-mlp")
    train = workload.training_data()
    indices = partition(4, len(train), "iid", labels=workload.labels, seed=0)
    coordinator = Replica(workload, strategy, OptimizerConfig(name="sgd", lr=0.1), "cpu")
    payloads = [
        strategy.site(coordinator.layout, coordinator.model).begin(coordinator.work(site_batches(train, index, 128, seed=s).at, 0), 0)
        for s, index in enumerate(indices)
    ]
    return coordinator, payloads, times(strategy, payloads[3], -20)


def times(strategy, payload, factor: float):
    """The upload with its gradient-carrying tensors (the strategy's ``SCALED_ROLES``) times
    ``factor``, of any sign or size: what an attacker sends (``Strategy.scale`` takes [0, ``MAX_UNDILUTED``] only)."""
    return type(payload)(payload.step, payload.phase, payload.num_samples, {
        k: factor * t if split_key(k)[1] in strategy.SCALED_ROLES and t.is_floating_point() else t for k, t in payload.tensors.items()
    })


def powersgd_sites(memory: str):
    """PowerSGD (rank 2, compressing from step 0) on digits-mlp: the strategy, a coordinator
    replica, and four sites' halves on its weights with their IID batches."""
    from dadfl.replica import OptimizerConfig, Replica
    from dadfl.workloads import load_workload, partition, site_batches

    torch.manual_seed(0)
    workload = load_workload("digits-mlp")
    strategy = make_strategy("powersgd", rank=2, start_iter=0, memory=memory)
    train = workload.training_data()
    indices = partition(4, len(train), "iid", labels=workload.labels, seed=0)
    coordinator = Replica(workload, strategy, OptimizerConfig(name="sgd", lr=0.1), "cpu")
    sites = [strategy.site(coordinator.layout, coordinator.model) for _ in indices]
    return strategy, coordinator, sites, [site_batches(train, index, 32, seed=s) for s, index in enumerate(indices)]


def test_the_screening_commits_a_steps_standing_and_norms_once_and_a_retried_attempt_starts_from_the_committed_ones():
    """Through the coordinator's screening and a real strategy's uploads: the standings measured in
    a step take effect at ``commit``; an attempt retried before the commit reads the committed
    standings again, so they are not counted twice."""
    from dadfl.trust.screening import Screening

    strategy = make_strategy("dsgd")
    coordinator, payloads, flipped = four_uploads(strategy)
    uploads, names = [*payloads[:3], flipped], ["a", "b", "c", "d"]
    screening = Screening(coordinator, 100.0, None)
    for _attempt in range(2):
        screening.refusals(0, 0, uploads, [])
        screening.message(strategy.server(coordinator.layout, coordinator.model), uploads, [], sites=names)
        assert screening.standing == screening.peer_standing == screening.recent_norms == {}  # not before the commit
    record = screening.commit(0, names)
    assert set(screening.standing) == set(screening.peer_standing) == set(names)
    assert screening.standing["d"] > max(0.0, *(screening.standing[n] for n in "abc"))  # the flipped site pushed back most
    # d's peers (the honest sites) pulled each other forward; the others' peers include d, which
    # raises their bounds, never its own
    assert screening.peer_standing["d"] < 0.0 < min(screening.peer_standing[n] for n in "abc")
    assert record["robust_standing"] == {n: round(screening.standing[n], 4) for n in names}
    assert record["robust_peer_standing"] == {n: round(screening.peer_standing[n], 4) for n in names}
    norms = [strategy.contribution(coordinator.layout, p, [], coordinator.model)["update"] for p in uploads]
    assert {n: screening.recent_norms[n][0] for n in names} == {n: [pytest.approx(v, rel=1e-12)] for n, v in zip(names, norms)}
    once, peers, recent = dict(screening.standing), dict(screening.peer_standing), dict(screening.recent_norms)
    screening.commit(0, names)  # committing again changes nothing
    assert screening.standing == once and screening.peer_standing == peers and screening.recent_norms == recent


def test_formed_terms_are_the_update_in_parameter_space_and_a_wrong_size_says_so():
    """``gram.formed``: each term form turned into its parameter's flat update (weights applied,
    terms of one parameter summed), so inner products of formed updates are the terms' own."""
    generator = torch.Generator().manual_seed(3)
    A, D = torch.randn(2, 5, 4, generator=generator), torch.randn(2, 5, 3, generator=generator)
    P, Q = torch.randn(2, 3, 2, generator=generator), torch.randn(2, 4, 2, generator=generator)
    x = {"w": [Factors(A, D, 0.5), LowRank(P, Q)], "b": [Dense(torch.randn(3, generator=generator), 2.0)],
         "emb": [Lookups.of(torch.tensor([4, 1, 4]), torch.randn(3, 2, generator=generator))]}
    y = {"w": [Dense(torch.randn(2, 3, 4, generator=generator))], "emb": [Dense(torch.randn(6, 2, generator=generator))]}
    numels = {"w": 24, "b": 3, "emb": 12}
    fx, fy = formed(x, numels), formed(y, numels)
    expected_w = 0.5 * torch.einsum("gnm,gnk->gmk", D.double(), A.double()) + P.double() @ Q.double().transpose(1, 2)
    assert torch.allclose(fx["w"], expected_w.reshape(-1), rtol=1e-12)
    assert torch.equal(fx["b"], 2.0 * x["b"][0].tensor.double())
    assert float(fx["emb"] @ fy["emb"]) == pytest.approx(inner(x["emb"][0], y["emb"][0]), rel=1e-12)  # the rows of id 4 summed
    assert float(fx["w"] @ fy["w"]) == pytest.approx(inner(x["w"][0], y["w"][0]) + float(fy["w"] @ (P.double() @ Q.double().transpose(1, 2)).reshape(-1)), rel=1e-12)
    with pytest.raises(UnpairedForms, match="terms of 24 and 5 elements"):
        formed({"w": [*y["w"], Dense(torch.randn(5))]}, numels)


def test_momentum_gram_is_that_of_the_clipped_momenta_and_zeroes_a_site_whose_steps_alone_look_honest():
    """``Momentum.gram`` is ⟨μ m_i + a_i g_i, μ m_j + a_j g_j⟩. A site whose step pulls forward a
    little but whose past steps pushed the model back is kept by the step alone and zeroed on its
    momentum; the honest sites keep weight 1 either way."""
    generator = torch.Generator().manual_seed(0)
    forward = torch.zeros(50, dtype=torch.float64)
    forward[0] = 1.0
    noise = lambda: 0.3 * torch.randn(50, generator=generator, dtype=torch.float64)  # noqa: E731
    steps = [forward + noise() for _ in range(4)]  # every step alone honest-looking
    momenta = [4 * forward + noise() for _ in range(3)] + [-4 * forward + noise()]
    M, C, G = (torch.stack(x) @ torch.stack(y).T for x, y in ((momenta, momenta), (momenta, steps), (steps, steps)))
    momentum = Momentum(0.9, M.tolist(), C.tolist())
    clip = [1.0, 0.5, 1.0, 0.25]
    after = torch.stack([0.9 * m + a * g for m, g, a in zip(momenta, steps, clip)])
    assert torch.allclose(torch.tensor(momentum.gram(clip, G.tolist()), dtype=torch.float64), after @ after.T, rtol=1e-12)
    alone = robust_weights(G, None, True)  # the step alone decides: its peers as they are this step
    assert alone.factors == [1.0] * 4
    with_momentum = robust_weights(G, None, True, momentum=momentum)
    assert with_momentum.disagreeing == [3] and with_momentum.factors[:3] == [1.0] * 3
    assert with_momentum.clip == [1.0] * 4


def test_the_screening_keeps_each_sites_momentum_of_its_clipped_updates_from_commit_to_commit():
    """Through the coordinator's screening and real dSGD uploads: a site's momentum after each
    committed step is μ m + a g (its update as sent, clipped, in parameter space, float32), kept
    also for the site agreement zeroed once its momentum pushes back; an attempt not committed
    leaves it as it was."""
    from dadfl.trust.screening import Screening

    strategy = make_strategy("dsgd")
    coordinator, payloads, flipped = four_uploads(strategy)
    uploads, names = [*payloads[:3], flipped], ["a", "b", "c", "d"]
    screening = Screening(coordinator, 100.0, None, momentum=0.5)
    layout, model = coordinator.layout, coordinator.model
    expected: list[dict] = [{} for _ in names]
    for step in range(3):  # the same uploads, each round committed (as step 0: the uploads' own)
        screening.refusals(0, 0, uploads, [])
        weights = screening.weights(uploads, [], names)
        screening.message(strategy.server(layout, model), uploads, [], sites=names)
        if step == 0:
            assert screening.momenta == {}  # not before the commit
        screening.commit(0, names)
        for i, payload in enumerate(uploads):
            update = formed(strategy.terms(layout, payload, [], model)[0], screening.numels)
            expected[i] = {
                k: (weights.clip[i] * g + (0.5 * expected[i][k].double() if k in expected[i] else 0)).float() for k, g in update.items()
            }
    assert weights.disagreeing == [3] and weights.clip[3] < 1.0  # the flipped site: clipped, zeroed, its momentum kept
    for i, name in enumerate(names):
        kept = screening.momenta[name][0]
        assert set(kept) == set(screening.numels)  # dSGD: every parameter by its name
        assert all(value.dtype == torch.float32 and torch.equal(value, expected[i][k]) for k, value in kept.items())


def test_a_federation_above_the_momentum_budget_is_weighed_on_each_step_alone_and_told_once(monkeypatch, caplog):
    """Above ``MAX_MOMENTUM_ELEMENTS`` (sites × parameters) no momentum is kept: the weights are
    those of the rule with μ = 0, and the operator is told once."""
    from dadfl.trust import screening as screening_module

    strategy = make_strategy("dsgd")
    coordinator, payloads, flipped = four_uploads(strategy)
    uploads, names = [*payloads[:3], flipped], ["a", "b", "c", "d"]
    monkeypatch.setattr(screening_module, "MAX_MOMENTUM_ELEMENTS", 10)
    over = screening_module.Screening(coordinator, 100.0, None, momentum=0.9)
    alone = screening_module.Screening(coordinator, 100.0, None, momentum=0.0)
    with caplog.at_level("WARNING", logger=screening_module.__name__):
        for _ in range(2):
            assert over.weights(uploads, [], names) == alone.weights(uploads, [], names)
            for screening in (over, alone):
                screening.message(strategy.server(coordinator.layout, coordinator.model), uploads, [], sites=names)
                screening.commit(0, names)
    assert over.momenta == {} and sum("momenta the coordinator keeps" in r.getMessage() for r in caplog.records) == 1


def test_untouched_weights_aggregate_the_uploads_bit_identically_and_a_zeroed_site_leaves_the_mean():
    """Through the coordinator's screening, a real strategy's uploads: all factors 1 gives the
    message plain aggregation gives, to the bit; a fourth site sign-flipped at the clip bound gets
    weight 0, and the message is the three honest sites', to the bit."""
    from dadfl.trust.screening import Screening

    strategy = make_strategy("dad")
    coordinator, payloads, flipped = four_uploads(strategy)
    screening = Screening(coordinator, 100.0, None)

    def message(uploads):
        return screening.message(strategy.server(coordinator.layout, coordinator.model), uploads, [])[0]

    def plain(uploads):
        return strategy.server(coordinator.layout, coordinator.model).aggregate(uploads)

    def same(a, b):
        return a.num_samples == b.num_samples and a.tensors.keys() == b.tensors.keys() and all(
            torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
        )

    assert same(message(payloads), plain(payloads)) and screening.weighed["factors"] == [1.0] * 4
    assert same(message([*payloads[:3], flipped]), plain(payloads[:3])) and screening.weighed["disagreeing"] == [3]


def test_a_site_counts_by_the_share_of_its_peers_pull_it_keeps():
    r = -0.3
    assert pull_count(FULL_COUNT_SHARE * r, r) == 1.0 and pull_count(r, r) == 1.0  # at k of the pull or more: a whole site
    assert pull_count(FULL_COUNT_SHARE * r / 2, r) == pytest.approx(0.5)  # in proportion below
    assert pull_count(0.0, r) == 0.0 and pull_count(0.1, r) == 0.0  # pulls nothing, or pushes back
    assert pull_count(0.3, 0.0) == 1.0 and pull_count(0.3, 0.1) == 1.0  # peers that do not pull each other: no measure


def test_the_mean_is_over_the_samples_that_count_and_never_lengthened_past_its_bound():
    assert undiluted([1.0, 1.0, 1.0], [32, 32, 32]) == 1.0
    assert undiluted([0.5, 1.0, 1.0], [10, 10, 20]) == pytest.approx(40 / 35)
    assert undiluted([0.0, 0.0, 1.0], [1, 1, 1]) == MAX_UNDILUTED  # 3 would be the samples' ratio
    assert undiluted([0.0, 0.0, 0.0], [1, 1, 1]) == MAX_UNDILUTED


def test_a_site_that_keeps_little_of_its_peers_pull_is_kept_and_counts_less_in_the_mean():
    honest = [[1.0, 0.1], [1.0, -0.1], [0.9, 0.0]]
    G = gram_of([*honest, [0.2, 0.0]])
    weights = robust_weights(G, standing=[-0.3, -0.3, -0.3, -0.15], peer_standing=[-0.3] * 4)
    assert weights.disagreeing == [] and weights.factors == [1.0] * 4  # within its bound: kept, not scaled apart
    assert weights.counts[:3] == [1.0] * 3 and 0.0 < weights.counts[3] < 1.0
    assert weights.undiluted == pytest.approx(4 / sum(weights.counts)) and not weights.untouched
    alike = robust_weights(gram_of([*honest, [1.0, 0.0]]), standing=[-0.3] * 4, peer_standing=[-0.3] * 4)
    assert alike.counts == [1.0] * 4 and alike.untouched
    alone = robust_weights(G)  # without site ids the step alone decides, and nothing is counted
    assert alone.counts is None and alone.undiluted == 1.0


def test_the_screening_scales_every_kept_upload_by_the_counts_factor_and_records_it():
    """Real dAD uploads through the coordinator's screening, with site ids: a fourth site that
    sends a fifth of its gradient, within its bound, is kept; every upload is scaled by Σ n / Σ c n
    and the message is, to the bit, plain aggregation of the uploads so scaled."""
    from dadfl.trust.screening import Screening

    strategy = make_strategy("dad")
    coordinator, payloads, _ = four_uploads(strategy)
    uploads = [*payloads[:3], times(strategy, payloads[3], 0.2)]
    names = ["a", "b", "c", "d"]
    screening = Screening(coordinator, 100.0, None)
    screening.standing = {"a": -0.3, "b": -0.3, "c": -0.3, "d": -0.15}
    screening.peer_standing = dict.fromkeys(names, -0.3)
    weights = screening.weights(uploads, [], names)
    assert weights.disagreeing == [] and weights.undiluted > 1.0
    sent = screening.message(strategy.server(coordinator.layout, coordinator.model), uploads, [], sites=names)[0]
    plain = strategy.server(coordinator.layout, coordinator.model).aggregate(
        [strategy.scale(coordinator.layout, p, weights.undiluted) for p in uploads]
    )
    assert sent.tensors.keys() == plain.tensors.keys() and all(torch.equal(sent.tensors[k], plain.tensors[k]) for k in sent.tensors)
    assert screening.commit(0, names)["robust_undiluted"] == round(weights.undiluted, 4)


@pytest.mark.parametrize("memory", ["site", "global"])
def test_powersgd_a_site_flipped_at_the_clip_bound_gets_weight_zero_on_q_and_its_p_only_a_median_share(memory):
    """PowerSGD with error feedback through the coordinator's screening, after a few steps of
    memories: a fourth site sending −20× its genuine P_s and Q_s. With each site's own memory:
    phase 0 (P_s only chooses the basis) clips every site to the others' median norm, weighs no
    agreement and carries no factor on; in phase 1 the flipped site gets weight 0 and the
    message is the three honest sites' to the bit. With the hook's memory both phases are
    clipped only (its honest sites' uploads carry the random walk of their memories:
    docs/robustness.md)."""
    from dadfl.trust.screening import Screening

    strategy, coordinator, sites, batches = powersgd_sites(memory)
    layout, model = coordinator.layout, coordinator.model
    screening = Screening(coordinator, 100.0, None)

    def flip(payload):
        return times(strategy, payload, -20)

    for step in range(4):
        payloads = [site.begin(coordinator.work(batch.at, step), step) for site, batch in zip(sites, batches)]
        attacked = step == 3
        server = strategy.server(layout, model)
        for phase in range(2):
            uploads = [*payloads[:3], flip(payloads[3])] if attacked else payloads
            message, sent, _ = screening.message(server, uploads, [] if phase == 0 else [first])
            if phase == 0:
                first = sent
                assert screening.weighed["disagreeing"] == []
                if memory == "site":  # no factor carried on; some site is above the others' median
                    assert screening.weighed["factors"] == [1.0] * 4 and screening.weighed["basis_clipped"]
                else:
                    assert screening.weighed["basis_clipped"] == []
            payloads = [site.receive(sent) for site in sites]
        if not attacked:
            continue
        factors = screening.weighed["factors"]
        if memory == "site":
            assert factors == [1.0, 1.0, 1.0, 0.0] and screening.weighed["disagreeing"] == [3]
            honest = strategy.server(layout, model).aggregate(uploads[:3])
            assert message.tensors.keys() == honest.tensors.keys()
            assert all(torch.equal(message.tensors[k], honest.tensors[k]) for k in honest.tensors)
        else:
            assert factors[:3] == [1.0, 1.0, 1.0] and 0.0 < factors[3] < 1.0 and screening.weighed["disagreeing"] == []


@pytest.mark.parametrize("memory", ["site", "global"])
def test_a_site_refused_between_phases_leaves_and_the_others_keep_their_earlier_bound_by_site(memory):
    """PowerSGD's two phases through the screening, the runtime naming the sites: site ``a`` is
    refused after phase 0, so phase 1 has three uploads. What phase 0 decided follows each site
    by its id, not by its position: ``d``, sent at 20×, stays bound by its phase-0 clip (hook's
    memory: the factor carries over) or recorded as basis-clipped (site memory), and the step's
    record names only the sites of the step's last phase."""
    from dadfl.trust.screening import Screening

    strategy, coordinator, sites, batches = powersgd_sites(memory)
    layout, model = coordinator.layout, coordinator.model
    screening = Screening(coordinator, 100.0, None, agreement=False)

    def scaled(payload):
        return times(strategy, payload, 20)

    payloads = [site.begin(coordinator.work(batch.at, 0), 0) for site, batch in zip(sites, batches)]
    server = strategy.server(layout, model)
    _, first, _ = screening.message(server, [*payloads[:3], scaled(payloads[3])], [], sites=["a", "b", "c", "d"])
    bound = screening.weighed["factors"][3]
    replies = [site.receive(first) for site in sites[1:]]  # a is refused: b, c, d go on
    screening.message(server, [*replies[:2], scaled(replies[2])], [first], sites=["b", "c", "d"])
    record = screening.commit(0, ["b", "c", "d"])
    if memory == "global":
        assert bound < 1.0 and screening.weighed["factors"][2] <= bound and record["robust_clipped"] == ["d"]
    else:
        assert bound == 1.0 and "d" in record["robust_basis_clipped"] and set(record["robust_basis_clipped"]) <= {"b", "c", "d"}


def test_the_operator_is_told_of_a_site_zeroed_in_many_of_the_last_steps_once_per_window(caplog):
    """A site that agreement zeroes in 30% or more of the last 50 committed steps is named in one
    warning (an attacker, or a site whose data differ), again only after another 50 steps."""
    from dadfl.trust.screening import ZEROED_WINDOW, Screening

    strategy = make_strategy("dsgd")
    coordinator, payloads, flipped = four_uploads(strategy)
    screening, names = Screening(coordinator, 100.0, None), ["a", "b", "c", "eve"]
    zeroed = []  # per step, whether eve was zeroed
    with caplog.at_level("WARNING", logger="dadfl.trust.screening"):
        for step in range(2 * ZEROED_WINDOW):  # eve flips every other step, from step 1
            uploads = [type(p)(step, 0, p.num_samples, p.tensors) for p in [*payloads[:3], flipped if step % 2 else payloads[3]]]
            screening.refusals(step, 0, uploads, [])
            screening.message(strategy.server(coordinator.layout, coordinator.model), uploads, [], sites=names)
            record = screening.commit(step, names)
            assert set(record.get("robust_disagreeing", [])) <= {"eve"}
            zeroed.append("eve" in record.get("robust_disagreeing", []))
    assert not zeroed[0] and all(zeroed[ZEROED_WINDOW // 2:])  # its standing keeps it out once it has flipped a few times
    warnings = [r.getMessage() for r in caplog.records if "weight 0" in r.getMessage()]
    counts = [sum(zeroed[:ZEROED_WINDOW]), sum(zeroed[ZEROED_WINDOW:])]
    assert [w.split(" of the last")[0] for w in warnings] == [f"agreement gave 'eve' weight 0 in {n}" for n in counts]
