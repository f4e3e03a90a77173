"""Byte counts equal the cost formulas in the strategies' docstrings; the raw-input guard holds."""

import pytest
import torch
from torch import nn

from dadfl.strategies import local_step, make_strategy, probe_layout
from dadfl.strategies.base import RAW_INPUT_POLICIES

from tests.helpers.model_zoo import build, exchange_step, per_sample_cross_entropy, site_batches

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


RANK_R = {"rankdad": {"rank": 1}, "powersgd": {"rank": 1, "start_iter": 0, "min_compression_rate": 0}}


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("raw_input", [None, *RAW_INPUT_POLICIES])
def test_one_raw_input_policy_governs_rank_dad_and_powersgd(kind, raw_input):
    """Both send a rank-r projection of a raw-input layer's gradient, or both its dense gradient:
    the same matrices dense under the same policy; neither ever sends A or Δ."""
    model = build(kind)
    batches = site_batches(kind, sizes=(6,))
    layout = probe_layout(model, batches[0][0])
    local = local_step(model, layout, per_sample_cross_entropy, *batches[0])
    first = next(layer for layer in layout.layers if layer.raw_input)
    matrices = {name for name, shape in zip(layout.params, layout.shapes) if len(shape) > 1}
    dense = {}
    for name, options in RANK_R.items():
        options = options if raw_input is None else {**options, "raw_input": raw_input}
        strategy = make_strategy(name, **options)
        site = strategy.site(layout, model)
        payload = site.begin(local, 0)
        if name == "powersgd":  # its dense gradients travel with Q_s, in phase 1
            payload = site.receive(strategy.server(layout, model).aggregate([payload]))
        assert not any(key.endswith((":A", ":D", ":ids", ":rows")) for key in payload.tensors)
        dense[name] = {key.rpartition(":")[0] for key in payload.tensors if key.endswith(":grad")} & matrices
        if first.weight in dense[name]:
            assert torch.equal(payload.tensors[f"{first.weight}:grad"], local.grads[first.weight])
    assert dense["rankdad"] == dense["powersgd"]
    if raw_input == "dense":  # the raw-input layers and the matrices the layout cannot place
        assert dense["rankdad"] == {l.weight for l in layout.layers if l.raw_input} | (matrices & set(layout.uncovered))
    else:  # the default: every matrix as a projection
        assert dense["rankdad"] == set()


class NormalisedInput(nn.Module):
    """Patient rows transformed before the first layer: BatchNorm, LayerNorm, a scaling, a column
    selection, or a standardisation under no_grad; a recurrent zero state shaped like the input."""

    def __init__(self, before: str):
        super().__init__()
        self.before = before
        self.norm = nn.BatchNorm1d(12) if before == "batch_norm" else nn.LayerNorm(12)
        self.first, self.state, self.second = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x):
        if self.before == "scaling":
            x = x / 100
        elif self.before == "columns":
            x = torch.cat([x[:, 6:], x[:, :6]], dim=1).float()
        elif self.before == "no_grad_standardisation":
            with torch.no_grad():
                x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        elif self.before == "numpy":
            x = torch.from_numpy(x.numpy() / 100)
        else:
            x = self.norm(x)
        zero_state = x.new_zeros(x.shape[0], 16)  # shape only: not raw input
        return self.second(torch.tanh(self.first(x) + self.state(zero_state)))


@pytest.mark.parametrize("before", ["batch_norm", "layer_norm", "scaling", "columns", "no_grad_standardisation", "numpy"])
def test_raw_input_stays_raw_through_what_transforms_it(before):
    """A layer reading the input after a normalisation or any other transformation reads the
    patient rows all the same (BatchNorm's output and running statistics give them back): its
    activations stay on the site; a captured layer's output, or a zero state, is not raw input.
    Raw input taken out of torch cannot be followed back: every layer after it counts as raw."""
    torch.manual_seed(0)
    model = NormalisedInput(before)
    x, y = site_batches("mlp", sizes=(6,))[0]
    layout = probe_layout(model, x)
    left_torch = before == "numpy"
    assert {layer.module: layer.raw_input for layer in layout.layers} == {"first": True, "state": left_torch, "second": left_torch}
    local = local_step(model, layout, per_sample_cross_entropy, x, y)
    payload = make_strategy("dad").site(layout, model).begin(local, 0)
    assert "first:A" not in payload.tensors and "first.weight:grad" in payload.tensors
    assert ("second:A" in payload.tensors) != left_torch


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
