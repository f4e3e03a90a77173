"""Mixed precision: capture under bf16/fp16 autocast, factors in that dtype, updates within
its tolerance of autograd's under the same autocast, fp16 loss scaling, clear refusals."""

import pytest
import torch

from dadfl.metrics import MetricsWriter
from dadfl.replica import OptimizerConfig, Replica
from dadfl.server.config import ServerConfig
from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from dadfl.strategies import local_step, make_strategy, probe_layout, reference_update, step_update
from dadfl.strategies.checks import ModelFacts
from dadfl.strategies.precision import FP16_LOSS_SCALE, tolerance
from dadfl.strategies.step import exchange
from dadfl.workloads import BUILTIN, LARGE, load_workload

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches
from tests.strategies.test_exactness import relative_errors

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Every layer shares its factors (raw input allowed), so capture itself is what is checked;
# rank-dAD at full rank, with and without error feedback (its passes then run on A and Δ).
STRATEGIES = [
    ("dad", {"raw_input": "activations"}),
    ("dad", {"raw_input": "activations", "downlink": "factors"}),
    ("auto", {"raw_input": "activations"}),
    ("rankdad", {"rank": 64, "raw_input": "activations"}),
    ("rankdad", {"rank": 64, "raw_input": "activations", "error_feedback": False}),
]


# bf16 on every kind of model; fp16 (loss-scaled) on three.
CASES = [(kind, "bf16") for kind in ("mlp", "cnn", "gru", "transformer", "norm")] + [(kind, "fp16") for kind in ("mlp", "cnn", "transformer")]


@pytest.mark.parametrize("kind,precision", CASES)
def test_updates_within_the_dtypes_tolerance_of_autograd(kind, precision):
    model = build(kind)
    batches = site_batches(kind, sizes=(5, 2, 3) if kind == "norm" else (5, 1, 3))
    layout = probe_layout(model, batches[0][0], precision)
    assert not layout.dense_reasons, layout.dense_reasons
    assert {layer.compute_dtype for layer in layout.layers if layer.forms != ("embedding",)} == {DTYPES[precision]}
    reference = reference_update(model, per_sample_cross_entropy, batches, precision)
    for name, options in STRATEGIES:
        update = step_update(make_strategy(name, **options), model, per_sample_cross_entropy, batches, precision)
        errors = relative_errors(update, reference)
        assert max(errors.values()) <= tolerance(DTYPES[precision]), (name, options, errors)


@pytest.mark.parametrize("workload", [name for name in BUILTIN if name not in LARGE])
def test_no_builtin_layer_travels_dense_for_its_dtype(workload):
    loaded = load_workload(workload)
    model, example = loaded.build_model(), loaded.example()
    full, mixed = probe_layout(model, example), probe_layout(model, example, "bf16")
    assert [layer.module for layer in mixed.layers] == [layer.module for layer in full.layers]
    assert not mixed.dense_reasons, mixed.dense_reasons
    assert all(layer.compute_dtype == torch.bfloat16 for layer in mixed.layers if layer.forms != ("embedding",))


def test_factors_travel_in_half_the_bytes_and_the_checks_take_them():
    model = build("mlp")
    batches = site_batches("mlp")
    strategy = make_strategy("dad", raw_input="activations")
    sent = {}
    for precision in ("fp32", "bf16"):
        layout = probe_layout(model, batches[0][0], precision)
        locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, precision=precision) for x, y in batches]
        sites = [strategy.site(layout, model) for _ in batches]
        _, traffic = exchange(sites, strategy.server(layout, model), locals_, step=0)
        sent[precision] = sum(f.nbytes() for local in locals_ for f in local.factors.values())
        assert all(f.A.dtype == f.D.dtype == layout.layers[0].compute_dtype for f in locals_[0].factors.values())
        payloads = [site.begin(local, 0) for site, local in zip(sites, locals_)]
        facts = ModelFacts.from_model(model, layout)
        assert strategy.check_uploads(layout, facts, 0, 0, payloads, []) == []
        if precision == "bf16":  # an fp32 factor where the layout says bf16 is refused
            key = f"{layout.layers[0].module}:A"
            payloads[0].tensors[key] = payloads[0].tensors[key].float()
            (rejection,) = strategy.check_uploads(layout, facts, 0, 0, payloads, [])
            assert "dtype torch.float32, expected torch.bfloat16" in rejection.reason
    assert sent["bf16"] * 2 == sent["fp32"] > 0


def test_fp16_loss_scale_backs_off_until_the_deltas_fit():
    """A loss 100× larger makes the first scale overflow fp16's deltas; the step backs off and
    still matches autograd's fp16 update (scaled alike, one backward per site)."""
    model = build("mlp")
    batches = site_batches("mlp")
    loud = lambda outputs, targets: 100 * per_sample_cross_entropy(outputs, targets)  # noqa: E731
    assert 100 * FP16_LOSS_SCALE > torch.finfo(torch.float16).max  # the first try overflows
    reference = reference_update(model, loud, batches, "fp16")
    update = step_update(make_strategy("dad", raw_input="activations"), model, loud, batches, "fp16")
    errors = relative_errors(update, reference)
    assert max(errors.values()) <= tolerance(torch.float16), errors


def test_fp16_overflow_at_every_scale_is_refused_clearly():
    model = build("mlp")
    layout = probe_layout(model, site_batches("mlp")[0][0], "fp16")
    huge = lambda outputs, targets: 1e30 * per_sample_cross_entropy(outputs, targets)  # noqa: E731
    x, y = site_batches("mlp")[0]
    with pytest.raises(FloatingPointError, match="precision='bf16' or 'fp32'"):
        local_step(model, layout, huge, x, y, precision="fp16")


def test_a_step_off_the_layouts_dtype_sends_that_layer_dense():
    """Layout probed in fp32, a step under bf16: no factor in the wrong dtype leaves, the
    layers travel dense with the reason."""
    model = build("mlp")
    x, y = site_batches("mlp")[0]
    layout = probe_layout(model, x)
    local = local_step(model, layout, per_sample_cross_entropy, x, y, precision="bf16")
    assert local.factors == {}
    assert set(local.grads) == set(layout.params)


def test_clear_refusals():
    loaded = load_workload("digits-mlp")
    with pytest.raises(ValueError, match="edad recomputes hidden deltas in the weight's dtype"):
        Replica(loaded, make_strategy("edad"), OptimizerConfig(), precision="bf16")
    with pytest.raises(ValueError, match="use precision 'fp32' with \\[dp\\]"):
        Replica(loaded, make_strategy("dad"), OptimizerConfig(), max_grad_norm=1.0, precision="bf16")
    with pytest.raises(ValueError, match="local rounds"):
        Replica(loaded, make_strategy("fedavg"), OptimizerConfig(), precision="bf16")
    with pytest.raises(ValueError, match="precision"):
        SimulationConfig(precision="fp8")
    with pytest.raises(ValueError, match="use precision 'fp32' with \\[dp\\]"):
        ServerConfig.model_validate({"training": {"precision": "bf16"}, "dp": {"noise_multiplier": 1.0, "max_sample_rate": 0.1}})


def test_replicas_agree_under_autocast(tmp_path):
    """Every replica applies the same float32 update decoded from bf16 factors."""
    config = SimulationConfig(workload="digits-mlp", sites=3, steps=4, batch_size=8, eval_every=4, precision="bf16")
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        summary = simulate(config, StrategySpec(name="dad", options={"downlink": "factors"}), metrics)
    assert summary["steps"] == 4  # a divergence would have stopped the run (ReplicaDivergence)

