"""Canonical arithmetic: every replica computes the step's update and the optimizer step so
that machines with other float kernels (vector units, BLAS builds, GPUs) get the same bits.

Replicas decode the same messages and apply them with the same optimizer, but a product or
a fused multiply-add computed by another kernel rounds differently, and one differing bit
changes the weights fingerprint. Two rules remove almost all of it:

- **Decode in float64.** ``float64_payload`` widens every floating tensor of a message
  before the strategy decodes it: a product of two float32 numbers is exact in float64, and
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

import torch

from .base import Payload


def float64_payload(payload: Payload) -> Payload:
    """``payload`` with every floating tensor widened to float64 (exactly); integers as they are."""
    tensors = {k: t.to(torch.float64) if t.is_floating_point() else t for k, t in payload.tensors.items()}
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)


def canonical_step(optimizer: torch.optim.Optimizer, grads: dict[torch.Tensor, torch.Tensor]) -> None:
    """One step of ``optimizer`` with ``grads`` (parameter → its update, float64 keeps the
    decode's precision; parameters without one are left alone, as torch leaves those whose
    ``.grad`` is None), computed in float64 and rounded once (module docstring)."""
    groups = optimizer.param_groups
    if type(optimizer) is torch.optim.SGD:
        step = _sgd
    elif type(optimizer) is torch.optim.Adam and not any(g["amsgrad"] or g.get("decoupled_weight_decay") for g in groups):
        step = _adam
    else:
        for param, grad in grads.items():
            param.grad = grad.to(param.dtype).clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    with torch.no_grad():
        for group in groups:
            for param in group["params"]:
                if param in grads:
                    step(param, grads[param].to(torch.float64), optimizer.state[param], group)


def _round_into(target: torch.Tensor, value: torch.Tensor) -> None:
    target.copy_(value.to(target.dtype))


def _sgd(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.SGD: g = ∇ + λw; b = μb + (1−τ)g (b = g at first); w −= η(g + μb if Nesterov else b)."""
    weight = param.to(torch.float64)
    if group["maximize"]:
        grad = -grad
    if group["weight_decay"]:
        grad = grad + weight * group["weight_decay"]
    momentum = group["momentum"]
    if momentum:
        buffer = state.get("momentum_buffer")
        if buffer is None:
            buffer = grad
            state["momentum_buffer"] = torch.empty_like(param)
        else:
            buffer = buffer.to(torch.float64) * momentum + grad * (1 - group["dampening"])
        _round_into(state["momentum_buffer"], buffer)
        grad = grad + buffer * momentum if group["nesterov"] else buffer
    _round_into(param, weight - grad * group["lr"])


def _adam(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.Adam: m = β₁m + (1−β₁)g; v = β₂v + (1−β₂)g²; w −= η/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)."""
    weight = param.to(torch.float64)
    if group["maximize"]:
        grad = -grad
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # torch's: a float32 scalar on the CPU
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    step = float(state["step"])
    if group["weight_decay"]:
        grad = grad + weight * group["weight_decay"]
    beta1, beta2 = group["betas"]
    exp_avg = state["exp_avg"].to(torch.float64) * beta1 + grad * (1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].to(torch.float64) * beta2 + grad * grad * (1 - beta2)
    _round_into(state["exp_avg"], exp_avg)
    _round_into(state["exp_avg_sq"], exp_avg_sq)
    denom = exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step) + group["eps"]
    _round_into(param, weight - exp_avg / denom * (group["lr"] / (1 - beta1**step)))
