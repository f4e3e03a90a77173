"""Differential privacy: per-sample clipping read off the factors, against a per-sample autograd loop."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dadfl.strategies import Layout, make_strategy, probe_layout
from dadfl.strategies.capture import per_sample_losses
from dadfl.strategies.sample_clipping import ClipPlan, clipped_local_step, refuse_sample_mixing
from dadfl.strategies.step import exchange
from dadfl.workloads import load_workload
from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches

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

# Each kind with the uncovered parameters whose norms must come from their per-sample calls.
FROM_CALLS = {
    "mlp": set(),
    "cnn": set(),
    "gru": set(),
    "transformer": {"position", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"},  # nothing left for autograd
    "attention": set(),
    "functional_embedding": {"unused.weight", "unused.bias"},  # never called: zero
}


@pytest.mark.parametrize("kind", sorted(FROM_FACTORS))
def test_clipped_sum_equals_a_per_sample_autograd_loop(kind):
    model = build(kind)
    x, y = site_batches(kind, sizes=(7,))[0]
    layout = probe_layout(model, x)
    plan = ClipPlan.verify(model, layout, x)
    assert set(plan.from_factors) == FROM_FACTORS[kind]
    assert set(plan.from_calls) == FROM_CALLS[kind]
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
    layout = probe_layout(model, batches[0][0])
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
    layout = probe_layout(model, workload.example())
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
        ClipPlan.verify(model, probe_layout(model, x), x)


def test_a_buffer_learnt_from_the_batch_is_refused():
    class RunningMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(12, 5)
            self.register_buffer("mean", torch.zeros(12))

        def forward(self, x):
            if self.training:
                self.mean.mul_(0.9).add_(0.1 * x.mean(dim=0))
            return self.head(x - self.mean)

    model = RunningMean()
    x = site_batches("mlp", sizes=(4,))[0][0]
    with pytest.raises(ValueError, match="buffer 'mean' changes in a training forward"):
        ClipPlan.verify(model, probe_layout(model, x), x)
    assert torch.equal(model.mean, torch.zeros(12))  # the check leaves the model as it was


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
    layout = probe_layout(model, x)
    plan = ClipPlan.verify(model, layout, x)
    assert plan.from_factors == ("head",) and dict(plan.reasons)["cell"].startswith("its factor norms differ")
    result, _ = clipped_local_step(model, layout, plan, per_sample_cross_entropy, x, y, MAX_GRAD_NORM)
    for name, expected in per_sample_loop(model, x, y, MAX_GRAD_NORM)[1].items():
        assert relative(result.grads[name], expected) <= TOLERANCE, name


class Gain(torch.autograd.Function):
    """x ⊙ w by hand: a use of w that no call shows."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(dim=tuple(range(grad.dim() - 1)))


class ScaledPositions(nn.Module):
    """Learned positions added batch-first and LayerNorm, plus the parameters clipping must
    leave to autograd: a LayerNorm weight also read by a multiplication, positions added
    time-major (the rows of an addition not led by the batch), and a gain used only in
    training through an ``autograd.Function`` (unused on the eval-mode verification)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(6, 4), nn.Linear(4, 3)
        self.position, self.late = nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(4))
        self.norm, self.shared = nn.LayerNorm(4), nn.LayerNorm(4)
        self.gain = nn.Parameter(torch.randn(4))

    def forward(self, ids):  # (B, T) with T == B: the time-major addition's leading dim looks right
        x = self.norm(self.embed(ids) + self.position[: ids.shape[1]])
        x = self.shared(x) * self.shared.weight
        x = (x.transpose(0, 1) + self.late).transpose(0, 1)
        if self.training:
            x = Gain.apply(x, self.gain)
        return self.head(torch.tanh(x).mean(dim=1))


def test_parameters_read_otherwise_or_time_major_get_autograd_norms():
    torch.manual_seed(0)
    model, x, y = ScaledPositions(), torch.randint(0, 6, (4, 4)), torch.tensor([0, 2, 1, 1])
    layout = probe_layout(model, x)
    plan = ClipPlan.verify(model, layout, x)
    assert set(plan.from_calls) == {"position", "norm.weight", "norm.bias", "shared.bias", "gain"}
    reasons = dict(plan.reasons)
    assert reasons["shared.weight"].startswith("it is also read by")
    assert reasons["late"].startswith("its call norms differ")
    result, norms = clipped_local_step(model, layout, plan, per_sample_cross_entropy, x, y, MAX_GRAD_NORM)
    loop_norms, loop_clipped = per_sample_loop(model, x, y, MAX_GRAD_NORM)
    assert float(((norms - loop_norms).abs() / loop_norms).max()) <= TOLERANCE
    for name, expected in loop_clipped.items():
        assert relative(result.grads[name], expected) <= TOLERANCE, name


# ----------------------------------------------------------------- sampling, noise, accounting

from pydantic import ValidationError  # noqa: E402

from dadfl.metrics import MetricsWriter, read_metrics  # noqa: E402
from dadfl.privacy.accounting import DPConfig, PrivacyBudget, check_dp_strategy, epsilon  # noqa: E402
from dadfl.privacy.coordinator import CoordinatorNoise  # noqa: E402
from dadfl.simulation import SimulationConfig, StrategySpec, simulate  # noqa: E402
from dadfl.workloads import partition  # noqa: E402
from dadfl.workloads.batches import poisson_positions  # noqa: E402


def test_poisson_sampling_is_a_pure_function_of_seed_and_step():
    first = poisson_positions(1000, 0.05, seed=3, step=7)
    assert torch.equal(first, poisson_positions(1000, 0.05, seed=3, step=7))
    assert not torch.equal(first, poisson_positions(1000, 0.05, seed=3, step=8))
    sizes = torch.tensor([len(poisson_positions(1000, 0.05, seed=3, step=t)) for t in range(200)], dtype=torch.float64)
    assert abs(float(sizes.mean()) - 50) < 2 and float(sizes.std()) > 3  # Binomial(1000, 0.05): mean 50, std 6.9
    assert len(poisson_positions(5, 1e-6, seed=0, step=0)) == 0  # an empty draw is allowed


@pytest.mark.parametrize(
    "section,match",
    [
        ({"max_grad_norm": 1.0}, "set noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "finite"),
        ({"noise_multiplier": -1.0}, "greater than 0"),
        ({"target_epsilon": float("inf")}, "finite"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "less than 1"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0}, "greater than 0"),
        ({"noise_multiplier": 1.0, "accountant": "moments"}, "rdp"),
        ({"noise_multiplier": 1.0, "clip": 1.0}, "Extra inputs"),
    ],
)
def test_hostile_dp_sections_are_refused(section, match):
    with pytest.raises(ValidationError, match=match):
        DPConfig(**section)


def test_low_rank_strategies_are_refused_with_dp_and_say_why():
    with pytest.raises(ValueError, match="rankdad.*no ε would hold.*dsgd, dad, auto, edad"):
        check_dp_strategy("rankdad")
    with pytest.raises(ValidationError, match="powersgd"):
        SimulationConfig(strategies=[StrategySpec(name="powersgd")], dp={"noise_multiplier": 1.0})


def dp_run(tmp_path, strategy: str, steps: int = 30, **dp):
    config = SimulationConfig(
        workload="breast-cancer-mlp", sites=3, batch_size=16, steps=steps, eval_every=10,
        strategies=[StrategySpec(name=strategy)], dp=dp,
    )
    path = tmp_path / f"{strategy}-{len(list(tmp_path.iterdir()))}.jsonl"
    with MetricsWriter(path) as metrics:
        summary = simulate(config, config.strategies[0], metrics)
    return config, summary, list(read_metrics(path))


def test_epsilon_is_the_accountants_own_value(tmp_path):
    opacus = pytest.importorskip("opacus")
    config, summary, records = dp_run(tmp_path, "dsgd", noise_multiplier=1.3, max_grad_norm=0.7)
    train = load_workload(config.workload).training_data()
    sizes = [len(index) for index in partition(config.sites, len(train), config.partition, labels=None, alpha=config.alpha, seed=config.seed)]
    q = max(min(1.0, config.batch_size / n) for n in sizes)
    theirs = opacus.accountants.RDPAccountant()
    for _ in range(config.steps):
        theirs.step(noise_multiplier=1.3, sample_rate=q)
    assert summary["dp_epsilon"] == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-12)
    assert summary["dp_sample_rate"] == q and summary["dp_noise_multiplier"] == 1.3
    assert records[-1]["dp_epsilon"] == summary["dp_epsilon"]
    assert [r["step"] for r in records if "dp_epsilon" in r] == [9, 19, 29]
    assert len({r["samples"] for r in records}) > 3  # Poisson batches vary in size


def test_target_epsilon_calibrates_sigma_and_stops_when_sigma_is_given(tmp_path):
    _, summary, _ = dp_run(tmp_path, "dad", target_epsilon=2.0)
    assert 1.9 < summary["dp_epsilon"] <= 2.0 and summary["steps"] == 30
    _, stopped, records = dp_run(tmp_path, "dad", steps=200, noise_multiplier=1.5, target_epsilon=2.0)
    budget = PrivacyBudget(1.5, stopped["dp_sample_rate"], 1e-5, 1.0, "rdp", 2.0)
    assert 10 < stopped["steps"] == len(records) < 200
    assert stopped["dp_epsilon"] <= 2.0 < budget.epsilon(stopped["steps"] + 1)


def test_every_exact_strategy_releases_the_same_noisy_model(tmp_path):
    """Same seed, same Poisson batches, same noise: the clipped sum each strategy carries is
    the same, so every replica of every strategy ends with the same weights (bit-identical
    replicas within a run are checked by the simulation at every step)."""
    results = {name: dp_run(tmp_path, name, steps=12, noise_multiplier=1.0)[2] for name in ("dsgd", "dad", "auto", "edad")}
    losses = {name: [r["train_loss"] for r in records] for name, records in results.items()}
    for name in ("dad", "auto", "edad"):
        assert losses[name] == pytest.approx(losses["dsgd"], rel=1e-4, nan_ok=True)
    assert results["dad"][0]["bytes_down"] == results["dsgd"][0]["bytes_down"]  # the same dense downlink


def test_the_coordinators_noise_has_the_stated_scale_and_a_fresh_secret_seed():
    layout = Layout((), ("w",), ((400, 250),), ())
    budget = PrivacyBudget(2.0, 0.1, 1e-5, 0.5, "rdp", None)
    # the scale on a fixed seed: a secret one would make the test fail by chance (0.2% at 3 standard errors)
    scaled = CoordinatorNoise(budget, seed=0).privatize(layout, {}, 0, expected=10.0, step=0).tensors["w:grad"]
    assert float(scaled.std()) == pytest.approx(2.0 * 0.5 / 10.0, rel=0.02) and abs(float(scaled.mean())) < 1e-3
    noise = CoordinatorNoise(budget)
    first = noise.privatize(layout, {}, 0, expected=10.0, step=0).tensors["w:grad"]
    again = CoordinatorNoise(budget)  # another secret seed: a restarted coordinator
    assert not torch.equal(again.privatize(layout, {}, 0, 10.0, 0).tensors["w:grad"], first)
    clipped = {"w": torch.ones(400, 250)}
    noisy = CoordinatorNoise(budget, seed=1).privatize(layout, clipped, 4, 10.0, 0).tensors["w:grad"]
    assert float(noisy.mean()) == pytest.approx(0.4, abs=2e-3)  # (mean · N + z) / B
    assert "generator" not in repr(noise) and "state" not in repr(noise)


def test_the_release_count_is_on_disk_before_a_release_and_never_resets(tmp_path):
    """What a restarted coordinator finds in its run folder: the count of every release made
    (checkpointed or not), fresh noise, and a refusal to start on a count it cannot trust."""
    pytest.importorskip("opacus")
    from dadfl.protos.codec import codec_id
    from dadfl.privacy.coordinator import RELEASES, RELEASES_FILE, ServerPrivacy

    model, layout = torch.nn.Linear(4, 3, bias=False), Layout((), ("weight",), ((3, 4),), ())
    config = DPConfig(noise_multiplier=1.0, max_sample_rate=0.1)

    def start(steps: int = 3) -> ServerPrivacy:
        return ServerPrivacy(config, 16, steps, model, torch.zeros(2, 4), tmp_path)

    def release(privacy: ServerPrivacy) -> torch.Tensor:
        return privacy.release(layout, {}, 0, 2, 0, codec_id("none"))[2]["weight"]

    first = start()
    assert json.loads(first.site_config()) == {
        "max_grad_norm": 1.0, "max_sample_rate": 0.1, "noise_multiplier": 1.0, "delta": 1e-5,
        "epsilon": epsilon(1.0, 0.1, 3, 1e-5), "accountant": "rdp",
    }
    update = release(first)
    assert json.loads((tmp_path / RELEASES_FILE).read_text()) == {"releases": 1}  # before the caller could send it
    restarted = start()  # no checkpoint was written: the release still counts
    assert restarted.releases == 1 and not torch.equal(release(restarted), update)  # the replay gets new noise
    release(restarted)
    assert restarted.releases == 3 and restarted.summary()["dp_epsilon"] == epsilon(1.0, 0.1, 3, 1e-5)
    assert f"above {epsilon(1.0, 0.1, 3, 1e-5):.4g}" in restarted.stop_reason()  # ε after the planned 3 steps is the ceiling
    with pytest.raises(ValueError, match="checkpoint counted 4 .* counts 3"):
        restarted.load_state_dict({RELEASES: torch.tensor(4)})
    restarted.load_state_dict({RELEASES: torch.tensor(2), "dp/noise_generator": torch.zeros(1)})  # an older checkpoint: behind the file
    assert restarted.releases == 3
    for corrupt in ("", "{\"releases\": -1}", "{\"releases\": 2.5}", "{\"releases\": true}", "[3]"):
        (tmp_path / RELEASES_FILE).write_text(corrupt)
        with pytest.raises(ValueError, match="does not hold a release count.*new run_dir"):
            start()
    (tmp_path / RELEASES_FILE).unlink()
    with pytest.raises(ValueError, match="counted 3 .* is missing"):
        start().load_state_dict({RELEASES: torch.tensor(3)})


def test_a_noise_multiplier_that_passes_the_target_in_one_step_is_refused():
    pytest.importorskip("opacus")
    with pytest.raises(ValueError, match="a single step already gives ε = 2.01, above target_epsilon 1"):
        PrivacyBudget.resolve(DPConfig(noise_multiplier=0.9, target_epsilon=1.0), sample_rate=0.05, steps=100)


def test_accountant_is_zero_before_any_step_and_grows():
    pytest.importorskip("opacus")
    assert epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    assert 0 < epsilon(1.0, 0.1, 10, 1e-5) < epsilon(1.0, 0.1, 100, 1e-5)


def test_sim_command_keeps_the_default_strategies_dp_can_run_and_reports_epsilon(tmp_path):
    from typer.testing import CliRunner

    from dadfl.cli import app

    command = ["sim", "--workload", "breast-cancer-mlp", "--steps", "3", "--sites", "2", "--dp-epsilon", "5", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    (run_dir,) = tmp_path.iterdir()
    summaries = json.loads((run_dir / "summary.json").read_text())
    assert [s["strategy"] for s in summaries] == ["dSGD", "dAD", "auto", "edAD"]  # rank-dAD, PowerSGD left out
    assert all(0 < s["dp_epsilon"] <= 5 for s in summaries) and "ε" in result.stdout
    refused = CliRunner().invoke(app, ["sim", "--strategies", "rankdad:rank=2", "--dp-epsilon", "5", "--out", str(tmp_path)])
    message = " ".join(refused.stdout.split())  # the console wraps lines
    assert refused.exit_code == 2 and "field 'dp'" in message and "cannot run with [dp]" in message
    assert "'workload'" not in message  # names the field, does not dump the configuration


def test_the_prv_accountant_is_opacus_own():
    opacus = pytest.importorskip("opacus")
    theirs = opacus.accountants.PRVAccountant()
    theirs.history = [(1.1, 0.02, 500)]
    assert epsilon(1.1, 0.02, 500, 1e-5, "prv") == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-9)
