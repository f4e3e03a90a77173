"""``dadfl.strategies.probe`` — the probe step: which captured weights reproduce their autograd gradient exactly.

One forward on the example input records every linear, conv and embedding call on a
parameter (``capture.CallRecorder``); one backward of a fixed pseudo-random cotangent
(seeded, drawn on the CPU, so every replica and device draws the same numbers) gives
both the calls' Δ and autograd's own gradients. A weight is captured only if the
gradient rebuilt from its calls equals autograd's:

    ‖rebuilt − autograd‖ ≤ rtol · max(‖autograd‖, ‖|D|ᵀ|A| + onehotᵀ|rows|‖)

(rtol ``precision.tolerance`` of the dtype the calls compute in: 1e-5 in fp32/fp64, a few
eps under autocast; the second term is the size the rounding of the sums scales with, so a
gradient that cancels to ~0 — an attention key bias — is not refused for its noise). Under
autocast (``precision``) the probe's forward runs in it, as every step's will. Its bias is
captured when every linear/conv call adds it and it verifies too.
Anything else travels dense, and the log says why, one line per parameter: a weight
also used outside those calls (``F.linear(z, W.t())``), a call the model's forward
alters in a way capture cannot see, mixed dtypes outside autocast.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Sequence

import torch
from torch import nn

from .base import layer_gradient
from .capture import LOOKUP, Call, CallRecorder, as_args, call_forms, layer_factors
from .layout import CapturedLayer, Layout
from .payload import Factors
from .precision import autocast, tolerance

log = logging.getLogger("dadfl.capture")

PROBE_SEED = 0
# torch.utils.checkpoint(..., use_reentrant=True) hides the segment from autograd.grad (an
# error), or, when no input of the segment needs a gradient, from autograd altogether (a warning).
REENTRANT_NO_GRAD = "None of the inputs have requires_grad=True"
REENTRANT_CHECKPOINT = (
    "the model calls torch.utils.checkpoint with use_reentrant=True, which cannot give the "
    "parameters inside the checkpointed segment their own gradients (torch.autograd.grad refuses it, "
    "and with inputs that need no gradient they get none at all); pass use_reentrant=False to "
    "torch.utils.checkpoint.checkpoint (PyTorch's recommended form), which dadfl supports"
)


def probe_layers(
    model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], precision: str = "fp32"
) -> tuple[list[CapturedLayer], dict[str, str]]:
    """The verified captured layers (model parameter order) and why each refused weight is dense;
    the forward runs at ``precision`` (``precision.py``)."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    args = as_args(example_inputs)
    recorder = CallRecorder({id(p): (name, p) for name, p in trainable}, args)
    was_training = model.training
    model.eval()  # no running-statistics update, no dropout
    try:
        with torch.enable_grad():
            with recorder, autocast(precision, args[0].device), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outputs = model(*args)
            for warning in caught:
                if REENTRANT_NO_GRAD in str(warning.message):
                    raise ValueError(REENTRANT_CHECKPOINT)  # its parameters would get no gradient
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            ends = [t for t in _tensors(outputs) if t.is_floating_point() and t.requires_grad]
            if not ends:
                return [], {}
            generator = torch.Generator().manual_seed(PROBE_SEED)
            cotangents = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in ends]
            # Σ ⟨output, cotangent⟩ backpropagates exactly the cotangents.
            probe_loss = sum((t * c).sum() for t, c in zip(ends, cotangents))
            try:
                grads = torch.autograd.grad(probe_loss, [p for _, p in trainable], allow_unused=True)
            except RuntimeError as exc:
                if "use_reentrant" in str(exc):
                    raise ValueError(REENTRANT_CHECKPOINT) from None
                raise
    finally:
        model.train(was_training)
    autograd = {name: g for (name, _), g in zip(trainable, grads)}
    params = dict(trainable)
    layers, reasons = [], {}
    for name, _ in trainable:
        calls = recorder.calls.get(name)
        if name in recorder.refused:
            reasons[name] = recorder.refused[name]
        elif calls:
            layer, why = _candidate(name, params, calls, sorted(recorder.uses.get(name, ())), int(args[0].shape[0]))
            if layer is not None:
                layer, refused = _verify(layer, calls, autograd)
                reasons.update(refused)
                if layer is not None:
                    layers.append(layer)
            else:
                reasons[name] = why
    for name, why in reasons.items():
        log.info("parameter %r travels dense: %s", name, why)
    return layers, reasons


def probe_layout(
    model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], precision: str = "fp32"
) -> Layout:
    """Find and verify the captured layers with one probe step on ``example_inputs``, its
    forward at ``precision`` (``precision.py``: the dtype each layer's factors travel in).

    Every replica runs the same probe on the same example, so every replica finds the
    same layout (and fingerprint). The probe runs in eval mode (no running-statistics
    update, no dropout) and leaves the parameters' ``.grad`` untouched.
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    layers, reasons = probe_layers(model, example_inputs, precision)
    params = tuple(name for name, _ in trainable)
    shapes = tuple(tuple(p.shape) for _, p in trainable)
    buffers = tuple(name for name, _ in model.named_buffers())
    return Layout(tuple(layers), params, shapes, buffers, tuple(reasons.items()))


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _candidate(
    name: str, params: dict[str, torch.Tensor], calls: Sequence[Call], uses: Sequence[str], batch: int
) -> tuple[CapturedLayer | None, str]:
    """The layer the calls describe (on an example of ``batch`` samples), or None and why they cannot be one."""
    weight = params[name]
    forms = call_forms(calls)
    matmul = [f for f in forms if f != LOOKUP]
    if len(matmul) > 1 or (matmul and LOOKUP in forms and matmul != ["linear"]):
        return None, f"called as {' and '.join(forms)}: one weight, one kind of call"
    computed = {c.inputs.dtype for c in calls if c.kind != LOOKUP}
    if len(computed) > 1:
        return None, f"its calls compute in {' and '.join(sorted(map(str, computed)))}: one weight, one compute dtype"
    groups = {c.groups for c in calls}
    if len(groups) > 1:
        return None, f"conv calls with different groups {sorted(groups)}"
    (group_count,) = groups
    if weight.dim() == 2:  # linear (out × in) or embedding table (V × d): m × k
        out_per_group, in_per_group = weight.shape[0], weight.shape[1]
    else:
        out_per_group, in_per_group = weight.shape[0] // group_count, weight[0].numel()
    biases = {c.bias for c in calls if c.kind != LOOKUP}
    # Σ D is the bias gradient only if every linear/conv call added the same bias, sliced as its weight.
    bias = None
    if matmul and len(biases) == 1 and all(c.bias_block == c.row_block for c in calls if c.kind != LOOKUP):
        bias = next(iter(biases))
    return (
        CapturedLayer(
            module=name.removesuffix(".weight"),
            weight=name,
            bias=bias if bias != name else None,
            groups=group_count,
            in_per_group=in_per_group,
            out_per_group=out_per_group,
            weight_shape=tuple(weight.shape),
            raw_input=any(c.raw for c in calls),
            forms=forms,
            uses=tuple(uses),
            rows_per_sample=_per_sample([c for c in calls if c.kind != LOOKUP], batch),
            lookups_per_sample=_per_sample([c for c in calls if c.kind == LOOKUP], batch),
            weight_dtype=weight.dtype,
            compute_dtype=computed.pop() if computed else weight.dtype,
        ),
        "",
    )


def _per_sample(calls: Sequence[Call], batch: int) -> int | None:
    """The input rows (or ids) of ``calls`` per sample; None without calls or when not a whole number."""
    count = sum(c.inputs.shape[0] for c in calls)
    return count // batch if calls and count % batch == 0 else None


def _verify(layer: CapturedLayer, calls: Sequence[Call], autograd: dict) -> tuple[CapturedLayer | None, dict[str, str]]:
    """The layer if its rebuilt weight gradient equals autograd's (without its bias if only
    the bias fails), else None; and why each refused parameter was refused."""
    factors = layer_factors(layer, calls)
    if factors is None:
        return None, {layer.weight: "its calls' outputs do not reach the model's output"}
    weight, bias = layer_gradient(layer, factors.tensors(layer.module))
    magnitude = Factors(*(t.abs() if t is not None and t.is_floating_point() else t for t in
                          (factors.A, factors.D, factors.ids, factors.rows)))
    weight_scale, bias_scale = layer_gradient(layer, magnitude.tensors(layer.module))
    rtol = tolerance(layer.compute_dtype)
    error = _relative_error(weight, autograd[layer.weight], weight_scale)
    if error > rtol:
        elsewhere = f"also used by {', '.join(layer.uses)}" if layer.uses else "its calls are altered in a way capture cannot see"
        return None, {layer.weight: (
            f"the gradient rebuilt from its linear/conv/embedding calls differs from autograd's "
            f"(relative error {error:.2g} > {rtol:g}): {elsewhere}"
        )}
    if bias is not None:
        error = _relative_error(bias, autograd[layer.bias], bias_scale)
        if error > rtol:
            return replace(layer, bias=None), {layer.bias: (
                f"the bias rebuilt from its calls' deltas differs from autograd's (relative error "
                f"{error:.2g} > {rtol:g}): it is also used outside those calls"
            )}
    return layer, {}


def _relative_error(rebuilt: torch.Tensor, truth: torch.Tensor | None, scale: torch.Tensor) -> float:
    truth = torch.zeros_like(rebuilt) if truth is None else truth
    floor = torch.maximum(truth.norm(), scale.norm())
    return float((rebuilt - truth).norm() / floor) if floor > 0 else float((rebuilt - truth).norm())

