"""Each strategy's upload rules, the contribution measure and the influence bound, in process."""

from __future__ import annotations

import functools
import math
import random
import statistics

import pytest
import torch

from dadfl.server.quarantine import Quarantine
from dadfl.strategies import Payload, local_step, make_strategy, probe_layout
from dadfl.strategies import checks, gram
from dadfl.strategies.checks import ModelFacts, all_finite, factor_sq_norm, finite_flags, influence_outliers, low_rank_sq_norm, medians_of_the_others
from dadfl.workloads import load_workload

STRATEGIES = {  # label: (name, options)
    "dsgd": ("dsgd", {}),
    "dad": ("dad", {}),
    "auto": ("auto", {}),
    "edad": ("edad", {}),
    "rankdad": ("rankdad", {"rank": 2}),
    "rankdad-low-rank": ("rankdad", {"rank": 2, "raw_input": "low_rank", "reduce_on_server": False}),
    "rankdad-stacked": ("rankdad", {"rank": 2, "raw_input": "low_rank", "stack_groups": True}),  # digits-cnn: 2 groups
    "powersgd": ("powersgd", {"rank": 1, "start_iter": 0}),
    "rankdad-8bit": ("rankdad", {"rank": 2, "raw_input": "low_rank", "factor_bits": 8}),
    "powersgd-8bit": ("powersgd", {"rank": 1, "start_iter": 0, "factor_bits": 8}),
}
EXACT = ("dsgd", "dad", "auto", "edad")  # their contribution is the site's exact mean gradient norm
WORKLOADS = {
    "digits-mlp": {"hidden": 16},
    "digits-cnn": {"channels": 4},
    "char-gru": {"seq_len": 8, "embed": 8, "hidden": 16, "max_sequences": 100},
    "char-transformer": {"seq_len": 8, "d_model": 16, "heads": 2, "layers": 1, "max_sequences": 100},
}


@functools.cache
def workload_named(spec: str):
    return load_workload(spec, **WORKLOADS[spec])


def federation(spec: str, name: str, sizes=(16, 11, 7)):
    """The phase-0 uploads of three sites with unequal batches, and what the server knows."""
    workload = workload_named(spec)
    strategy = make_strategy(STRATEGIES[name][0], **STRATEGIES[name][1])
    model = workload.build_model()
    layout = probe_layout(model, workload.train.inputs[:2])
    facts = ModelFacts.from_model(model, layout)
    locals_, start = [], 0
    for size in sizes:
        x, y = workload.train.inputs[start : start + size], workload.train.targets[start : start + size]
        locals_.append(local_step(model, layout, workload.loss, x, y, capture=strategy.needs_factors))
        start += size
    payloads = [strategy.site(layout, model).begin(local, 0) for local in locals_]
    return strategy, layout, facts, model, payloads, locals_


def rejections(strategy, layout, facts, model, payloads, phase=0):
    return strategy.check_uploads(layout, facts, phase, 0, payloads, [], model)


@pytest.mark.parametrize("spec", list(WORKLOADS))
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_honest_uploads_pass_and_exact_contributions_equal_the_gradient_norm(spec, name):
    if name == "edad" and spec != "digits-mlp":
        pytest.skip("edad serves feed-forward chains only")
    strategy, layout, facts, model, payloads, locals_ = federation(spec, name)
    assert rejections(strategy, layout, facts, model, payloads) == []
    if name in EXACT:
        for payload, local in zip(payloads, locals_):
            expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in local.grads.values())) / local.num_samples
            assert strategy.contribution(layout, payload, [], model)["update"] == pytest.approx(expected, rel=1e-5)


def test_rows_per_sample_follow_the_layer():
    workload = workload_named("digits-cnn")
    model = workload.build_model()
    layout = probe_layout(model, workload.train.inputs[:2])
    rows = ModelFacts.from_model(model, layout).rows_per_sample
    assert max(rows.values()) > 1 and min(rows.values()) == 1  # conv positions, then the linear head


def changed(payload: Payload, **kwargs) -> Payload:
    tensors = dict(payload.tensors)
    for key, value in kwargs.get("tensors", {}).items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    return Payload(payload.step, payload.phase, kwargs.get("num_samples", payload.num_samples), tensors)


def test_rankdad_p_and_q_of_different_ranks_are_refused():
    strategy, layout, facts, model, payloads, _ = federation("digits-mlp", "rankdad")
    key = next(k for k in payloads[1].tensors if k.endswith(":Q"))
    bad = changed(payloads[1], tensors={key: payloads[1].tensors[key][..., :1]})
    [rejection] = rejections(strategy, layout, facts, model, [payloads[0], bad, payloads[2]])
    assert rejection.index == 1 and "rank 1 along dimension 2, but 2" in rejection.reason


def test_dad_deltas_without_activations_and_rows_that_do_not_match_num_samples_are_refused():
    strategy, layout, facts, model, payloads, _ = federation("digits-cnn", "dad")
    a_key = next(k for k in payloads[0].tensors if k.endswith(":A"))
    [missing] = rejections(strategy, layout, facts, model, [changed(payloads[0], tensors={a_key: None})])
    assert "expected factors" in missing.reason
    [rows] = rejections(strategy, layout, facts, model, [changed(payloads[0], num_samples=15)])
    assert "num_samples=15" in rows.reason


def test_powersgd_p_of_another_rank_and_a_phase_it_does_not_have_are_refused():
    strategy, layout, facts, model, payloads, _ = federation("digits-mlp", "powersgd")
    key = next(k for k in payloads[0].tensors if k.endswith(":P"))
    wide = torch.cat([payloads[0].tensors[key]] * 2, dim=1)
    [rejection] = rejections(strategy, layout, facts, model, [changed(payloads[0], tensors={key: wide})])
    assert "expected" in rejection.reason and key in rejection.reason
    assert rejections(strategy, layout, facts, model, payloads[:1], phase=2)[0].reason == "powersgd takes no upload in phase 2"


def test_contribution_norms_are_exact_and_do_not_overflow():
    generator = torch.Generator().manual_seed(0)
    for n, k, m in [(3, 20, 30), (40, 5, 6)]:  # the Gram route and the product route
        A, D = torch.randn(2, n, k, generator=generator), torch.randn(2, n, m, generator=generator)
        direct = float(torch.bmm(D.transpose(1, 2), A).double().pow(2).sum())
        assert factor_sq_norm(A, D) == pytest.approx(direct, rel=1e-6)
    P, Q = torch.randn(2, 7, 3, generator=generator), torch.randn(2, 5, 3, generator=generator)
    assert low_rank_sq_norm(P, Q) == pytest.approx(float(torch.bmm(P, Q.transpose(1, 2)).double().pow(2).sum()), rel=1e-6)
    huge = torch.full((1, 32, 64), 1e30)
    assert torch.bmm(huge.transpose(1, 2), huge).isinf().all()  # what float32 aggregation would make of it
    assert math.isfinite(factor_sq_norm(huge, huge)) and factor_sq_norm(huge, huge) > 1e120


def test_finite_flags_of_many_tensors_agree_with_each_tensor_alone(monkeypatch):
    monkeypatch.setattr(checks, "STACKED_ELEMENTS", 8)  # several stacks of one shape, and shapes larger than a stack
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, generator=generator) for _ in range(7)] + [
        torch.full((3,), 3e38), torch.full((2, 2), 60000.0).half(), torch.full((2, 2), 1.0).half(), torch.randn(20, generator=generator),
        torch.zeros(0, 3), torch.tensor([1, 2]), torch.tensor(2.5, dtype=torch.float64),
    ]
    for index, bad in [(1, float("nan")), (5, float("inf")), (10, float("-inf"))]:
        tensors[index] = tensors[index].clone()
        tensors[index][2] = bad
    tensors[8] = tensors[8].clone()
    tensors[8][1, 1] = float("inf")
    expected = [all_finite(t) for t in tensors]
    assert expected.count(False) == 4 and all_finite(tensors[7])  # tensor 7's sum overflows: settled element-wise
    assert finite_flags(tensors) == expected


def test_sq_norms_of_many_sites_match_each_site_measured_alone(monkeypatch):
    monkeypatch.setattr(gram, "STACKED_ELEMENTS", 16)
    generator = torch.Generator().manual_seed(0)
    sites = [
        {"w": [gram.Dense(torch.randn(2, 4, generator=generator), 1 / (i + 1))], "b": [gram.Dense(torch.randn(2, generator=generator), 0.5)]}
        for i in range(6)
    ]
    A, D = torch.randn(1, 3, 4, generator=generator), torch.randn(1, 3, 2, generator=generator)
    sites[2] = {"w": [gram.Factors(A, D, 0.25)], "b": [gram.Dense(D.sum(dim=1), 0.25), gram.Dense(torch.ones(1, 2), 1.0)]}
    sites.append({})
    for got, terms in zip(gram.sq_norms(sites), sites):
        direct = math.fsum(gram.inner(a, b) for held in terms.values() for a in held for b in held)
        assert got == pytest.approx(direct, rel=1e-12)


def test_all_finite_agrees_with_the_element_wise_test_also_where_the_sum_overflows():
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(1000, generator=generator), torch.full((4,), 3e38), torch.full((70000,), 1.0).half(),
             torch.tensor([3e38, -3e38, 3e38]), torch.zeros(0), torch.tensor([1, 2], dtype=torch.int64)]
    assert not torch.isfinite(cases[1].sum()) and not torch.isfinite(cases[2].sum())  # the sums overflow
    for tensor in cases:
        assert all_finite(tensor)
    for bad in (float("inf"), float("-inf"), float("nan")):
        for tensor in cases[:4]:
            spoiled = tensor.clone()
            spoiled[len(spoiled) // 2] = bad
            assert not all_finite(spoiled), (tensor.dtype, bad)
    spoiled = torch.randn(8, 8, generator=generator).double()
    spoiled[3, 5] = float("nan")
    assert not all_finite(spoiled) and not all_finite(spoiled.t())


def test_influence_bound_uses_the_median_of_the_others_from_three_sites():
    honest = [{"update": 1.0}, {"update": 1.3}, {"update": 0.8}]
    assert influence_outliers(honest, 10, None) == {}
    assert list(influence_outliers([*honest, {"update": 50.0}], 10, None)) == [3]
    assert list(influence_outliers([*honest, {"update": math.inf}], 10, None)) == [3]
    assert influence_outliers([{"update": 1.0}, {"update": 1e6}], 10, None) == {}  # two sites: no majority
    assert list(influence_outliers([{"update": 1.0}, {"update": 1e6}], 10, 100.0)) == [1]  # the absolute bound


def test_quarantine_file_is_the_operators_switch(tmp_path):
    quarantine = Quarantine(tmp_path, after=2)
    assert not quarantine.refuse("site-a", 3, "bad upload")
    assert quarantine.refusal("site-a") is None
    assert quarantine.refuse("site-a", 4, "bad upload")
    assert "quarantined" in quarantine.refusal("site-a") and "dadfl readmit site-a" in quarantine.refusal("site-a")
    again = Quarantine(tmp_path, after=2)  # a restarted coordinator keeps it out
    assert again.refusal("site-a") is not None
    assert again.readmit("site-a") == {"refusals": 2, "step": 4, "reason": "bad upload"}  # `dadfl readmit site-a`
    assert again.refusal("site-a") is None and quarantine.refusal("site-a") is None
    assert not quarantine.refuse("site-a", 9, "bad upload")  # counting starts over
    with pytest.raises(ValueError, match="not quarantined"):
        again.readmit("site-a")


def test_medians_of_the_others_match_the_median_taken_one_site_at_a_time():
    """The influence bound's one-sort medians equal statistics.median over the other sites,
    ties and an even or odd count included (and a NaN, which takes the direct route)."""
    rng = random.Random(0)
    for trial in range(500):
        values = [rng.choice([1.0, 2.0, 3.0, rng.random(), rng.random() * 100]) for _ in range(rng.randint(3, 12))]
        if trial % 25 == 0:
            values[rng.randrange(len(values))] = math.nan
        expected = [statistics.median(v for j, v in enumerate(values) if j != i) for i in range(len(values))]
        got = medians_of_the_others(values)
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, expected)), (values, got, expected)
