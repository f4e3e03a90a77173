"""A replica's full state as a payload: what a joining or out-of-sync site receives.

Keys: ``model/<name>`` for every parameter and buffer, ``optim/<index>/<name>`` for every
tensor of the optimizer's per-parameter state (momentum, Adam moments and step). The
optimizer's hyperparameters come from the run config, so the state carries tensors only.
The payload's ``step`` is the next step to run.
"""

from __future__ import annotations

import torch

from dadfl.replica import Replica
from dadfl.sanitize import printable
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
    """Overwrite the replica's weights and optimizer state; a ValueError naming what does not
    fit (a tensor the model lacks or misses, a shape, optimizer state of a parameter it has not
    or of another shape) before anything is overwritten."""
    own = replica.model.state_dict()
    params = [param for group in replica.optimizer.param_groups for param in group["params"]]
    model_state, optim_state = {}, {}
    for key, tensor in payload.tensors.items():
        if key.startswith(MODEL_PREFIX):
            name = key[len(MODEL_PREFIX) :]
            if name not in own or own[name].shape != tensor.shape:
                raise ValueError(f"state tensor {printable(name)} {tuple(tensor.shape)} does not fit this model")
            model_state[name] = tensor
        elif key.startswith(OPTIM_PREFIX):
            index, _, name = key[len(OPTIM_PREFIX) :].partition("/")
            if not index.isdecimal() or int(index) >= len(params):
                raise ValueError(f"optimizer state {printable(key)} names no parameter of this model ({len(params)})")
            shape = params[int(index)].shape
            if tensor.dim() > 0 and tensor.shape != shape:  # per-parameter moments have its shape; counters are scalars
                raise ValueError(f"optimizer state {printable(key)} {tuple(tensor.shape)} does not fit its parameter {tuple(shape)}")
            optim_state.setdefault(int(index), {})[name] = tensor.clone()
        else:
            raise ValueError(f"state payload has an unexpected tensor {printable(key)}")
    missing = sorted(own.keys() - model_state.keys())
    if missing:
        raise ValueError(f"the state lacks {len(missing)} of this model's tensors, {printable(missing[0])} first")
    replica.model.load_state_dict(model_state, strict=True)
    groups = replica.optimizer.state_dict()["param_groups"]
    replica.optimizer.load_state_dict({"state": optim_state, "param_groups": groups})
