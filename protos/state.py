"""``dadfl.protos.state`` — a replica's full state as a payload: what a joining or out-of-sync site receives.

Keys: ``model/<name>`` for every parameter and buffer, ``optim/<index>/<name>`` for every
tensor of the optimizer's per-parameter state (momentum, Adam moments and step). The
optimizer's hyperparameters come from the run config, so the state carries tensors only.
The payload's ``step`` is the next step to run.
"""

from __future__ import annotations

from typing import BinaryIO

import torch

from dadfl.replica import Replica
from dadfl.sanitize import printable
from dadfl.strategies import Payload

from .state_file import fill, read_head

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


def full_state_bytes(replica: Replica) -> int:
    """The tensor bytes of ``state_payload`` once the optimizer holds state for every parameter
    (SGD with momentum: a buffer per parameter; Adam: two moments and a step counter; any
    other optimizer counted as Adam): what a site joining after the first step must accept."""
    optimizer = replica.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if type(optimizer) is torch.optim.SGD:
        per_parameter = [p.nbytes if group["momentum"] else 0 for group in optimizer.param_groups for p in group["params"]]
    else:
        per_parameter = [2 * p.nbytes + 8 for p in params]  # 8: a counter of up to 64 bits
    return sum(t.nbytes for t in replica.model.state_dict().values()) + sum(per_parameter)


def _check_entry(replica: Replica, params: list, key: str, shape: tuple[int, ...]) -> tuple[str, int | None, str]:
    """Where a state tensor goes: ``("model", None, name)`` or ``("optim", index, name)``; a
    ValueError naming what does not fit this replica (a tensor the model lacks, a shape,
    optimizer state of a parameter it has not or of another shape)."""
    if key.startswith(MODEL_PREFIX):
        name = key[len(MODEL_PREFIX) :]
        own = replica.model.state_dict()
        if name not in own or own[name].shape != shape:
            raise ValueError(f"state tensor {printable(name)} {tuple(shape)} does not fit this model")
        return "model", None, name
    if key.startswith(OPTIM_PREFIX):
        index, _, name = key[len(OPTIM_PREFIX) :].partition("/")
        if not index.isdecimal() or int(index) >= len(params):
            raise ValueError(f"optimizer state {printable(key)} names no parameter of this model ({len(params)})")
        expected = params[int(index)].shape
        if len(shape) > 0 and shape != expected:  # per-parameter moments have its shape; counters are scalars
            raise ValueError(f"optimizer state {printable(key)} {tuple(shape)} does not fit its parameter {tuple(expected)}")
        return "optim", int(index), name
    raise ValueError(f"state payload has an unexpected tensor {printable(key)}")


def _check_complete(replica: Replica, names: set[str]) -> None:
    missing = sorted(replica.model.state_dict().keys() - names)
    if missing:
        raise ValueError(f"the state lacks {len(missing)} of this model's tensors, {printable(missing[0])} first")


def _set_optimizer_state(replica: Replica, optim_state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Replace the optimizer's state (torch keeps tensors of the parameter's dtype and device as they are)."""
    groups = replica.optimizer.state_dict()["param_groups"]
    replica.optimizer.load_state_dict({"state": optim_state, "param_groups": groups})


def load_state(replica: Replica, payload: Payload) -> None:
    """Overwrite the replica's weights and optimizer state; a ValueError naming what does not
    fit (``_check_entry``) before anything is overwritten. Optimizer state is copied into the
    replica's own tensors where it has them (a resync mid-run), so no second copy stays."""
    params = [param for group in replica.optimizer.param_groups for param in group["params"]]
    placed = [(_check_entry(replica, params, key, tuple(tensor.shape)), tensor) for key, tensor in payload.tensors.items()]
    model_state = {name: tensor for (kind, _, name), tensor in placed if kind == "model"}
    _check_complete(replica, set(model_state))
    replica.model.load_state_dict(model_state, strict=True)
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for (kind, index, name), tensor in placed:
        if kind == "optim":
            own = replica.optimizer.state[params[index]].get(name)
            fits = torch.is_tensor(own) and own.shape == tensor.shape and own.dtype == tensor.dtype
            optim_state.setdefault(index, {})[name] = own.copy_(tensor) if fits else tensor.clone()
    _set_optimizer_state(replica, optim_state)


def fill_state(replica: Replica, file: BinaryIO, magic: bytes, extra_prefix: str) -> dict[str, torch.Tensor]:
    """Read a verified state file (``state_file.verify``) into the replica, a chunk at a time:
    weights into the model's own tensors, optimizer state into its own where it has them
    (else into new ones); checked as ``load_state`` before anything is overwritten. Tensors
    under ``extra_prefix`` are returned (new tensors on the replica's device), prefix removed."""
    _, header, _ = read_head(file, magic)
    file.seek(0)
    params = [param for group in replica.optimizer.param_groups for param in group["params"]]
    own = replica.model.state_dict()
    placed = {meta.key: None if meta.key.startswith(extra_prefix) else _check_entry(replica, params, meta.key, tuple(meta.shape))
              for meta in header.tensors}
    _check_complete(replica, {entry[2] for entry in placed.values() if entry and entry[0] == "model"})
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    extra: dict[str, torch.Tensor] = {}

    def target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if placed[key] is None:
            extra[key[len(extra_prefix) :]] = torch.empty(shape, dtype=dtype, device=replica.device)
            return extra[key[len(extra_prefix) :]]
        kind, index, name = placed[key]
        if kind == "model":
            return own[name]
        current = replica.optimizer.state[params[index]].get(name)
        fits = torch.is_tensor(current) and tuple(current.shape) == shape and current.dtype == dtype and current.is_contiguous()
        device = params[index].device if shape else torch.device("cpu")  # torch keeps scalar counters on the CPU
        optim_state.setdefault(index, {})[name] = current if fits else torch.empty(shape, dtype=dtype, device=device)
        return optim_state[index][name]

    with torch.no_grad():
        fill(file, target, magic)
    _set_optimizer_state(replica, optim_state)
    return extra
