"""A replica's full state as a payload: it loads bit-exactly, and what does not fit is refused
before anything is overwritten."""

from __future__ import annotations

import pytest
import torch

from dadfl.protos.codec import encode_header
from dadfl.protos.state import full_state_bytes, load_state, state_payload
from dadfl.replica import OptimizerConfig, Replica
from dadfl.strategies import Payload, make_strategy, weights_fingerprint
from dadfl.workloads import load_workload


def replica(seed: int) -> Replica:
    torch.manual_seed(seed)
    built = Replica(load_workload("digits-mlp", hidden=16, seed=0), make_strategy("dsgd"), OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
    with torch.no_grad():
        for param in built.model.parameters():
            param.add_(torch.randn_like(param))
            param.grad = torch.randn_like(param)
    built.optimizer.step()  # momentum buffers exist
    return built


def test_a_full_state_loads_exactly_and_what_does_not_fit_is_refused_untouched():
    source, target = replica(1), replica(2)
    state = state_payload(source, 5)
    before = weights_fingerprint(target.model)
    momentum = next(key for key in state.tensors if key.startswith("optim/0/"))
    broken = {
        "a model tensor of another shape": ({"model/0.weight": torch.zeros(3)}, r"'0\.weight' \(3,\) does not fit this model"),
        "a missing model tensor": ({key: value for key, value in state.tensors.items() if key != "model/2.bias"}, r"lacks 1 of this model's tensors, '2\.bias' first"),
        "momentum of another shape": ({**state.tensors, momentum: torch.zeros(2, 2)}, r"does not fit its parameter"),
        "a parameter index it has not": ({**state.tensors, "optim/99/momentum_buffer": torch.zeros(1)}, r"names no parameter of this model \(6\)"),
    }
    for case, (tensors, reason) in broken.items():
        with pytest.raises(ValueError, match=reason):
            load_state(target, Payload(5, 0, 0, tensors))
        assert weights_fingerprint(target.model) == before, f"{case}: nothing is overwritten"
    load_state(target, state)
    assert weights_fingerprint(target.model) == weights_fingerprint(source.model)
    for index, entries in source.optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            assert torch.equal(target.optimizer.state_dict()["state"][index][name], value)


@pytest.mark.parametrize("optimizer", [OptimizerConfig(name="sgd", lr=0.1), OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), OptimizerConfig(name="adam", lr=0.01)], ids=["sgd", "momentum", "adam"])
def test_the_full_state_bound_holds_the_state_a_step_leaves(optimizer):
    """Counted before the first step (no optimizer state yet), it covers the state after it."""
    built = Replica(load_workload("digits-mlp", hidden=16, seed=0), make_strategy("dsgd"), optimizer)
    bound = full_state_bytes(built)
    empty = encode_header(state_payload(built, 0))[0].total_bytes
    for param in built.model.parameters():
        param.grad = torch.ones_like(param)
    built.optimizer.step()
    after = encode_header(state_payload(built, 1))[0].total_bytes
    assert empty <= after <= bound <= after + 8 * len(list(built.model.parameters()))
    assert (after > empty) == (optimizer.name == "adam" or optimizer.momentum > 0)
