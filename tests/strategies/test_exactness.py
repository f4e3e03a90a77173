"""Every exact strategy reconstructs the dSGD reference on every kind of model.

Unequal site batches, including a site with a single sample; the reference is the
weighted mean Σ_s (n_s/N)∇(mean loss of s) computed by plain autograd.
"""

import pytest
import torch

from dadfl.strategies import make_strategy, probe_layout, reference_update, step_update

from tests.helpers.model_zoo import CAPTURE_CASES, build, per_sample_cross_entropy, site_batches

EXACT = [
    ("dsgd", {}),
    ("dad", {}),
    ("dad", {"downlink": "factors"}),
    ("dad", {"raw_input": "activations"}),
    ("auto", {}),
    ("auto", {"raw_input": "activations"}),
]


def relative_errors(update, reference):
    """‖u − r‖ / ‖r‖ per parameter. A parameter whose true gradient is zero in exact
    arithmetic (attention key biases: softmax ignores a constant shift) holds rounding
    noise only; it is measured against 1e-3 of the whole update's norm instead."""
    floor = 1e-3 * torch.sqrt(sum(ref.norm() ** 2 for ref in reference.values()))
    return {name: float((update[name] - ref).norm() / torch.maximum(ref.norm(), floor)) for name, ref in reference.items()}


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gru", "transformer", "norm"])
@pytest.mark.parametrize("strategy,options", EXACT)
def test_exact_strategies_match_reference(kind, strategy, options):
    model = build(kind)
    # BatchNorm cannot train on one sample (PyTorch refuses), so the norm model's smallest site has 2.
    batches = site_batches(kind, sizes=(5, 2, 3) if kind == "norm" else (5, 1, 3))
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = step_update(make_strategy(strategy, **options), model, per_sample_cross_entropy, batches)
    assert set(reference) <= set(update), "every parameter must be synchronised"
    errors = relative_errors(update, reference)
    assert max(errors.values()) <= 1e-5, errors


# Every layer shares its factors (raw input allowed), so capture itself is what is checked.
CAPTURE_STRATEGIES = [
    ("dsgd", {}),
    ("dad", {"raw_input": "activations"}),
    ("dad", {"raw_input": "activations", "downlink": "factors"}),
    ("auto", {"raw_input": "activations"}),
    ("rankdad", {"rank": 64, "raw_input": "activations"}),
]


@pytest.mark.parametrize("kind", list(CAPTURE_CASES))
@pytest.mark.parametrize("strategy,options", CAPTURE_STRATEGIES)
def test_capture_cases_match_reference(kind, strategy, options):
    """Tied weights used outside their call, hooks, keyword calls, attention's packed
    projections, functional and padded lookups, unbatched convs: exact (rank-dAD at full rank)."""
    model = build(kind)
    batches = site_batches(kind, sizes=(5, 1, 3))
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = step_update(make_strategy(strategy, **options), model, per_sample_cross_entropy, batches)
    assert set(reference) <= set(update), "every parameter with a gradient must be synchronised"
    errors = relative_errors(update, reference)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("kind", ["mlp", "reused_activation"])
@pytest.mark.parametrize("options", [{}, {"downlink": "factors"}, {"raw_input": "activations"}])
def test_edad_matches_reference_on_mlp(kind, options):
    model = build(kind)
    batches = site_batches(kind, sizes=(4, 1, 9, 2))
    reference = reference_update(model, per_sample_cross_entropy, batches)
    update = step_update(make_strategy("edad", **options), model, per_sample_cross_entropy, batches)
    assert max(relative_errors(update, reference).values()) <= 1e-5


@pytest.mark.parametrize("kind", ["cnn", "gru", "transformer", "norm"])
def test_edad_refuses_models_it_cannot_recompute(kind):
    model = build(kind)
    with pytest.raises(ValueError, match="edad.*use 'dad' or 'auto'"):
        step_update(make_strategy("edad"), model, per_sample_cross_entropy, site_batches(kind, sizes=(2, 3)))


def test_reference_differs_from_unweighted_mean():
    """The weighting matters: a plain mean of per-site gradients is not the reference."""
    model = build("mlp")
    batches = site_batches("mlp", sizes=(9, 1))
    reference = reference_update(model, per_sample_cross_entropy, batches)
    per_site = [reference_update(model, per_sample_cross_entropy, [b]) for b in batches]
    unweighted = {k: (per_site[0][k] + per_site[1][k]) / 2 for k in reference}
    assert max(relative_errors(unweighted, reference).values()) > 1e-2


def test_edad_refuses_a_linear_listed_twice():
    linear = torch.nn.Linear(12, 12)
    model = torch.nn.Sequential(linear, torch.nn.Tanh(), linear, torch.nn.Tanh(), torch.nn.Linear(12, 5))
    with pytest.raises(ValueError, match="edad: the Linear '0' appears again at position '2'"):
        step_update(make_strategy("edad"), model, per_sample_cross_entropy, site_batches("mlp", sizes=(2, 3)))


def test_layout_covers_every_parameter():
    """Embedding tied to the head: one layer with both call forms; raw Parameters, norms: dense."""
    model = build("transformer")
    layout = probe_layout(model, site_batches("transformer")[0][0])
    forms = {layer.module: layer.forms for layer in layout.layers}
    assert forms == {"embed": ("embedding", "linear"), "qkv": ("linear",), "proj": ("linear",), "up": ("linear",), "down": ("linear",)}
    assert {"position", "norm1.weight", "norm2.bias"} <= set(layout.uncovered)
    covered = {layer.weight for layer in layout.layers} | {layer.bias for layer in layout.layers if layer.bias}
    assert set(layout.params) == covered | set(layout.uncovered)


def test_module_reuse_keeps_rows_of_every_call():
    from dadfl.strategies import local_step

    model = build("gru")
    inputs, targets = site_batches("gru", sizes=(3,))[0]
    layout = probe_layout(model, inputs)
    local = local_step(model, layout, per_sample_cross_entropy, inputs, targets)
    # 3 sequences × 5 time steps = 15 rows per reused cell
    assert local.factors["hidden_gates"].A.shape == (1, 15, 10)
    assert local.factors["head"].D.shape == (1, 15, 7)


def test_batchnorm_running_statistics_are_sample_weighted():
    model = build("norm")
    batches = site_batches("norm", sizes=(6, 2))
    update = step_update(make_strategy("dad"), model, per_sample_cross_entropy, batches)
    expected = 0
    for inputs, _ in batches:
        replica = build("norm")
        replica.train()
        replica(inputs)
        expected = expected + replica.bn.running_mean * len(inputs)
    torch.testing.assert_close(update["bn.running_mean:buffer"], expected / 8)


@pytest.mark.parametrize("workload_name", ["digits-mlp", "digits-cnn", "breast-cancer-mlp", "char-gru", "char-transformer"])
def test_builtin_workloads_are_exact_under_dad_and_auto(workload_name):
    from dadfl.workloads import load_workload

    workload = load_workload(workload_name)
    model = workload.build_model()
    train = workload.train
    batches = [(train.inputs[a:b], train.targets[a:b]) for a, b in [(0, 6), (6, 7), (7, 10)]]
    reference = reference_update(model, workload.loss, batches)
    names = ["dad", "auto"] + (["edad"] if workload_name.endswith("mlp") else [])
    for name in names:
        update = step_update(make_strategy(name), model, workload.loss, batches)
        errors = relative_errors(update, reference)
        assert max(errors.values()) <= 1e-5, (name, errors)


def test_weights_fingerprint_sees_every_bit_including_buffers():
    from dadfl.strategies import weights_fingerprint

    model, twin = build("norm"), build("norm")
    assert weights_fingerprint(model) == weights_fingerprint(twin), "same seed, same weights, same fingerprint"
    with torch.no_grad():
        twin.fc2.weight.view(-1)[3] = torch.nextafter(twin.fc2.weight.view(-1)[3], torch.tensor(1.0))
    assert weights_fingerprint(model) != weights_fingerprint(twin), "one ulp in one weight"
    twin = build("norm")
    twin.bn.num_batches_tracked += 1  # a 0-dim integer buffer
    assert weights_fingerprint(model) != weights_fingerprint(twin)
