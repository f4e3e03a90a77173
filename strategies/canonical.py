"""``dadfl.strategies.canonical`` — canonical arithmetic: every replica computes the step's update and the optimizer step so
that machines with other float kernels (vector units, BLAS builds, GPUs) get the same bits.

Replicas decode the same messages and apply them with the same optimizer, but a product or
a fused multiply-add computed by another kernel rounds differently, and one differing bit
changes the weights fingerprint. Two rules remove almost all of it:

- **Decode in float64.** ``float64_payload`` widens every floating tensor of a message
  that a decode computes with (factors, scales) before the strategy decodes it; dense
  gradients and buffers, which every decode passes through untouched, stay as they came
  and are widened a chunk at a time by the step (exactly: the same bits), so a dense
  message of a 100M-parameter model costs no 800 MB float64 copy. A product of two float32 numbers is exact in float64, and
  what another summation order changes (about k·2⁻⁵³ relative for k terms) lies far below
  float32's 2⁻²⁴, so it survives the final rounding only when the exact value lies within
  that distance of a float32 rounding boundary (rarely; the block repair of
  ``fingerprint.py`` mends those).
- **Step in float64, one operation at a time.** ``canonical_step`` applies SGD (momentum,
  Nesterov, dampening, weight decay) and Adam from the float32 weights and optimizer state
  widened to float64, with separate multiplications, additions, divisions and square roots,
  each correctly rounded on every IEEE machine (torch's own optimizers use fused
  multiply-adds that vector and scalar kernels round differently); weights and state are
  rounded once to their dtype at the end. Its state keys and dtypes are torch's
  (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints, state
  payloads and resumes are unchanged. Any other optimizer steps as torch does (correct, not
  canonical).

Devices: the update is decoded and applied on the replica's device (a CUDA site decodes in
float64 on its GPU): the elementwise step is then bit-identical to a CPU's, and the decode
differs from it only in float64 summation order, which the rounding hides as above.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from .base import BUFFER_ROLE, GRAD_ROLE, Payload, split_key

CHUNK_ELEMENTS = 1 << 14  # 128 KB of float64 per temporary
PASSED_THROUGH = (GRAD_ROLE, BUFFER_ROLE)  # roles every decode hands to the step as they came


def float64_payload(payload: Payload) -> Payload:
    """``payload`` with every floating tensor a decode computes with widened to float64
    (exactly); dense gradients, buffers and integers as they are (module docstring)."""
    tensors = {k: t.to(torch.float64) if t.is_floating_point() and split_key(k)[1] not in PASSED_THROUGH else t
               for k, t in payload.tensors.items()}
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)


def canonical_step(
    optimizer: torch.optim.Optimizer, grads: Mapping[torch.Tensor, torch.Tensor] | Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One step of ``optimizer`` with ``grads`` (parameter → its update: float64 keeps the
    decode's precision, a dense float32 one is widened a chunk at a time; parameters without
    one are left alone, as torch leaves those whose ``.grad`` is None), computed in float64
    and rounded once (module docstring). ``grads`` may be ``(parameter, update)`` pairs made
    one at a time: each parameter steps as its update comes (the step of one parameter never
    reads another's, so the bits are those of the whole dict) and the update can be freed."""
    pairs = grads.items() if isinstance(grads, Mapping) else grads
    groups = optimizer.param_groups
    if type(optimizer) is torch.optim.SGD:
        step = _sgd
    elif type(optimizer) is torch.optim.Adam and not any(g["amsgrad"] or g.get("decoupled_weight_decay") for g in groups):
        step = _adam
    else:
        for param, grad in pairs:
            param.grad = grad.to(param.dtype).clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    group_of = {param: group for group in groups for param in group["params"]}
    with torch.no_grad():
        for param, grad in pairs:
            group = group_of.get(param)
            if group is not None:  # a parameter the optimizer does not hold is left alone, as torch's would
                step(param, grad, optimizer.state[param], group)


def _chunks(*tensors: torch.Tensor):
    """Matching slices of ``CHUNK_ELEMENTS`` of the tensors' flat views (the whole tensors when
    one is not contiguous): float64 temporaries the size of a chunk stay in cache, where whole
    parameters' would be fresh allocations each (docs/benchmarks-runtime.md has the step's cost).
    Tensors of one chunk or less are that chunk as they are: the same elementwise operations,
    without a view and a slice per tensor (most of a small parameter's step)."""
    if tensors[0].numel() <= CHUNK_ELEMENTS or not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flats = [t.view(-1) for t in tensors]
    for start in range(0, flats[0].numel(), CHUNK_ELEMENTS):
        yield tuple(f[start : start + CHUNK_ELEMENTS] for f in flats)


def _round_into(target: torch.Tensor, value: torch.Tensor) -> None:
    target.copy_(value.to(target.dtype))


def _sgd(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.SGD: g = ∇ + λw; b = μb + (1−τ)g (b = g at first); w −= η(g + μb if Nesterov else b)."""
    momentum = group["momentum"]
    first = momentum and state.get("momentum_buffer") is None
    if first:
        state["momentum_buffer"] = torch.empty_like(param)
    buffer = state["momentum_buffer"] if momentum else param  # param: a stand-in, never read without momentum
    for w32, g, b32 in _chunks(param, grad.reshape(param.shape), buffer):
        weight, g = w32.to(torch.float64), g.to(torch.float64)
        if group["maximize"]:
            g = -g
        if group["weight_decay"]:
            g = g + weight * group["weight_decay"]
        if momentum:
            b = g if first else b32.to(torch.float64) * momentum + g * (1 - group["dampening"])
            _round_into(b32, b)
            g = g + b * momentum if group["nesterov"] else b
        _round_into(w32, weight - g * group["lr"])


def _adam(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.Adam: m = β₁m + (1−β₁)g; v = β₂v + (1−β₂)g²; w −= η/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)."""
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # torch's: a float32 scalar on the CPU
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = group["betas"]
    correction2, step_size = math.sqrt(1 - beta2**step), group["lr"] / (1 - beta1**step)
    for w32, g, m32, v32 in _chunks(param, grad.reshape(param.shape), state["exp_avg"], state["exp_avg_sq"]):
        weight, g = w32.to(torch.float64), g.to(torch.float64)
        if group["maximize"]:
            g = -g
        if group["weight_decay"]:
            g = g + weight * group["weight_decay"]
        m = m32.to(torch.float64) * beta1 + g * (1 - beta1)
        v = v32.to(torch.float64) * beta2 + g * g * (1 - beta2)
        _round_into(m32, m)
        _round_into(v32, v)
        _round_into(w32, weight - m / (v.sqrt() / correction2 + group["eps"]) * step_size)
