"""Byte counts equal the cost formulas in the strategies' docstrings; the raw-input guard holds."""

import pytest
import torch

from dadfl.strategies import local_step, make_strategy

from model_zoo import build, exchange_step, per_sample_cross_entropy, site_batches

FLOAT = 4  # bytes of float32


def run_exchange(strategy_name, kind="mlp", sizes=(5, 1, 3), **options):
    layout, _, _, _, messages, traffic = exchange_step(make_strategy(strategy_name, **options), kind, sizes)
    return layout, messages, traffic


def numel(layout, names):
    return sum(int(torch.tensor(layout.shape(n)).prod()) for n in names)


def dense_layer(layer):
    return layer.weight_numel + (layer.out_features if layer.bias else 0)


def test_dsgd_sends_every_parameter_both_ways():
    layout, _, traffic = run_exchange("dsgd")
    total = FLOAT * numel(layout, layout.params)
    assert traffic.up == [[total] * 3]
    assert traffic.down == [total]


@pytest.mark.parametrize("downlink", ["dense", "factors"])
def test_dad_bytes(downlink):
    sizes = (5, 1, 3)
    layout, _, traffic = run_exchange("dad", sizes=sizes, downlink=downlink)
    first, *hidden = layout.layers
    assert first.raw_input and not any(layer.raw_input for layer in hidden)
    fixed = numel(layout, layout.uncovered) + dense_layer(first)
    for n, sent in zip(sizes, traffic.up[0]):
        assert sent == FLOAT * (fixed + sum(n * (l.in_features + l.out_features) for l in hidden))
    N = sum(sizes)
    if downlink == "dense":
        assert traffic.down == [FLOAT * numel(layout, layout.params)]
    else:
        assert traffic.down == [FLOAT * (fixed + sum(N * (l.in_features + l.out_features) for l in hidden))]


def test_conv_factor_rows_count_output_positions_and_groups():
    sizes = (2, 3)
    layout, _, traffic = run_exchange("dad", kind="cnn", sizes=sizes)
    conv2 = next(l for l in layout.layers if l.module == "conv2")
    assert (conv2.groups, conv2.in_per_group, conv2.out_per_group) == (4, 2 * 9, 2)
    per_sample_rows = {"conv2": 16, "conv3": 16, "head": 1}  # 4×4 positions, 16 positions, 1
    fixed = numel(layout, layout.uncovered) + dense_layer(layout.layers[0])
    for n, sent in zip(sizes, traffic.up[0]):
        factors = sum(
            n * per_sample_rows[l.module] * (l.in_features + l.out_features) for l in layout.layers[1:]
        )
        assert sent == FLOAT * (fixed + factors)


def test_auto_picks_the_smaller_exact_form_per_layer():
    sizes = (40, 1)
    layout, _, traffic = run_exchange("auto", sizes=sizes)
    first, *hidden = layout.layers
    fixed = numel(layout, layout.uncovered) + dense_layer(first)
    for n, sent in zip(sizes, traffic.up[0]):
        expected = fixed + sum(min(n * (l.in_features + l.out_features), dense_layer(l)) for l in hidden)
        assert sent == FLOAT * expected
    N = sum(sizes)
    down = fixed + sum(
        dense_layer(l) if 40 * (l.in_features + l.out_features) >= dense_layer(l) else
        min(N * (l.in_features + l.out_features), dense_layer(l))
        for l in hidden
    )
    assert traffic.down == [FLOAT * down]


def test_edad_sends_output_deltas_only():
    sizes = (4, 2)
    layout, messages, traffic = run_exchange("edad", sizes=sizes, downlink="factors")
    first, *hidden = layout.layers
    fixed = numel(layout, layout.uncovered) + dense_layer(first)
    for n, sent in zip(sizes, traffic.up[0]):
        expected = fixed + sum(n * l.in_features for l in hidden) + n * hidden[-1].out_features
        assert sent == FLOAT * expected
    roles = {key for key in messages[0].tensors if key.endswith(":D")}
    assert roles == {f"{hidden[-1].module}:D"}


@pytest.mark.parametrize(
    "strategy,kind", [("dad", "mlp"), ("dad", "cnn"), ("auto", "mlp"), ("auto", "cnn"), ("edad", "mlp")]
)
def test_raw_input_layer_never_sends_activations_by_default(strategy, kind):
    layout, messages, _ = run_exchange(strategy, kind=kind, sizes=(50, 50))
    first = layout.layers[0]
    assert first.raw_input
    assert f"{first.module}:A" not in messages[0].tensors
    assert f"{first.weight}:grad" in messages[0].tensors
    model = build(kind)
    batches = site_batches(kind, sizes=(50,))
    strategy_obj = make_strategy(strategy)
    local = local_step(model, layout, per_sample_cross_entropy, *batches[0])
    payload = strategy_obj.site(layout, model).begin(local, 0)
    assert f"{first.module}:A" not in payload.tensors, "raw input must not leave the site"


def test_raw_input_activations_only_when_allowed():
    layout, _, _ = run_exchange("dad", sizes=(2, 2))
    model = build("mlp")
    x, y = site_batches("mlp", sizes=(2,))[0]
    local = local_step(model, layout, per_sample_cross_entropy, x, y)
    payload = make_strategy("dad", raw_input="activations").site(layout, model).begin(local, 0)
    # the first layer reads a view of the raw input: its activation rows are the patient data itself
    torch.testing.assert_close(payload.tensors[f"{layout.layers[0].module}:A"][0], x)


def test_unknown_privacy_policy_is_rejected_with_choices():
    with pytest.raises(ValueError, match="'dense' keeps"):
        make_strategy("dad", raw_input="everything")
