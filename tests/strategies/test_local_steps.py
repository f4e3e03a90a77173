"""FedAvg and DiLoCo: a round of local steps, the sample-weighted mean delta, the outer step."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dadfl.client.site import INLINE_BYTES
from dadfl.privacy.accounting import DPConfig
from dadfl.replica import OptimizerConfig, Replica
from dadfl.simulation import SimulationConfig, StrategySpec
from dadfl.strategies import Layout, make_strategy, probe_layout, reference_update
from dadfl.strategies import DSGD, local_step
from dadfl.strategies.base import tensor_key
from dadfl.strategies.dsgd import DenseSite
from dadfl.workloads import load_workload

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config

SIZES = (6, 2, 4)


def round_batches(rounds: int, local_steps: int):
    """Per site, the batches of every local step: site s's step i reads batch seed i."""
    per_step = [site_batches("mlp", sizes=SIZES, seed=i) for i in range(rounds * local_steps)]
    return [[per_step[i][s] for i in range(rounds * local_steps)] for s in range(len(SIZES))]


def run_rounds(strategy, model, batches, rounds, halves=None, inner=None):
    """``rounds`` rounds on one shared model (a half puts the weights back after training);
    returns the halves and the messages."""
    layout = probe_layout(model, batches[0][0][0])
    halves = halves or [strategy.site(layout, model) for _ in batches]
    server = strategy.server(layout, model)
    outer = strategy.outer_optimizer(model.parameters())
    messages = []
    for r in range(rounds):
        uploads = []
        for half, site in zip(halves, batches):
            before = copy.deepcopy(model.state_dict())
            local = half.train_round(model, per_sample_cross_entropy, list(strategy_round(strategy, site, r)), inner)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "training a round leaves the weights as they were"
            uploads.append(half.begin(local, r))
        message = server.aggregate(uploads)
        messages.append(message)
        update = strategy.decode(layout, [message], model)
        for name, param in model.named_parameters():
            param.grad = update[name].clone()
        outer.step()
    return halves, messages


def strategy_round(strategy, site, r):
    return (site[i] for i in strategy.batch_indices(r))


def test_one_local_step_of_plain_sgd_is_a_dsgd_step():
    model, reference_model = build("mlp"), build("mlp")
    batches = round_batches(1, 1)
    run_rounds(make_strategy("fedavg", local_steps=1), model, batches, 1, inner=lambda p: torch.optim.SGD(p, lr=0.5))
    gradient = reference_update(reference_model, per_sample_cross_entropy, [site[0] for site in batches])
    with torch.no_grad():
        for name, param in reference_model.named_parameters():
            param -= 0.5 * gradient[name]
    for (name, got), expected in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5), name


def test_a_fedavg_round_is_the_sample_weighted_mean_of_the_sites_local_models():
    steps = 3
    model = build("mlp")
    start = copy.deepcopy(model)
    batches = round_batches(1, steps)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    run_rounds(make_strategy("fedavg", local_steps=steps), model, batches, 1, inner=sgd)
    local_models = []
    for site in batches:  # each site alone: a plain training loop from the start weights
        local = copy.deepcopy(start)
        optimizer = sgd(local.parameters())
        for inputs, targets in site:
            optimizer.zero_grad()
            per_sample_cross_entropy(local(inputs), targets).mean().backward()
            optimizer.step()
        local_models.append(local)
    total = sum(len(site[i][1]) for site in batches for i in range(steps))
    for name, param in model.named_parameters():
        expected = sum(dict(m.named_parameters())[name] * sum(len(y) for _, y in site) for m, site in zip(local_models, batches)) / total
        assert torch.allclose(param, expected, atol=1e-6), name
    assert not torch.allclose(local_models[0][1].weight, local_models[1][1].weight), "the sites' models differ before averaging"


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(12, 5), nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x.flatten(1))


def test_a_parameter_no_batch_reaches_gets_no_delta():
    model = WithUnused()
    batches = round_batches(1, 2)
    strategy = make_strategy("fedavg", local_steps=2)
    layout = probe_layout(model, batches[0][0][0])
    half = strategy.site(layout, model)
    local = half.train_round(model, per_sample_cross_entropy, batches[0][:2], lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1))
    upload = half.begin(local, 0)
    assert tensor_key("used.weight", "grad") in upload.tensors
    assert not any(key.startswith("unused.") for key in upload.tensors)


def test_diloco_keeps_its_inner_adamw_moments_and_a_restored_half_continues_bit_identically():
    strategy = make_strategy("diloco", local_steps=2, inner_lr=0.01)
    batches = round_batches(4, 2)
    model = build("mlp")
    halves, _ = run_rounds(strategy, model, [site[:4] for site in batches], 2)
    states = [half.state_dict() for half in halves]
    assert all(any(key.endswith("/exp_avg") for key in state) for state in states)

    copy_model, fresh_model = copy.deepcopy(model), copy.deepcopy(model)
    layout = probe_layout(copy_model, batches[0][0][0])
    restored = [strategy.site(layout, copy_model) for _ in SIZES]
    for half, state in zip(restored, states):
        half.load_state_dict(state)
    rest = [[None] * 4 + site[4:] for site in batches]  # rounds 2 and 3 read batches 4..7
    # The outer Nesterov momentum is the replica's optimizer state (checkpointed with it): start
    # both continuations from a fresh outer optimizer so only the halves' state is compared.
    _, expected = run_rounds_from(strategy, model, rest, halves)
    _, resumed = run_rounds_from(strategy, copy_model, rest, restored)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for a, b in zip(expected, resumed) for k in a.tensors)
    _, fresh = run_rounds_from(strategy, fresh_model, rest, None)
    assert not all(torch.equal(a.tensors[k], b.tensors[k]) for a, b in zip(expected, fresh) for k in a.tensors), \
        "without the moments the rounds differ, so the comparison above can fail"

    with pytest.raises(ValueError, match="shape"):
        wrong = {key: value for key, value in states[0].items()}
        first = next(key for key in wrong if key.endswith("/exp_avg"))
        wrong[first] = torch.zeros(7)
        strategy.site(layout, copy_model).load_state_dict(wrong)
    with pytest.raises(ValueError, match="unknown keys"):
        strategy.site(layout, copy_model).load_state_dict({"errors/x": torch.zeros(1)})
    assert make_strategy("fedavg").site(layout, copy_model).state_dict() == {}


def run_rounds_from(strategy, model, batches, halves):
    """Rounds 2 and 3 of ``batches`` (whose first four entries are not read)."""
    layout = probe_layout(model, batches[0][4][0])
    halves = halves or [strategy.site(layout, model) for _ in batches]
    server, outer = strategy.server(layout, model), strategy.outer_optimizer(model.parameters())
    messages = []
    for r in (2, 3):
        uploads = [half.begin(half.train_round(model, per_sample_cross_entropy, list(strategy_round(strategy, site, r)), None), r)
                   for half, site in zip(halves, batches)]
        messages.append(server.aggregate(uploads))
        update = strategy.decode(layout, [messages[-1]], model)
        for name, param in model.named_parameters():
            param.grad = update[name].clone()
        outer.step()
    return halves, messages


def test_options_are_bounded_and_dp_is_refused_with_the_reason():
    for bad in ({"local_steps": 0}, {"local_steps": 10_001}, {"server_lr": 0.0}):
        with pytest.raises(ValueError, match="fedavg"):
            make_strategy("fedavg", **bad)
    with pytest.raises(ValueError, match="outer_momentum"):
        make_strategy("diloco", outer_momentum=1.0)
    for name in ("fedavg", "diloco"):
        with pytest.raises(ValueError, match="several local steps"):
            SimulationConfig(strategies=[StrategySpec(name=name)], dp=DPConfig(noise_multiplier=1.0))


@pytest.mark.network
@pytest.mark.parametrize("strategy, off_loop", [({"name": "dsgd"}, False), ({"name": "fedavg", "options": {"local_steps": 4}}, True)])
def test_a_site_runs_a_step_off_its_event_loop_by_the_steps_work_not_the_model_size(tmp_path, monkeypatch, strategy, off_loop):
    """A model under INLINE_BYTES steps on the event loop with one batch a step, but in a
    worker thread when its H local steps make a round's work INLINE_BYTES or more."""
    hidden = 320  # 507 kB of parameters, times 4 local steps is over INLINE_BYTES
    model_bytes = 4 * sum(p.numel() for p in load_workload("digits-mlp", hidden=hidden).build_model().parameters())
    assert model_bytes < INLINE_BYTES <= 4 * model_bytes
    on_loop = []
    work = Replica.work

    def work_where(replica, batch_at, step):
        try:
            on_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:  # no event loop runs in this thread
            on_loop.append(False)
        return work(replica, batch_at, step)

    monkeypatch.setattr(Replica, "work", work_where)
    config = server_config(tmp_path, workload={"spec": "digits-mlp", "options": {"hidden": hidden}}, strategy=strategy,
                           training={"steps": 2, "batch_size": 16, "eval_every": 2, "checkpoint_every": 0})
    server = ServerThread(config).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, 2)).start() for i in range(2)]
    summaries = [site.join(60) for site in sites]
    server.join(60)
    assert len({s.fingerprint for s in summaries}) == 1 and summaries[0].steps == 2
    assert on_loop == [not off_loop] * 4


class WholeRoundSite(DenseSite):
    """A user strategy's half (no local-steps class): one forward/backward on all the step's
    batches at once, through the ``train_round`` hook."""

    def train_round(self, model, loss_fn, batches, run_optimizer):
        inputs, targets = zip(*batches)
        return local_step(model, self.layout, loss_fn, torch.cat(inputs), torch.cat(targets))


@dataclass(frozen=True)
class WholeRound(DSGD):
    def site(self, layout: Layout, model=None) -> WholeRoundSite:
        return WholeRoundSite(layout)

    def batch_indices(self, step: int) -> range:
        return range(2 * step, 2 * step + 2)


def test_a_site_half_with_train_round_consumes_the_steps_batches_itself():
    """``Replica.work`` hands any half with ``train_round`` the step's batches, whatever its class."""
    workload = load_workload("digits-mlp", hidden=16)
    data = workload.training_data()
    batch_at = lambda i: (data.inputs[8 * i : 8 * i + 8], data.targets[8 * i : 8 * i + 8])  # noqa: E731
    replica = Replica(workload, WholeRound(), OptimizerConfig())
    local = replica.work(batch_at, 1)
    expected = local_step(replica.model, replica.layout, workload.loss, data.inputs[16:32], data.targets[16:32])
    assert local.num_samples == 16 and local.grads.keys() == expected.grads.keys()
    assert all(torch.equal(local.grads[name], expected.grads[name]) for name in expected.grads)
