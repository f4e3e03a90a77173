"""rank-dAD: exact at full rank, converging as r grows, exact bias, exact byte counts, privacy."""

import pytest
import torch

from dadfl.strategies import apply_update, local_step, make_strategy, probe_layout, reference_update, step_update
from dadfl.strategies.introspect import energy_rank
from dadfl.strategies.rankdad import RankDAD
from dadfl.strategies.step import exchange

from tests.helpers.model_zoo import build, exchange_step, per_sample_cross_entropy, site_batches

FLOAT = 4
SIZES = (5, 1, 3)  # unequal, with a single-sample site


def relative_errors(update, reference):
    floor = 1e-3 * torch.sqrt(sum(ref.norm() ** 2 for ref in reference.values()))
    return {name: float((update[name] - ref).norm() / torch.maximum(ref.norm(), floor)) for name, ref in reference.items()}


def weights_error(update, reference):
    """‖u − r‖/‖r‖ over every weight at once."""
    keys = [k for k in reference if k.endswith("weight")]
    diff = sum(float((update[k] - reference[k]).norm() ** 2) for k in keys)
    return (diff / sum(float(reference[k].norm() ** 2) for k in keys)) ** 0.5


def run_exchange(strategy, kind="mlp", sizes=SIZES):
    layout, _, _, _, messages, traffic = exchange_step(strategy, kind, sizes)
    return layout, messages, traffic


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize(
    "options", [{}, {"raw_input": "low_rank"}, {"raw_input": "low_rank", "reduce_on_server": True},
                {"raw_input": "low_rank", "stack_groups": True}]
)
def test_full_rank_matches_reference(kind, options):
    model = build(kind)
    batches = site_batches(kind, sizes=SIZES)
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = step_update(make_strategy("rankdad", rank=64, **options), model, per_sample_cross_entropy, batches)
    assert set(reference) <= set(update)
    errors = relative_errors(update, reference)
    assert max(errors.values()) <= 1e-4, errors


@pytest.mark.parametrize("kind,sizes", [("mlp", (20, 1, 12)), ("cnn", SIZES)])
@pytest.mark.parametrize("reduce_on_server", [False, True])
def test_error_falls_as_rank_grows(kind, sizes, reduce_on_server):
    model = build(kind)
    batches = site_batches(kind, sizes=sizes)
    reference = reference_update(model, per_sample_cross_entropy, batches)
    errors = []
    for rank in (1, 2, 4, 8, 16):
        strategy = make_strategy("rankdad", rank=rank, raw_input="low_rank", reduce_on_server=reduce_on_server)
        errors.append(weights_error(step_update(strategy, model, per_sample_cross_entropy, batches), reference))
    # Strictly smaller at each step until exact (fp32 rounding), then it stays exact.
    assert all(a > b or a <= 1e-5 >= b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.3 and errors[2] > 1e-2, "ranks 1 to 4 must not be exact on these layers"
    assert errors[-1] <= 1e-5, errors


@pytest.mark.parametrize("rank", [1, 3])
def test_bias_apart_is_exact_at_any_rank_and_folded_travels_in_the_factors(rank):
    model = build("cnn")
    batches = site_batches("cnn", sizes=SIZES)
    reference = reference_update(model, per_sample_cross_entropy, batches)
    for reduce_on_server in (False, True):
        for folded in (False, True):
            strategy = make_strategy("rankdad", rank=rank, raw_input="low_rank", reduce_on_server=reduce_on_server,
                                     bias_in_factors=folded)
            update = step_update(strategy, model, per_sample_cross_entropy, batches)
            assert weights_error(update, reference) > 1e-2, "the weights are approximated at this rank"
            _, messages, _ = run_exchange(strategy, kind="cnn")
            layout = probe_layout(model, batches[0][0])
            layers = [layer for layer in layout.layers if layer.bias]
            assert len(layers) == 3
            for layer in layers:
                error = float((update[layer.bias] - reference[layer.bias]).norm() / reference[layer.bias].norm())
                apart = f"{layer.bias}:grad" in messages[0].tensors
                full_rank = rank >= min(layer.out_per_group, layer.in_per_group + 1)  # conv2: 2 outputs per group
                if folded:  # approximated with its weight, as one more input column, unless r is full rank
                    assert not apart and (error <= 1e-5 if full_rank else error > 1e-3 or rank > 1), (layer.bias, error)
                else:  # exact, travelling apart
                    assert error <= 1e-5 and apart, (layer.bias, error)


def low_rank_floats(layer, rank, folded=True, stacked=False):
    """Per group: G·r'·(k' + m), r' = min(r, m, k'), k' counting the bias's column when
    ``folded``, else the bias dense (G·m more). ``stacked``: one matrix of the groups' rows,
    r'·(k' + G·m), r' = min(r, G·m, k')."""
    k = layer.in_per_group + bool(folded and layer.bias)
    groups, m = (1, layer.groups * layer.out_per_group) if stacked else (layer.groups, layer.out_per_group)
    bias = 0 if folded or not layer.bias else layer.groups * layer.out_per_group
    return groups * min(rank, m, k) * (k + m) + bias


def test_bytes_match_formula_mlp_by_hand():
    """MLP 12-16-16-5, r = 4, first layer dense (raw input, ``raw_input="dense"``), three sites; each bias folded
    into its layer's factors (Q one row longer) or, without error feedback, dense."""
    layout, messages, traffic = run_exchange(make_strategy("rankdad", rank=4, raw_input="dense", reduce_on_server=False))
    per_site = (16 * 12 + 16) + 4 * (16 + 1 + 16) + 4 * (16 + 1 + 5)
    assert traffic.up == [[FLOAT * per_site] * 3]
    down = (16 * 12 + 16) + 3 * 4 * (16 + 1 + 16) + 3 * 4 * (16 + 1 + 5)
    assert traffic.down == [FLOAT * down]
    _, _, reduced = run_exchange(make_strategy("rankdad", rank=4, raw_input="dense", reduce_on_server=True))
    assert reduced.down == [FLOAT * per_site]
    for options in ({"error_feedback": False}, {"bias_in_factors": False}):
        _, _, apart = run_exchange(make_strategy("rankdad", rank=4, raw_input="dense", reduce_on_server=True, **options))
        assert apart.down == [FLOAT * ((16 * 12 + 16) + (4 * (16 + 16) + 16) + (4 * (16 + 5) + 5))]


@pytest.mark.parametrize("reduce_on_server", [False, True])
@pytest.mark.parametrize("rank", [1, 2, 5])
@pytest.mark.parametrize("error_feedback,stack_groups", [(True, False), (True, True), (False, False)])
def test_bytes_match_formula_cnn(rank, reduce_on_server, error_feedback, stack_groups):
    """conv2 has 4 groups. With error feedback the biases are folded in and, with
    ``stack_groups``, conv2 is one matrix of its groups' rows; without error feedback each
    group is factored from its own A and Δ and the biases travel dense."""
    sites = len(SIZES)
    strategy = make_strategy("rankdad", rank=rank, raw_input="low_rank", reduce_on_server=reduce_on_server,
                             error_feedback=error_feedback, stack_groups=stack_groups)
    layout, messages, traffic = run_exchange(strategy, kind="cnn")
    assert {l.module: l.groups for l in layout.layers}["conv2"] == 4
    dense = sum(int(torch.tensor(layout.shape(n)).prod()) for n in layout.uncovered)
    up = dense + sum(low_rank_floats(l, rank, error_feedback, stack_groups) for l in layout.layers)
    assert traffic.up == [[FLOAT * up] * sites]
    down_factor = 1 if reduce_on_server else sites
    biases = {l.module: 0 if error_feedback or not l.bias else l.groups * l.out_per_group for l in layout.layers}
    factors = sum(low_rank_floats(l, rank, error_feedback, stack_groups) - biases[l.module] for l in layout.layers)
    assert traffic.down == [FLOAT * (dense + down_factor * factors + sum(biases.values()))]
    for layer in layout.layers:
        P = messages[0].tensors[f"{layer.module}:P"]
        groups, m = (1, layer.groups * layer.out_per_group) if stack_groups else (layer.groups, layer.out_per_group)
        k = layer.in_per_group + bool(error_feedback and layer.bias)
        assert P.shape == (groups, m, down_factor * min(rank, m, k))


def test_tol_sends_only_the_components_a_site_has():
    """With tol, each site sends as many components as its gradient has (rank(Δ_sᵀA_s) ≤ n_s:
    one for the 1-sample site), fewer bytes, and the update stays exact."""
    strategy = make_strategy("rankdad", rank=8, raw_input="low_rank", tol=1e-4, reduce_on_server=False)
    model = build("mlp")
    batches = site_batches("mlp", sizes=SIZES)
    layout = probe_layout(model, batches[0][0])
    for n, (x, y) in zip(SIZES, batches):
        local = local_step(model, layout, per_sample_cross_entropy, x, y)
        payload = strategy.site(layout, model).begin(local, 0)
        full = make_strategy("rankdad", rank=8, raw_input="low_rank").site(layout, model).begin(local, 0)
        saved = 0
        for layer in layout.layers:
            grad = local.grads[layer.weight].reshape(layer.out_per_group, -1)
            grad = torch.cat((grad, local.grads[layer.bias].reshape(-1, 1)), dim=1)  # the folded bias: rank(Δᵀ[A 1]) ≤ n
            sv = torch.linalg.svdvals(grad)
            true_rank = int((sv > 1e-4 * sv[0]).sum())
            assert true_rank <= n
            sent = payload.tensors[f"{layer.module}:P"].shape[-1]
            assert sent == payload.tensors[f"{layer.module}:Q"].shape[-1] == true_rank, (n, layer.module)
            saved += (min(8, *grad.shape) - sent) * sum(grad.shape)
        assert full.nbytes() - payload.nbytes() == FLOAT * saved > 0
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = step_update(strategy, model, per_sample_cross_entropy, batches)
    assert max(relative_errors(update, reference).values()) <= 1e-4


def test_reduce_on_server_sends_rank_r_down():
    rank = 3
    layout, messages, _ = run_exchange(make_strategy("rankdad", rank=rank, reduce_on_server=True), sizes=(6, 4, 5))
    _, concatenated, _ = run_exchange(make_strategy("rankdad", rank=rank, reduce_on_server=False), sizes=(6, 4, 5))
    for layer in layout.layers[1:]:
        assert messages[0].tensors[f"{layer.module}:P"].shape[-1] == rank
        assert messages[0].tensors[f"{layer.module}:Q"].shape[-1] == rank
        assert concatenated[0].tensors[f"{layer.module}:P"].shape[-1] == 3 * rank


def train(strategy, kind="mlp", steps=4, sizes=SIZES):
    """Persistent halves over several steps with SGD; yields (reference, update, sites)."""
    model = build(kind)
    batches = site_batches(kind, sizes=sizes)
    layout = probe_layout(model, batches[0][0])
    sites = [strategy.site(layout, model) for _ in sizes]
    server = strategy.server(layout, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        batches = site_batches(kind, sizes=sizes, seed=step)
        reference = reference_update(model, per_sample_cross_entropy, batches)
        locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches]
        messages, _ = exchange(sites, server, locals_, step)
        update = strategy.decode(layout, messages, model)
        yield reference, update, sites, server
        apply_update(model, optimizer, update)


@pytest.mark.parametrize("reduce_on_server", [False, True])
def test_warm_start_stays_exact_at_full_rank(reduce_on_server):
    strategy = RankDAD(rank=16, raw_input="low_rank", reduce_on_server=reduce_on_server, warm_start=True)
    for step, (reference, update, sites, server) in enumerate(train(strategy, kind="cnn")):
        errors = relative_errors(update, reference)
        assert max(errors.values()) <= 1e-4, (step, errors)
    assert all(site.state.warm for site in sites), "warm start keeps each layer's Q"


def test_warm_start_is_used_at_low_rank():
    def errors(warm):
        strategy = RankDAD(rank=2, raw_input="low_rank", warm_start=warm)
        return [weights_error(u, r) for r, u, _, _ in train(strategy, sizes=(20, 1, 12), steps=3)]

    warm, cold = errors(True), errors(False)
    assert warm[0] == cold[0], "the first step has nothing to start from"
    assert warm[1:] != cold[1:]


def test_describe_reports_the_energy_ranks_of_the_update():
    model = build("mlp")
    batches = site_batches("mlp", sizes=(2, 1, 1))
    layout = probe_layout(model, batches[0][0])
    reference = reference_update(model, per_sample_cross_entropy, batches)
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches]
    strategy = make_strategy("rankdad", rank=8, raw_input="low_rank")
    messages, _ = exchange([strategy.site(layout, model) for _ in batches], strategy.server(layout, model), locals_, 0)
    ranks = strategy.describe(layout, messages)
    assert set(ranks) == {f"rank{p}/{layer.module}/update" for layer in layout.layers for p in (90, 99)}
    for layer in layout.layers:
        # Rank 8 ≥ the 4 samples' rank: the update is the gradient, its bias the folded column.
        matrix = torch.cat([reference[layer.weight], reference[layer.bias][:, None]], 1).double()
        assert [ranks[f"rank{p}/{layer.module}/update"] for p in (90, 99)] == [
            energy_rank(torch.linalg.svdvals(matrix) ** 2, p / 100) for p in (90, 99)]
    low = make_strategy("rankdad", rank=1, raw_input="low_rank", reduce_on_server=True)
    messages, _ = exchange([low.site(layout, model) for _ in batches], low.server(layout, model), locals_, 0)
    assert set(low.describe(layout, messages).values()) == {1.0}


def test_options_are_checked():
    with pytest.raises(ValueError, match="rank"):
        make_strategy("rankdad", rank=0)
    with pytest.raises(ValueError, match="raw_input"):
        make_strategy("rankdad", raw_input="everything")
    with pytest.raises(ValueError, match="stack_groups needs error_feedback"):
        make_strategy("rankdad", stack_groups=True, error_feedback=False)


def test_uncovered_matrix_a_batch_did_not_reach_is_left_out():
    """A compressed parameter with no gradient (and no memory) at a site is not sent: the
    server counts it as zero there, and the upload passes the server's checks."""
    from dataclasses import replace

    from dadfl.strategies.checks import ModelFacts, check_payload

    strategy = make_strategy("rankdad", rank=1, raw_input="low_rank")
    layout, batches, _, locals_, _, _ = exchange_step(strategy, "transformer", (3, 2))
    local = replace(locals_[0], grads={k: v for k, v in locals_[0].grads.items() if k != "position"})
    payload = strategy.site(layout, build("transformer")).begin(local, 0)
    assert not any(key.startswith("position:") for key in payload.tensors)
    facts = ModelFacts.from_model(build("transformer"), layout)
    assert check_payload(strategy.upload_units(layout, facts, 0, 0), payload) is None
