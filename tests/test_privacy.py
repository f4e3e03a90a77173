"""Differential privacy: per-sample clipping read off the factors, against a per-sample autograd loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dadfl.strategies import Layout, make_strategy
from dadfl.strategies.capture import per_sample_losses
from dadfl.strategies.privacy import ClipPlan, clipped_local_step, refuse_sample_mixing
from dadfl.strategies.step import exchange
from dadfl.workloads import load_workload
from model_zoo import build, per_sample_cross_entropy, site_batches

MAX_GRAD_NORM = 0.5
TOLERANCE = 1e-5


def per_sample_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float):
    """(norms, Σ_i c_i g_i by parameter name): one backward per sample, the textbook DP-SGD."""
    norms, clipped = [], {}
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        per_sample_losses(per_sample_cross_entropy(model(x[i : i + 1]), y[i : i + 1])).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        norms.append(norm)
        for name, g in grads.items():
            clipped[name] = clipped.get(name, 0) + min(1.0, max_grad_norm / float(norm)) * g
    model.zero_grad(set_to_none=True)
    return torch.stack(norms), clipped


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


# Each kind with the layers whose norms must come from the factors (not autograd's fallback).
FROM_FACTORS = {
    "mlp": {"1", "3", "5"},  # Linear, one row per sample
    "cnn": {"conv1", "conv2", "conv3", "head"},  # Conv2d (strided, grouped, dilated), Conv1d
    "gru": {"embed", "input_gates", "hidden_gates", "head"},  # Embedding, Linear cells called per time step
    "transformer": {"embed", "qkv", "proj", "up", "down"},  # sequence rows, LayerNorm, tied embedding head
    "attention": {"embed", "head"},  # nn.MultiheadAttention's time-major projections: autograd
    "functional_embedding": {"table"},  # padding_idx lookups tied to a head; unbatched convs: autograd
}


@pytest.mark.parametrize("kind", sorted(FROM_FACTORS))
def test_clipped_sum_equals_a_per_sample_autograd_loop(kind):
    model = build(kind)
    x, y = site_batches(kind, sizes=(7,))[0]
    layout = Layout.from_model(model, x)
    plan = ClipPlan.verify(model, layout, x)
    assert set(plan.from_factors) == FROM_FACTORS[kind]
    bound = float(per_sample_loop(model, x, y, 1.0)[0].median())  # some samples clipped, some not
    result, norms = clipped_local_step(model, layout, plan, per_sample_cross_entropy, x, y, bound)
    loop_norms, loop_clipped = per_sample_loop(model, x, y, bound)
    assert float(((norms - loop_norms).abs() / loop_norms).max()) <= TOLERANCE
    assert bool((norms > bound * 1.001).any()) and bool((norms < bound * 0.999).any())
    assert set(result.grads) == set(loop_clipped)
    for name, expected in loop_clipped.items():
        assert relative(result.grads[name], expected) <= TOLERANCE, name


@pytest.mark.parametrize(
    "kind,strategy",
    [("mlp", "dsgd"), ("mlp", "dad"), ("mlp", "auto"), ("mlp", "edad"), ("cnn", "dad"),
     ("transformer", "auto"), ("gru", "rankdad:64"), ("mlp", "powersgd:16")],
)
def test_every_strategy_carries_the_clipped_sum(kind, strategy):
    """Sites clip, the strategy runs unchanged; the update is Σ_s Σ_i c_i g_i / N (low-rank
    strategies at full rank, where they are exact)."""
    name, _, rank = strategy.partition(":")
    options = {"rank": int(rank)} if rank else {}
    if name == "rankdad":
        options["raw_input"] = "low_rank"
    if name == "powersgd":
        options.update(start_iter=0, use_error_feedback=False)
    chosen = make_strategy(name, **options)
    model = build(kind)
    batches = site_batches(kind, sizes=(5, 1, 3))
    layout = Layout.from_model(model, batches[0][0])
    plan = ClipPlan.verify(model, layout, batches[0][0])
    locals_, expected, total = [], {}, 0
    for x, y in batches:
        locals_.append(clipped_local_step(model, layout, plan, per_sample_cross_entropy, x, y, MAX_GRAD_NORM)[0])
        for key, value in per_sample_loop(model, x, y, MAX_GRAD_NORM)[1].items():
            expected[key] = expected.get(key, 0) + value
        total += len(y)
    sites = [chosen.site(layout, model) for _ in batches]
    messages, _ = exchange(sites, chosen.server(layout, model), locals_, step=0)
    update = chosen.decode(layout, messages, model)
    for key, value in expected.items():
        assert relative(update[key], value / total) <= 1e-4 if name in ("rankdad", "powersgd") else TOLERANCE, key


@pytest.mark.parametrize("workload_name", ["breast-cancer-mlp", "digits-cnn"])
def test_norms_equal_opacus(workload_name):
    """Opacus's per-sample gradients (where its layers apply: it ignores a conv's
    reflect padding, which the zoo's ConvNet has) give the same norms."""
    opacus = pytest.importorskip("opacus")
    workload = load_workload(workload_name)
    train = workload.training_data()
    x, y = train.inputs[:6], train.targets[:6]
    model = workload.build_model()
    layout = Layout.from_model(model, workload.example())
    plan = ClipPlan.verify(model, layout, workload.example())
    _, norms = clipped_local_step(model, layout, plan, workload.loss, x, y, MAX_GRAD_NORM)
    wrapped = opacus.GradSampleModule(model, loss_reduction="sum")
    workload.loss(wrapped(x), y).sum().backward()
    theirs = torch.sqrt(sum(p.grad_sample.reshape(len(y), -1).pow(2).sum(dim=1) for p in wrapped.parameters()))
    assert float(((norms - theirs).abs() / theirs).max()) <= TOLERANCE


def test_batchnorm_is_refused_naming_the_module_and_the_replacement():
    model = build("norm")
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm1d\).*nn.GroupNorm"):
        refuse_sample_mixing(model)
    x = site_batches("norm", sizes=(4,))[0][0]
    with pytest.raises(ValueError, match="'bn'"):
        ClipPlan.verify(model, Layout.from_model(model, x), x)


def test_a_layer_whose_rows_lead_with_time_gets_autograd_norms():
    """Time-major calls (T, B, ·) cannot be split by sample from the leading dimension:
    the verification sends them to autograd, and the clipped sum stays exact."""

    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):  # x: (B, T, 4), run time-major
            return self.head(torch.tanh(self.cell(x.transpose(0, 1))).mean(dim=0))

    torch.manual_seed(0)
    model, x, y = TimeMajor(), torch.randn(3, 3, 4), torch.tensor([0, 2, 1])  # T == B: the leading dim looks right
    layout = Layout.from_model(model, x)
    plan = ClipPlan.verify(model, layout, x)
    assert plan.from_factors == ("head",) and dict(plan.reasons)["cell"].startswith("its factor norms differ")
    result, _ = clipped_local_step(model, layout, plan, per_sample_cross_entropy, x, y, MAX_GRAD_NORM)
    for name, expected in per_sample_loop(model, x, y, MAX_GRAD_NORM)[1].items():
        assert relative(result.grads[name], expected) <= TOLERANCE, name
