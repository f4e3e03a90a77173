"""A replica's full state as a payload: what a joining or out-of-sync site receives.

Keys: ``model/<name>`` for every parameter and buffer, ``optim/<index>/<name>`` for every
tensor of the optimizer's per-parameter state (momentum, Adam moments and step). The
optimizer's hyperparameters come from the run config, so the state carries tensors only.
The payload's ``step`` is the next step to run.
"""

from __future__ import annotations

import torch

from dadfl.replica import Replica
from dadfl.strategies import Payload

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


def state_payload(replica: Replica, next_step: int) -> Payload:
    tensors = {MODEL_PREFIX + name: tensor.detach() for name, tensor in replica.model.state_dict().items()}
    for index, entries in replica.optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {name!r} of parameter {index} is {type(value).__name__}, not a tensor")
            tensors[f"{OPTIM_PREFIX}{index}/{name}"] = value
    return Payload(next_step, 0, 0, tensors)


def load_state(replica: Replica, payload: Payload) -> None:
    """Overwrite the replica's weights and optimizer state; errors name what did not fit."""
    model_state, optim_state = {}, {}
    for key, tensor in payload.tensors.items():
        if key.startswith(MODEL_PREFIX):
            model_state[key[len(MODEL_PREFIX) :]] = tensor
        elif key.startswith(OPTIM_PREFIX):
            index, _, name = key[len(OPTIM_PREFIX) :].partition("/")
            optim_state.setdefault(int(index), {})[name] = tensor.clone()
        else:
            raise ValueError(f"state payload has an unexpected tensor {key!r}")
    own = replica.model.state_dict()
    for name, tensor in model_state.items():
        if name not in own or own[name].shape != tensor.shape:
            raise ValueError(f"state tensor {name!r} {tuple(tensor.shape)} does not fit this model")
    replica.model.load_state_dict(model_state, strict=True)
    groups = replica.optimizer.state_dict()["param_groups"]
    replica.optimizer.load_state_dict({"state": optim_state, "param_groups": groups})
