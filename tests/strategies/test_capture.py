"""Capture follows calls and is verified; embeddings travel as ids and rows; what has no
gradient gets no update; inputs capture cannot serve get a clear answer."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dadfl.strategies.checks import ModelFacts
from dadfl.strategies import apply_update, local_step, make_strategy, probe_layout, reference_update, step_update
from dadfl.strategies.precision import tolerance

from tests.helpers.model_zoo import build, exchange_step, per_sample_cross_entropy, site_batches

INT32, FLOAT = 4, 4


def layout_of(kind):
    model = build(kind)
    return model, probe_layout(model, site_batches(kind)[0][0])


def test_probe_sends_a_weight_used_outside_its_call_dense_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="dadfl.capture"):
        _, layout = layout_of("tied_autoencoder")
    assert {layer.module for layer in layout.layers} == {"head"}
    reasons = dict(layout.dense_reasons)
    assert "encoder.weight" in layout.uncovered and "differs from autograd's" in reasons["encoder.weight"]
    lines = [r.getMessage() for r in caplog.records if "encoder.weight" in r.getMessage()]
    assert len(lines) == 1 and "travels dense" in lines[0]


def test_calls_are_captured_wherever_they_happen():
    _, hooked = layout_of("hooked")  # forward hook on one, keyword call on the other
    assert {layer.module for layer in hooked.layers} == {"first", "second"}
    _, attention = layout_of("attention")
    modules = {layer.module: layer for layer in attention.layers}
    for name in ("self_attention", "cross_attention"):
        packed = modules[f"{name}.in_proj_weight"]
        assert (packed.out_features, packed.in_features, packed.bias) == (24, 8, f"{name}.in_proj_bias")
        assert f"{name}.out_proj" in modules
    _, functional = layout_of("functional_embedding")
    table = next(layer for layer in functional.layers if layer.module == "table")
    assert table.forms == ("embedding", "linear") and table.raw_input, "token ids are the raw input"
    assert "unused.weight" not in {layer.weight for layer in functional.layers}


def run_site(kind, sizes, strategy="dad", **options):
    return exchange_step(make_strategy(strategy, **options), kind, sizes)


def test_embedding_factors_cost_n_times_one_plus_d():
    layout, batches, _, _, messages, traffic = run_site("gru", (5, 1, 3), raw_input="activations", downlink="factors")
    embed = next(layer for layer in layout.layers if layer.module == "embed")
    d = embed.in_per_group
    total_ids = sum(tokens.numel() for tokens, _ in batches)
    assert traffic.up_by_layer["embed"] == total_ids * (INT32 + d * FLOAT)
    assert messages[0].tensors["embed:ids"].dtype == torch.int32
    assert traffic.down_by_layer["embed"] == total_ids * (INT32 + d * FLOAT)


def test_padding_lookups_are_not_sent():
    layout, batches, _, locals_, _, _ = run_site("functional_embedding", (4, 2), raw_input="activations")
    for (tokens, _), local in zip(batches, locals_):
        factors = local.factors["table"]
        assert factors.ids.numel() == int((tokens != 0).sum()) and bool((factors.ids != 0).all())
        assert factors.rows.shape == (factors.ids.numel(), 6)


def test_auto_counts_ids_at_their_size():
    """auto takes the lookups when n·(4 + 4d) bytes beat the table's V·d·4, not otherwise."""
    model = nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(8, 3))
    inputs = torch.arange(20).reshape(10, 2) % 50
    targets = torch.arange(10) % 3
    layout = probe_layout(model, inputs)
    strategy = make_strategy("auto", raw_input="activations")
    for rows, expect_factors in ((10, True), (40, False)):  # 20·(4+16)=400 < 800; 80·20=1600 > 800
        x = torch.arange(rows * 2).reshape(rows, 2) % 50
        local = local_step(model, layout, per_sample_cross_entropy, x, torch.arange(rows) % 3)
        payload = strategy.site(layout, model).begin(local, 0)
        assert ("0:ids" in payload.tensors) == expect_factors
        assert ("0.weight:grad" in payload.tensors) != expect_factors


@pytest.mark.parametrize("strategy", ["dsgd", "dad", "rankdad"])
def test_a_parameter_without_gradient_gets_no_update(strategy):
    model = build("functional_embedding")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(3):
        update = step_update(make_strategy(strategy), model, per_sample_cross_entropy, site_batches("functional_embedding", sizes=(3, 2), seed=step))
        assert not {"unused.weight", "unused.bias"} & set(update)
        apply_update(model, optimizer, update)
    after = dict(model.named_parameters())
    assert torch.equal(after["unused.weight"], before["unused.weight"]) and torch.equal(after["unused.bias"], before["unused.bias"])
    assert not torch.equal(after["conv.weight"], before["conv.weight"])


def test_mean_reduced_loss_is_refused_clearly():
    model = build("mlp")
    batches = site_batches("mlp", sizes=(3, 2))
    mean_loss = lambda outputs, targets: F.cross_entropy(outputs, targets)  # noqa: E731
    with pytest.raises(ValueError, match="must return one loss per sample: use reduction='none'"):
        step_update(make_strategy("dad"), model, mean_loss, batches)
    with pytest.raises(ValueError, match="one loss per sample"):
        reference_update(model, mean_loss, batches)


class AutocastMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = torch.tanh(self.first(x))
        return self.second(hidden.float())


def test_a_forward_that_autocasts_itself_is_captured_in_its_dtype():
    """The model's own autocast region: that layer's factors are bf16, the other's fp32, and
    the update is dSGD's (same summed-loss bf16 arithmetic) within bf16's tolerance."""
    torch.manual_seed(0)
    model = AutocastMLP()
    batches = site_batches("mlp", sizes=(3, 2))
    layout = probe_layout(model, batches[0][0])
    dtypes = {layer.module: layer.compute_dtype for layer in layout.layers}
    assert dtypes == {"first": torch.bfloat16, "second": torch.float32} and not layout.dense_reasons
    dense = step_update(make_strategy("dsgd"), model, per_sample_cross_entropy, batches)
    update = step_update(make_strategy("dad", raw_input="activations"), model, per_sample_cross_entropy, batches)
    torch.testing.assert_close(update["second.weight"], dense["second.weight"], rtol=1e-5, atol=1e-7)
    for name, ref in dense.items():
        assert float((update[name] - ref).norm() / ref.norm()) <= tolerance(torch.bfloat16), name


def test_strategy_checks_embedding_ids_and_rows():
    layout, batches, sites, locals_, _, _ = run_site("gru", (3, 2), raw_input="activations")
    model = build("gru")
    strategy = make_strategy("dad", raw_input="activations")
    facts = ModelFacts.from_model(model, layout)
    assert facts.lookups_per_sample["embed"] == 5, "one lookup per token"
    payload = sites[0].begin(locals_[0], 0)

    def reasons(tensors):
        bad = type(payload)(0, 0, payload.num_samples, tensors)
        return [r.reason for r in strategy.check_uploads(layout, facts, 0, 0, [bad], [], model)]

    assert reasons(dict(payload.tensors)) == []
    ids = payload.tensors["embed:ids"].clone()
    ids[0] = 7  # the table has 7 rows
    assert "values outside 0..6" in reasons({**payload.tensors, "embed:ids": ids})[0]
    assert "dtype torch.int64, expected torch.int32" in reasons({**payload.tensors, "embed:ids": ids.long()})[0]
    assert "lookups along dimension 0" in reasons({**payload.tensors, "embed:rows": payload.tensors["embed:rows"][1:]})[0]
    many = {**payload.tensors, "embed:ids": torch.cat([ids[:1] * 0] * 16), "embed:rows": payload.tensors["embed:rows"][:1].repeat(16, 1)}
    assert "makes at most 15" in reasons(many)[0]


class SometimesTied(nn.Module):
    """Reads its first weight outside the call only for batches of 4 or more samples."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(12, 8), nn.Linear(8, 5)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        if len(x) >= 4:
            hidden = hidden + self.first.weight.sum(dim=1)
        return self.second(hidden)


def test_a_use_the_probe_did_not_see_sends_the_layer_dense_that_step(caplog):
    torch.manual_seed(0)
    model = SometimesTied()
    batches = site_batches("mlp", sizes=(2, 5))  # the layout's probe sees the 2-sample batch
    reference = reference_update(model, per_sample_cross_entropy, batches)
    with caplog.at_level(logging.WARNING, logger="dadfl.capture"):
        update = step_update(make_strategy("dad", raw_input="activations"), model, per_sample_cross_entropy, batches)
    assert any("'first' travels dense this step: also used by torch.Tensor.sum" in r.getMessage() for r in caplog.records)
    for name, ref in reference.items():
        assert float((update[name] - ref).norm() / ref.norm()) <= 1e-5, name
