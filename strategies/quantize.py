"""``dadfl.strategies.quantize`` — integer factors: a low-rank strategy's P and Q sent as b-bit integers, one scale per column.

A factor F (…, L, r) travels as codes and a scale per column (per rank component):

    s = max over the L rows of |F| / (2^(b−1) − 1)        (…, 1, r), F's dtype
    C = round(F / s)                                        (…, L, r), int8 or int16

and every receiver decodes C·s (a column that is all zero has s = 0 and decodes to 0).
Bytes per factor: L·r·b/8 + 4·r instead of 4·L·r, a quarter at 8 bits; the error per
entry is at most s/2, 1/254 of its column's largest entry at 8 bits.

**Only with error feedback.** Rounding is lossy, so a strategy offers it only where a
memory carries what was lost: the sender computes its memory against C·s, what the
receivers decode (``Quantized.value``), so this step's rounding error travels in a
later step, as what rank r drops does. Per column, because a factor's columns are rank
components of very different sizes: one scale for the whole tensor would round the
small ones to zero.

Payload layout: the codes under the factor's own key (role ``P`` or ``Q``, an integer
dtype) and the scale under the same name with role ``P_scale`` or ``Q_scale``;
:func:`unpack` turns both back into the float factor before any other code reads it, so
aggregation, decoding and the contribution checks see floats. The scale is an ordinary
floating tensor to the upload checks (finite, its shape); the codes are integers, any
value of their dtype is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Payload, split_key, tensor_key
from .checks import Spec

FULL_PRECISION = 32  # factors travel as floats of the model's dtype
CODE_DTYPES = {8: torch.int8, 16: torch.int16}
FACTOR_BITS = (*CODE_DTYPES, FULL_PRECISION)
QUANTIZED_ROLES = ("P", "Q")
SCALE_SUFFIX = "_scale"
SCALE_ROLES = frozenset(role + SCALE_SUFFIX for role in QUANTIZED_ROLES)


def scale_key(codes_key: str) -> str:
    """The payload key of a factor's scale: its name, its role + ``_scale``."""
    name, role = split_key(codes_key)
    return tensor_key(name, role + SCALE_SUFFIX)


def check_factor_bits(owner: str, bits: int, error_feedback: bool) -> None:
    """``bits`` must be one the codes come in, and below full precision needs error feedback."""
    if bits not in FACTOR_BITS:
        raise ValueError(f"{owner}: factor_bits={bits} must be one of {', '.join(map(str, FACTOR_BITS))}")
    if bits < FULL_PRECISION and not error_feedback:
        raise ValueError(
            f"{owner}: factor_bits={bits} needs error feedback (nothing else carries what the rounding drops); "
            f"turn error feedback on or use factor_bits={FULL_PRECISION}"
        )


@dataclass(frozen=True)
class Quantized:
    """A factor as integer codes (…, L, r) and a scale per column (…, 1, r)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def value(self) -> torch.Tensor:
        """What every receiver decodes: codes · scale, in the scale's dtype."""
        return self.codes.to(self.scale.dtype) * self.scale


def quantize(factor: torch.Tensor, bits: int) -> Quantized:
    """``factor`` (…, L, r) as ``bits``-bit codes with a scale per column (see the module's text)."""
    levels = 2 ** (bits - 1) - 1
    scale = factor.abs().amax(dim=-2, keepdim=True) / levels
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(factor / divisor).clamp_(-levels, levels).to(CODE_DTYPES[bits])
    return Quantized(codes, scale)


def factor_entries(key: str, factor: torch.Tensor | Quantized, bits: int = FULL_PRECISION) -> dict[str, torch.Tensor]:
    """Payload entries of one factor under ``key`` (role P or Q): its codes and its scale, a
    float factor coded to ``bits`` first; at full precision the float factor itself."""
    if isinstance(factor, torch.Tensor):
        if bits == FULL_PRECISION:
            return {key: factor}
        factor = quantize(factor, bits)
    return {key: factor.codes, scale_key(key): factor.scale}


def unpack(payload: Payload) -> Payload:
    """``payload`` with every integer factor and its scale replaced by the float factor they
    decode to; a payload without integer factors is returned as it is. Raises ValueError for
    codes without their scale (or a scale without codes) or a scale of the wrong shape."""
    scales = {key for key in payload.tensors if split_key(key)[1] in SCALE_ROLES}
    coded = {key for key, t in payload.tensors.items()
             if split_key(key)[1] in QUANTIZED_ROLES and not t.is_floating_point()}
    if not scales and not coded:
        return payload
    tensors = {}
    for key, tensor in payload.tensors.items():
        if key in scales:
            continue
        if key in coded:
            scale = payload.tensors.get(scale_key(key))
            if scale is None:
                raise ValueError(f"tensor {key!r}: integer codes without their scale {scale_key(key)!r}")
            expected = (*tensor.shape[:-2], 1, tensor.shape[-1]) if tensor.dim() >= 2 else None
            if expected is None or tuple(scale.shape) != expected or not scale.is_floating_point():
                raise ValueError(f"tensor {key!r}: its scale has shape {tuple(scale.shape)} and dtype {scale.dtype}, "
                                 f"expected a floating {expected}")
            tensor = Quantized(tensor, scale).value()
        tensors[key] = tensor
    orphans = sorted(scales - {scale_key(codes) for codes in coded})
    if orphans:
        raise ValueError(f"tensor {orphans[0]!r}: a scale without integer codes")
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)


def quantized_specs(tensors: dict[str, Spec], bits: int) -> dict[str, Spec]:
    """Upload specs with every P and Q spec (…, L, RANK) replaced by its codes' and its
    scale's; unchanged at full precision."""
    if bits == FULL_PRECISION:
        return tensors
    out = {}
    for key, spec in tensors.items():
        if split_key(key)[1] in QUANTIZED_ROLES:
            out[key] = Spec(spec.shape, CODE_DTYPES[bits])
            out[scale_key(key)] = Spec((*spec.shape[:-2], 1, spec.shape[-1]), spec.dtype)
        else:
            out[key] = spec
    return out
