"""rank-dAD's error feedback: what the memories keep, exactness at full rank, state round
trip, uncovered matrices compressed with the byte counts of the formula."""

import pytest
import torch

from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.strategies import apply_update, local_step, make_strategy, probe_layout, reference_update
from dadfl.strategies.base import Payload
from dadfl.strategies.step import exchange

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches

FLOAT = 4
SIZES = (6, 2, 4)


def setup(kind):
    model = build(kind)
    layout = probe_layout(model, site_batches(kind, sizes=SIZES)[0][0])
    return model, layout


def one_step(strategy, model, layout, sites, server, step, kind):
    batches = site_batches(kind, sizes=SIZES, seed=step)
    locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches]
    messages, traffic = exchange(sites, server, locals_, step)
    return batches, messages, traffic


def weights(layout, values):
    """Every captured layer's (G, m, k + 1) matrix of weight and bias (folded in as rank-dAD
    compresses it), flattened."""
    return torch.cat([
        torch.cat((values[l.weight].reshape(l.groups, l.out_per_group, -1), values[l.bias].reshape(l.groups, -1, 1)), dim=2).reshape(-1)
        for l in layout.layers
    ])


@pytest.mark.parametrize("reduce_on_server", [True, False])
def test_memories_carry_exactly_what_the_updates_left_out(reduce_on_server):
    """Fixed weights, a new batch every step. Each site sends M_s − e_s and the server
    M − E, so Σ_t update_t + Σ_s (n_s/N)·e_s + E = Σ_t gradient_t exactly: with error
    feedback the sum of updates trails the sum of gradients by the memories alone (bounded),
    without it the deficit grows step after step."""
    steps, rank = 12, 1
    model, layout = setup("mlp")
    deficits = {}
    for error_feedback in (True, False):
        strategy = make_strategy("rankdad", rank=rank, raw_input="low_rank", reduce_on_server=reduce_on_server,
                                 error_feedback=error_feedback)
        sites, server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
        updates = gradients = 0
        curve = []
        for step in range(steps):
            batches, messages, _ = one_step(strategy, model, layout, sites, server, step, "mlp")
            updates = updates + weights(layout, strategy.decode(layout, messages, model))
            gradients = gradients + weights(layout, reference_update(model, per_sample_cross_entropy, batches))
            curve.append(float((gradients - updates).norm()))
        deficits[error_feedback] = curve
        if error_feedback:
            total = sum(SIZES)
            held = sum(
                torch.cat([site.state.errors[layer.module].reshape(-1) for layer in layout.layers]) * (n / total)
                for site, n in zip(sites, SIZES)
            )
            if reduce_on_server:
                held = held + torch.cat([server.state.errors[layer.module].reshape(-1) for layer in layout.layers])
            else:
                assert not server.state.errors, "concatenation drops nothing: no server memory"
            assert float((updates + held - gradients).norm() / gradients.norm()) <= 1e-5
    with_ef, without = deficits[True], deficits[False]
    assert max(with_ef[steps // 2:]) <= 1.5 * max(with_ef[: steps // 2]), with_ef  # bounded
    assert without[-1] > 1.5 * with_ef[-1] and without[-1] > 1.5 * without[2], (with_ef, without)  # grows


@pytest.mark.parametrize("kind,options", [("cnn", {}), ("cnn", {"stack_groups": True}), ("transformer", {})])
@pytest.mark.parametrize("reduce_on_server", [True, False])
def test_full_rank_stays_exact_with_error_feedback(kind, options, reduce_on_server):
    """At full rank the residuals are rounding noise: every step equals the dSGD reference,
    uncovered matrices (the transformer's tied embedding and positions) and a grouped
    convolution's groups stacked as one matrix included."""
    model, layout = setup(kind)
    strategy = make_strategy("rankdad", rank=64, raw_input="low_rank", reduce_on_server=reduce_on_server, **options)
    assert strategy.error_feedback
    sites, server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        batches, messages, _ = one_step(strategy, model, layout, sites, server, step, kind)
        reference = reference_update(model, per_sample_cross_entropy, batches)
        update = strategy.decode(layout, messages, model)
        for name, ref in reference.items():
            assert float((update[name] - ref).norm()) <= 1e-4 * float(ref.norm()) + 1e-7, (step, name)
        apply_update(model, optimizer, update)
    memories = [e for half in [*sites, server] for e in half.state.errors.values()]
    assert memories and max(float(e.abs().max()) for e in memories) <= 1e-5


def test_uncovered_matrices_travel_as_factors_with_the_formula_bytes():
    """TinyTransformer: the positions (5×8) are uncovered; the embedding tied to the head
    (7×8) is a captured layer that reads the raw input (its token ids). With
    raw_input="low_rank" the positions travel as rank-r factors where r'·(m + k) < m·k
    (r ≤ 3), dense otherwise, and the embedding as factors of its lookups and head rows;
    with the default "dense" both travel dense."""
    model, layout = setup("transformer")
    matrices = {"embed": (7, 8), "position": (5, 8)}  # payload key: (m, k)
    assert "position" in layout.uncovered
    embed = next(l for l in layout.layers if l.module == "embed")
    assert embed.forms == ("embedding", "linear") and embed.raw_input
    dense_rest = sum(int(torch.tensor(layout.shape(n)).prod()) for n in layout.uncovered if n != "position")
    layers = 0
    for l in layout.layers:
        if l is not embed:  # biases folded in: one more input column
            k = l.in_per_group + bool(l.bias)
            layers += l.groups * min(2, l.out_per_group, k) * (k + l.out_per_group)
    for rank, raw_input in ((2, "low_rank"), (5, "low_rank"), (2, "dense")):
        strategy = make_strategy("rankdad", rank=rank, raw_input=raw_input)
        sites, server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
        _, messages, traffic = one_step(strategy, model, layout, sites, server, 0, "transformer")
        floats = 0
        for name, (m, k) in matrices.items():
            # a captured layer always travels as factors when the privacy guard allows it
            factored = raw_input != "dense" and (name == "embed" or min(rank, m, k) * (m + k) < m * k)
            floats += min(rank, m, k) * (m + k) if factored else m * k
            assert (f"{name}:P" in messages[0].tensors) == factored, (name, rank, raw_input)
            if factored:
                assert messages[0].tensors[f"{name}:P"].shape[-2:] == (m, rank)
                assert messages[0].tensors[f"{name}:Q"].shape[-2:] == (k, rank)
        if rank == 2:
            assert traffic.up == [[FLOAT * (dense_rest + layers + floats)] * len(SIZES)]
            assert traffic.down == [FLOAT * (dense_rest + layers + floats)], "re-reduced to rank r"


@pytest.mark.parametrize("kind,options", [("transformer", {}), ("cnn", {"stack_groups": True})])
@pytest.mark.parametrize("warm_start", [True, False])
def test_state_round_trip_continues_bit_identically(tmp_path, warm_start, kind, options):
    """Save every half's state after two steps (torch.save, loaded with weights_only),
    load it into fresh halves: the next steps' messages are bit-identical. Without warm
    start every step draws a random start, so the generators' state matters too."""
    model, layout = setup(kind)
    strategy = make_strategy("rankdad", rank=2, raw_input="low_rank", warm_start=warm_start, **options)
    sites, server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
    for step in range(2):
        one_step(strategy, model, layout, sites, server, step, kind)
    paths = []
    for i, half in enumerate([*sites, server]):
        state = half.state_dict()
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        assert any(k.startswith("error/") for k in state) and any(k.startswith("rng/") for k in state)
        assert any(k.startswith("warm/") for k in state) == warm_start
        paths.append(tmp_path / f"half{i}.pt")
        torch.save(state, paths[-1])
    fresh_sites, fresh_server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
    for half, path in zip([*fresh_sites, fresh_server], paths):
        half.load_state_dict(torch.load(path, weights_only=True))
    for step in range(2, 4):
        _, original, _ = one_step(strategy, model, layout, sites, server, step, kind)
        _, restored, _ = one_step(strategy, model, layout, fresh_sites, fresh_server, step, kind)
        assert original[0].tensors.keys() == restored[0].tensors.keys()
        for key, tensor in original[0].tensors.items():
            assert torch.equal(tensor, restored[0].tensors[key]), (step, key)


@pytest.mark.parametrize("shared", [True, False])
def test_sites_start_the_next_step_from_the_server_q(shared):
    """With ``shared_warm_start`` every site keeps the re-reduced Q̂ that came down (the same
    at every site) as its next start; without it each keeps its own, different, Q. A Q̂
    that is not finite or not of rank r' leaves the site's own start in place."""
    kind = "transformer"
    model, layout = setup(kind)
    strategy = make_strategy("rankdad", rank=2, raw_input="low_rank", shared_warm_start=shared)
    sites, server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
    _, messages, _ = one_step(strategy, model, layout, sites, server, 0, kind)
    matrices = sites[0].plan.matrices
    assert {t.layer is None for t in matrices} == {True, False}, "layers and uncovered matrices both"
    for target in matrices:
        sent = target.read(messages[-1])[1]
        starts = [site.state.warm[target.key] for site in sites]
        assert all(torch.equal(start, sent) for start in starts) == shared, target.key
    if not shared:
        return
    site, own = sites[0], {key: q.clone() for key, q in sites[0].state.warm.items()}
    for corrupt in (lambda q: torch.full_like(q, float("nan")), lambda q: torch.cat([q, q], dim=-1)):
        tensors = {key: corrupt(t) if key.endswith(":Q") else t for key, t in messages[-1].tensors.items()}
        site.receive(Payload(messages[-1].step, messages[-1].phase, messages[-1].num_samples, tensors))
        assert all(torch.equal(site.state.warm[key], q) for key, q in own.items())


def test_state_from_another_model_is_refused():
    model, layout = setup("transformer")
    strategy = make_strategy("rankdad", rank=2, raw_input="low_rank")
    site = strategy.site(layout, model)
    with pytest.raises(ValueError, match="unknown keys"):
        site.load_state_dict({"error/nonexistent": torch.zeros(1, 2, 2)})
    with pytest.raises(ValueError, match="shape"):
        site.load_state_dict({"error/position": torch.zeros(1, 3, 3)})


def test_simulation_replicas_stay_bit_identical(tmp_path):
    """The in-process simulation checks every replica's fingerprint after every step; a
    short character-transformer run with compressed uncovered matrices passes it."""
    spec = StrategySpec(name="rankdad", options={"rank": 1, "raw_input": "low_rank"})
    config = SimulationConfig(
        workload="char-transformer", workload_options={"seq_len": 8, "d_model": 16, "layers": 1, "max_sequences": 400},
        sites=3, batch_size=8, steps=4, eval_every=4, device="cpu", strategies=[spec],
    )
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        simulate(config, spec, metrics)
    records = list(read_metrics(tmp_path / "m.jsonl"))  # written only for steps whose replicas agreed
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "rank99/position/update" in records[-1], "positions travel as factors"
