"""Models the other tests do not hold: a user's hook under edAD, reentrant activation
checkpointing, a parameter no batch gives a gradient under the rank-r strategies."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dadfl.strategies import apply_update, local_step, make_strategy, probe_layout, reference_update, step_update
from dadfl.strategies.step import exchange

from tests.helpers.model_zoo import per_sample_cross_entropy


def batches(sizes=(5, 3), features=12, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)) for n in sizes]


def hooked_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    model[0].register_forward_hook(lambda module, args, output: 1.5 * output + 0.1)
    return model


def test_edad_refuses_a_model_whose_linear_has_a_user_hook():
    model = hooked_sequential()
    layout = probe_layout(model, batches()[0][0])
    with pytest.raises(ValueError, match=r"edad: module '0' has a forward or backward hook.*use 'dad' or 'auto'"):
        make_strategy("edad").site(layout, model)
    with pytest.raises(ValueError, match="hook"):
        make_strategy("edad").server(layout, model)
    # dad sees the altered output's deltas: exact on the same model.
    reference = reference_update(model, per_sample_cross_entropy, batches())
    update = step_update(make_strategy("dad", raw_input="activations"), model, per_sample_cross_entropy, batches())
    for name, value in reference.items():
        assert torch.allclose(update[name], value, atol=1e-6), name


class Checkpointed(nn.Module):
    """A Linear, then a checkpointed Linear + ReLU segment, then the head."""

    def __init__(self, use_reentrant: bool, first: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.use_reentrant, self.first_layer = use_reentrant, first
        self.first, self.middle, self.head = nn.Linear(12, 12), nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x):
        x = self.first(x) if self.first_layer else x
        x = checkpoint(lambda t: torch.relu(self.middle(t)), x, use_reentrant=self.use_reentrant)
        return self.head(x)


@pytest.mark.parametrize("first", [True, False], ids=["inputs-need-grad", "raw-input"])
def test_reentrant_checkpointing_gets_a_dadfl_error_naming_the_fix(first):
    model = Checkpointed(use_reentrant=True, first=first)
    with pytest.raises(ValueError, match=r"use_reentrant=True.*pass use_reentrant=False"):
        probe_layout(model, batches()[0][0])


@pytest.mark.parametrize("name", ["dad", "rankdad"])
def test_non_reentrant_checkpointing_is_captured_and_exact(name):
    model = Checkpointed(use_reentrant=False)
    layout = probe_layout(model, batches()[0][0])
    assert {layer.module for layer in layout.layers} == {"first", "middle", "head"}
    reference = reference_update(model, per_sample_cross_entropy, batches())
    options = {"raw_input": "activations"} if name == "dad" else {"rank": 16}
    update = step_update(make_strategy(name, **options), model, per_sample_cross_entropy, batches())
    for key, value in reference.items():
        assert torch.allclose(update[key], value, atol=1e-5), key


class Unused(nn.Module):
    """A used MLP beside a Linear and a raw matrix Parameter that the forward never touches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.head = nn.Linear(12, 16), nn.Linear(16, 5)
        self.spare = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return self.head(torch.relu(self.first(x)))


@pytest.mark.parametrize("name,options", [
    ("rankdad", {"rank": 2}), ("rankdad", {"rank": 2, "error_feedback": False}),
    ("powersgd", {"rank": 2, "start_iter": 0, "min_compression_rate": 0}), ("dad", {}),
])
def test_a_parameter_without_gradient_gets_no_update(name, options):
    """Three steps with momentum and weight decay: the unused weights never move, and never
    travel, while the used ones train."""
    model = Unused()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    layout = probe_layout(model, batches()[0][0])
    strategy = make_strategy(name, **options)
    sites = [strategy.site(layout, model) for _ in range(2)]
    server = strategy.server(layout, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    unused = {"spare.weight", "spare.bias", "table"}
    for step in range(3):
        locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y) for x, y in batches(seed=step)]
        messages, _ = exchange(sites, server, locals_, step)
        assert not any(key.startswith(("spare", "table")) for m in messages for key in m.tensors)
        update = strategy.decode(layout, messages, model)
        assert unused.isdisjoint(update) and {"first.weight", "head.weight"} <= set(update)
        apply_update(model, optimizer, update)
    params = dict(model.named_parameters())
    for key in unused:
        assert torch.equal(params[key], before[key]), key
    assert not torch.equal(params["first.weight"], before["first.weight"])
