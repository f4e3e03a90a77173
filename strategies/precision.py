"""``dadfl.strategies.precision`` — mixed precision: the autocast a site's forward/backward runs under, the tolerance it implies,
and fp16's loss scaling.

``precision`` is ``"fp32"`` (no autocast), ``"bf16"`` or ``"fp16"``: ``torch.autocast`` on the
replica's device around the forward (the backward follows the forward's dtypes). Weights,
optimizer state and the applied update stay in the weights' dtype (float32 master weights).

**Capture under autocast.** A linear or conv call under autocast rounds its input x and its
weight W to the compute dtype c and multiplies those; its output y and its Δ = ∂L/∂y are in c.
The captured A is x rounded to c — exactly the values the kernel multiplied — and A, Δ travel
in c (half of fp32's bytes). Every replica decodes Σ ΔᵀA in the weight's dtype
(``base.layer_gradient``); autograd's own weight gradient is the same product rounded to c
(and, for a weight called T times, summed in c). The two differ by that rounding, a relative
error of about eps(c) — ``tolerance(c)`` allows a few of it, which is what the probe accepts
and what the exactness tests hold every strategy to. Lookups (``F.embedding``) are not
autocast: their rows stay in the weight's dtype.

**fp16 loss scaling.** fp16 has 5 exponent bits: small deltas deep in a network underflow to
zero. The summed loss is multiplied by a power of two S before the backward, so every Δ and
gradient is S times larger; after it, gradients and captured Δ are divided by S, which is
exact for a power of two (short of fp16's subnormals, smaller than its tolerance allows for).
A backward whose gradients or deltas overflow (Inf/NaN) is redone at S/2. Every step starts
from ``FP16_LOSS_SCALE``, so the scaler carries no state between steps (nothing to
checkpoint); each retry costs one more backward (the graph is kept for it), so lower it
if most steps overflow at it, raise it if deep layers' deltas vanish. bf16 has float32's
exponent range and needs no scaling.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error allowed between a gradient rebuilt from captured factors and autograd's, in
# units of the compute dtype's eps: autograd rounds its product to the compute dtype (≤ eps/2
# per element), and a weight called several times sums such rounded products.
EPS_MULTIPLE = 4
FP32_RTOL = 1e-5  # float32 and float64: summation-order noise only
FP16_LOSS_SCALE = 2.0**12  # the summed loss's first scale each step (module doc)
FP16_RETRIES = 24  # halvings before a step gives up: 2^12 / 2^24 is far below any useful scale


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return precision


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision``; None for fp32 (no autocast)."""
    return PRECISIONS[check_precision(precision)]


def autocast(precision: str, device: torch.device | str) -> ContextManager:
    """The context a forward runs in at ``precision`` on ``device``: autocast, or nothing for fp32."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device``'s type right now; None when it is off."""
    kind = device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a gradient computed in ``dtype`` against autograd's (module doc)."""
    if dtype in (torch.float32, torch.float64) or not dtype.is_floating_point:
        return FP32_RTOL
    return max(FP32_RTOL, EPS_MULTIPLE * torch.finfo(dtype).eps)


def scaled_backward(loss: torch.Tensor, params: Iterable[torch.Tensor], deltas: Callable[[], Iterable[torch.Tensor | None]]) -> float:
    """Backpropagate ``loss`` × S for the first S = ``FP16_LOSS_SCALE`` / 2ʲ under which every
    parameter's gradient and every captured delta (``deltas()``, read after each backward) is
    finite; return S. Gradients and deltas are left scaled by S; the caller divides them."""
    params = [p for p in params if p.requires_grad]
    scale = FP16_LOSS_SCALE
    for _ in range(FP16_RETRIES):
        (loss * scale).backward(retain_graph=True)  # kept for a retry at a smaller scale
        tensors = [p.grad for p in params] + list(deltas())
        if all(bool(torch.isfinite(t).all()) for t in tensors if t is not None):
            return scale
        for p in params:
            p.grad = None
        scale /= 2
    raise FloatingPointError(
        f"fp16: the backward overflowed at every loss scale down to {scale * 2:g}: the loss or the model's "
        "activations exceed fp16's range; train this workload with precision='bf16' or 'fp32'"
    )
