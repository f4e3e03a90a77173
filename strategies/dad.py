"""dAD: distributed auto-differentiation — sites send activations and deltas, not gradients.

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

Reveals: each site's activations and deltas to the server (and, with factor downlink,
to every other site). Activations of the first layer are the raw input, so a layer
reading the raw input travels dense unless ``raw_input="activations"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .base import (
    LayerwiseServer,
    GRAD_ROLE,
    LocalResult,
    Payload,
    Stateless,
    Strategy,
    dense_upload,
    group_rows,
    may_share,
    sum_in_order,
    tensor_key,
    weight_from_factors,
    bias_from_deltas,
    check_raw_input,
)
from .checks import Unit
from .layout import CapturedLayer, Layout

DOWNLINKS = ("dense", "factors", "smaller")


def dense_cost(layer: CapturedLayer) -> int:
    """Floats of one layer's dense gradient, bias included."""
    return layer.weight_numel + (layer.out_features if layer.bias else 0)


def factor_cost(layer: CapturedLayer, rows: int) -> int:
    """Floats of one layer's activation and delta rows."""
    return rows * (layer.in_features + layer.out_features)


class FactorSite(Stateless):
    """Site half: per layer, activations and deltas where ``sends_factors`` says so."""

    def __init__(self, layout: Layout, sends_factors: Callable[[CapturedLayer, int], bool]):
        self.layout = layout
        self.sends_factors = sends_factors

    def begin(self, local: LocalResult, step: int) -> Payload:
        tensors = dense_upload(local, self.layout.uncovered, self.layout.buffers)
        for layer in self.layout.layers:
            factors = local.factors.get(layer.module)
            if factors is not None and self.sends_factors(layer, factors.A.shape[1]):
                tensors[tensor_key(layer.module, "A")] = factors.A
                tensors[tensor_key(layer.module, "D")] = factors.D
            else:
                tensors[tensor_key(layer.weight, GRAD_ROLE)] = local.grads[layer.weight]
                if layer.bias:
                    tensors[tensor_key(layer.bias, GRAD_ROLE)] = local.grads[layer.bias]
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
        a_key, d_key = tensor_key(layer.module, "A"), tensor_key(layer.module, "D")
        if all(a_key in p.tensors for p in payloads) and self.sends_factors_down(layer, total):
            return {
                a_key: group_rows([p.tensors[a_key] for p in payloads]),
                d_key: group_rows([p.tensors[d_key] for p in payloads]),
            }
        weights, biases = [], []
        for p in payloads:
            if a_key in p.tensors:
                weights.append(weight_from_factors(p.tensors[a_key], p.tensors[d_key], layer.weight_shape))
                biases.append(bias_from_deltas(p.tensors[d_key]))
            else:
                weights.append(p.tensors[tensor_key(layer.weight, GRAD_ROLE)])
                if layer.bias:
                    biases.append(p.tensors[tensor_key(layer.bias, GRAD_ROLE)])
        out = {tensor_key(layer.weight, GRAD_ROLE): sum_in_order(weights) / total}
        if layer.bias:
            out[tensor_key(layer.bias, GRAD_ROLE)] = sum_in_order(biases) / total
        return out

    def sends_factors_down(self, layer: CapturedLayer, total: int) -> bool:
        if self.downlink == "smaller":
            return factor_cost(layer, total) < dense_cost(layer)
        return self.downlink == "factors"


def factor_units(layout: Layout, facts, shares: Callable[[CapturedLayer], bool]) -> list:
    """What a ``FactorSite`` may send: uncovered gradients and buffers dense; each captured
    layer as A and D of ``num_samples`` × rows-per-sample rows (where ``shares`` allows
    it) or as its dense gradient."""
    units = facts.dense_units(layout.uncovered) + facts.buffer_units(layout.buffers)
    for layer in layout.layers:
        forms = (facts.layer_factors(layer), facts.layer_dense(layer)) if shares(layer) else (facts.layer_dense(layer),)
        units.append(Unit(layer.module, forms))
    return units


@dataclass(frozen=True)
class DAD(Strategy):
    """Exact; up: activations and deltas; down: ``downlink`` = "dense" or "factors"."""

    downlink: str = "dense"
    raw_input: str = "dense"
    name = "dad"

    def __post_init__(self) -> None:
        if self.downlink not in ("dense", "factors"):
            raise ValueError(f"dad: downlink={self.downlink!r} must be 'dense' or 'factors'")
        check_raw_input(self.raw_input)

    def sends_factors(self, layer: CapturedLayer, rows: int) -> bool:
        return may_share(layer, self.raw_input, "activations")

    def site(self, layout: Layout, model=None) -> FactorSite:
        return FactorSite(layout, self.sends_factors)

    def server(self, layout: Layout, model=None) -> FactorServer:
        return FactorServer(layout, self.downlink)

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model=None) -> list | None:
        shares = lambda layer: may_share(layer, self.raw_input, "activations")  # noqa: E731
        return factor_units(layout, facts, shares) if phase == 0 else None
