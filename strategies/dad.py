"""``dadfl.strategies.dad`` — dAD: distributed auto-differentiation — sites send activations and deltas, not gradients.

For a captured layer the site's summed-loss gradient is Δ_sᵀ A_s (per group), so the
site sends A_s (n_s × k per group) and Δ_s (n_s × m per group) instead of the m × k
gradient. The server stacks every site's rows: Δᵀ A / N over the union of the batches
is exactly the mean-loss gradient, and Σ_rows Δ / N is the bias gradient (the bias
needs no extra bytes). Uncovered parameters and buffers travel dense.

Cost per captured layer (floats; G groups, k in and m out per group, rows n_s per site,
N = Σ n_s; rows are samples × time steps × output positions):
    up   = n_s·G·(k + m)                                          per site
    down = G·k·m (+ G·m bias)   with downlink="dense"
         = N·G·(k + m)          with downlink="factors" (each replica forms ΔᵀA/N)
Cheaper than dSGD on the way up exactly when n_s·(k + m) < k·m (+ m).

An embedding table (V × d) looked up n_s times sends the ids and their Δ rows,
n_s·(1 + d) numbers (ids as int32) instead of V·d; a table tied to a Linear head sends
both the head's rows and the lookups, and the decoded gradient is their sum.

Reveals: each site's activations and deltas to the server (and, with factor downlink,
to every other site). Activations of the first layer are the raw input, so a layer
reading the raw input travels dense unless ``raw_input="activations"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .base import (
    LayerwiseServer,
    GRAD_ROLE,
    IDS_ROLE,
    ROWS_ROLE,
    LocalResult,
    Payload,
    Stateless,
    Strategy,
    dense_upload,
    group_rows,
    may_share,
    sum_in_order,
    tensor_key,
    check_raw_input,
    layer_gradient,
)
from .payload import Factors
from .checks import Unit
from .layout import CapturedLayer, Layout

DOWNLINKS = ("dense", "factors", "smaller")


def dense_nbytes(layer: CapturedLayer) -> int:
    """Bytes of one layer's dense gradient, bias included, in the weight's dtype (whatever
    dtype its factors travel in)."""
    return (layer.weight_numel + (layer.out_features if layer.bias else 0)) * layer.weight_dtype.itemsize


class FactorSite(Stateless):
    """Site half: per layer, its factors where ``sends_factors`` says so, else its gradient."""

    def __init__(self, layout: Layout, sends_factors: Callable[[CapturedLayer, Factors], bool]):
        self.layout = layout
        self.sends_factors = sends_factors

    def begin(self, local: LocalResult, step: int) -> Payload:
        tensors = dense_upload(local, self.layout.uncovered, self.layout.buffers)
        for layer in self.layout.layers:
            factors = local.factors.get(layer.module)
            if factors is not None and self.sends_factors(layer, factors):
                tensors.update(factors.tensors(layer.module))
            else:
                tensors.update(dense_upload(local, layer.params, ()))  # none where no row reached it
        return Payload(step, 0, local.num_samples, tensors)

    def receive(self, message: Payload) -> None:
        return None


class FactorServer(LayerwiseServer):
    """Server half: stack factor rows, or reduce to the dense mean, per layer."""

    def __init__(self, layout: Layout, downlink: str):
        if downlink not in DOWNLINKS:
            raise ValueError(f"downlink={downlink!r} is not one of {', '.join(DOWNLINKS)}")
        self.layout = layout
        self.downlink = downlink

    def aggregate_layer(self, layer: CapturedLayer, payloads: Sequence[Payload], total: int) -> dict:
        keys = {role: tensor_key(layer.module, role) for role in ("A", "D", IDS_ROLE, ROWS_ROLE)}
        w_key = tensor_key(layer.weight, GRAD_ROLE)
        if not any(w_key in p.tensors for p in payloads):
            pooled = {}
            for role in ("A", "D"):  # (G, n_s, ·) blocks
                parts = [p.tensors[keys[role]] for p in payloads if keys[role] in p.tensors]
                if parts:
                    pooled[keys[role]] = group_rows(parts)
            for role in (IDS_ROLE, ROWS_ROLE):  # (n_s,) and (n_s, k)
                parts = [p.tensors[keys[role]] for p in payloads if keys[role] in p.tensors]
                if parts:
                    pooled[keys[role]] = torch.cat(parts)
            if pooled and self.sends_factors_down(layer, pooled):
                return pooled
        weights, biases = [], []
        for p in payloads:
            if w_key in p.tensors:
                weights.append(p.tensors[w_key])
                if layer.bias and tensor_key(layer.bias, GRAD_ROLE) in p.tensors:
                    biases.append(p.tensors[tensor_key(layer.bias, GRAD_ROLE)])
            else:
                weight, bias = layer_gradient(layer, p.tensors)
                if weight is not None:
                    weights.append(weight)
                if bias is not None:
                    biases.append(bias)
        out = {}
        if weights:  # no site's batch reached this layer: no gradient, no update
            out[w_key] = sum_in_order(weights) / total
        if biases:
            out[tensor_key(layer.bias, GRAD_ROLE)] = sum_in_order(biases) / total
        return out

    def sends_factors_down(self, layer: CapturedLayer, pooled: dict[str, torch.Tensor]) -> bool:
        if self.downlink == "smaller":
            return sum(t.numel() * t.element_size() for t in pooled.values()) < dense_nbytes(layer)
        return self.downlink == "factors"


def factor_units(layout: Layout, facts, raw_input: str) -> list:
    """What a ``FactorSite`` may send: uncovered gradients and buffers dense; each captured
    layer as A and D of ``num_samples`` × rows-per-sample rows (where ``raw_input`` allows
    it) or as its dense gradient."""
    units = facts.dense_units(layout.uncovered) + facts.buffer_units(layout.buffers)
    for layer in layout.layers:
        shares = may_share(layer, raw_input, "activations")
        forms = (facts.layer_factors(layer), facts.layer_dense(layer)) if shares else (facts.layer_dense(layer),)
        units.append(Unit(layer.module, forms))
    return units


@dataclass(frozen=True)
class DAD(Strategy):
    """Exact; up: activations and deltas; down: ``downlink`` = "dense" or "factors"."""

    downlink: str = "dense"
    raw_input: str = "dense"
    name = "dad"
    exact = True
    supports_dp = True

    def __post_init__(self) -> None:
        if self.downlink not in ("dense", "factors"):
            raise ValueError(f"dad: downlink={self.downlink!r} must be 'dense' or 'factors'")
        check_raw_input(self.raw_input)

    def sends_factors(self, layer: CapturedLayer, factors: Factors) -> bool:
        return may_share(layer, self.raw_input, "activations")

    def site(self, layout: Layout, model=None) -> FactorSite:
        return FactorSite(layout, self.sends_factors)

    def server(self, layout: Layout, model=None) -> FactorServer:
        return FactorServer(layout, self.downlink)

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model=None) -> list | None:
        return factor_units(layout, facts, self.raw_input) if phase == 0 else None
