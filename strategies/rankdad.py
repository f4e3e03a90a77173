"""rank-dAD: sites send rank-r factors of their weight gradients, computed from A and Δ.

A site's summed-loss gradient of a captured layer is G_s = Δ_sᵀ A_s per group (m × k).
Instead of G_s (dSGD) or its n_s rows of A_s and Δ_s (dAD), the site sends a rank-r
factorisation G_s ≈ P_s Q_sᵀ, P_s (m × r) in sum units, Q_s (k × r) orthonormal,
computed by structured power iteration from A_s and Δ_s without forming G_s
(``power_iteration.py``). The server concatenates the sites' factors along the rank
axis, Σ_s P_s Q_sᵀ = [P_1 … P_S][Q_1 … Q_S]ᵀ (rank ≤ S·r), or with
``reduce_on_server`` re-reduces that sum to rank r by the same power iteration; every
replica decodes Σ P Qᵀ / N (``base.decode_message``).

The bias gradient Σ_rows Δ_s is not in the low-rank factors (reading it off P_s Q_sᵀ
is a known defect of reference implementations), so each layer's bias travels dense
and exact. Layers the privacy guard keeps dense, uncovered parameters and buffers
travel dense as in dSGD.

Exact when r ≥ rank(G_s) for every site (rank(G_s) ≤ min(n_s, m, k)) and, with
re-reduction, r ≥ rank(Σ_s G_s); otherwise the best rank-r approximation as far as
``iterations`` passes find it. Components beyond min(r, m, k) do not exist: that is
the rank each site sends (r' below). ``tol`` > 0 drops components below tol·σ_max.
Warm start keeps each layer's Q across steps as the next start (site state; the
server keeps its own for re-reduction).

Cost per captured layer (floats; G groups, k in and m out per group, r' = min(r, m, k),
S sites):
    up   = G·r'·(k + m) + G·m (bias)                           per site
    down = G·S·r'·(k + m) + G·m   concatenated factors
         = G·r'·(k + m) + G·m     with reduce_on_server
Cheaper than dSGD on the way up when r'·(k + m) < k·m, whatever the batch size.

Reveals: to the server (and, through the downlink, to every site) each site's
rank-r gradient approximation and its exact bias gradient — less than the gradient
itself, but the leading singular directions of a small batch's gradient still carry
its inputs ("Deep Leakage from Gradients"). Layers reading the raw input travel as
dense gradients unless ``raw_input`` is "low_rank" or "activations"; A and Δ never
leave the site.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .base import (
    LayerwiseServer,
    GRAD_ROLE,
    LocalResult,
    Payload,
    StateDict,
    Strategy,
    check_raw_input,
    check_state_keys,
    dense_upload,
    may_share,
    sum_in_order,
    tensor_key,
    tensors_under,
    with_prefix,
)
from .layout import CapturedLayer, Layout
from .power_iteration import effective_rank, make_generator, power_iteration, reduce_sum

EFFECTIVE_RANK_RTOL = 1e-3  # describe(): components above this fraction of the largest


def low_rank_layers(layout: Layout, raw_input: str) -> list[CapturedLayer]:
    """The captured layers the privacy guard allows to travel as low-rank factors."""
    return [layer for layer in layout.layers if may_share(layer, raw_input, "low_rank")]


class _Generators:
    """One seeded generator per device, created on first use."""

    def __init__(self, seed: int):
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        if device not in self._by_device:
            self._by_device[device] = make_generator(self.seed, device)
        return self._by_device[device]

    def state_dict(self) -> StateDict:
        """Each used generator's state (uint8), keyed by its device."""
        return {str(device): generator.get_state() for device, generator in self._by_device.items()}

    def load_state_dict(self, state: StateDict) -> None:
        self._by_device = {}
        for device, rng_state in state.items():
            generator = make_generator(self.seed, device)
            generator.set_state(rng_state.to(torch.uint8).cpu())
            self._by_device[torch.device(device)] = generator


def warm_start_state(memory: dict[str, torch.Tensor], generators: _Generators) -> StateDict:
    """Warm-start Q per layer and the power iteration's generators (site and server alike)."""
    return {**with_prefix("memory", memory), **with_prefix("rng", generators.state_dict())}


def load_warm_start(owner: str, state: StateDict, generators: _Generators) -> dict[str, torch.Tensor]:
    """Restore the generators from ``state``; return its warm-start memory."""
    check_state_keys(owner, state, ("memory", "rng"))
    generators.load_state_dict(tensors_under(state, "rng"))
    return {name: tensor.clone() for name, tensor in tensors_under(state, "memory").items()}


class RankDADSite:
    """Site half: per low-rank layer P and Q of its Δᵀ A, the bias dense; the rest dense."""

    def __init__(self, layout: Layout, strategy: "RankDAD"):
        self.layout = layout
        self.options = strategy
        self.low_rank = low_rank_layers(layout, strategy.raw_input)
        names = {layer.module for layer in self.low_rank}
        self.dense_layers = [layer for layer in layout.layers if layer.module not in names]
        self.generators = _Generators(strategy.seed)
        self.memory: dict[str, torch.Tensor] = {}  # warm start: each layer's last Q

    def begin(self, local: LocalResult, step: int) -> Payload:
        tensors = dense_upload(local, self.layout.uncovered, self.layout.buffers)
        for layer in self.dense_layers:
            tensors.update(_dense_layer(local, layer))
        for layer in self.low_rank:
            factors = local.factors.get(layer.module)
            if factors is None:  # not called this step: its (zero) gradient travels dense
                tensors.update(_dense_layer(local, layer))
                continue
            result = power_iteration(
                factors.A,
                factors.D,
                self.options.rank,
                iterations=self.options.iterations,
                warm_start=self.memory.get(layer.module),
                generator=self.generators.on(factors.A.device),
                tol=self.options.tol,
            )
            if self.options.warm_start:
                self.memory[layer.module] = result.Q
            tensors[tensor_key(layer.module, "P")] = result.P
            tensors[tensor_key(layer.module, "Q")] = result.Q
            if layer.bias:
                tensors[tensor_key(layer.bias, GRAD_ROLE)] = local.grads[layer.bias]
        return Payload(step, 0, local.num_samples, tensors)

    def receive(self, message: Payload) -> None:
        return None

    def state_dict(self) -> StateDict:
        return warm_start_state(self.memory, self.generators)

    def load_state_dict(self, state: StateDict) -> None:
        self.memory = load_warm_start("rankdad site", state, self.generators)


def _dense_layer(local: LocalResult, layer: CapturedLayer) -> dict[str, torch.Tensor]:
    tensors = {tensor_key(layer.weight, GRAD_ROLE): local.grads[layer.weight]}
    if layer.bias:
        tensors[tensor_key(layer.bias, GRAD_ROLE)] = local.grads[layer.bias]
    return tensors


class RankDADServer(LayerwiseServer):
    """Server half: concatenate (or re-reduce) the sites' factors; average dense parts."""

    def __init__(self, layout: Layout, strategy: "RankDAD"):
        self.layout = layout
        self.options = strategy
        self.generators = _Generators(strategy.seed)
        self.memory: dict[str, torch.Tensor] = {}  # warm start of the re-reduction

    def state_dict(self) -> StateDict:
        return warm_start_state(self.memory, self.generators)

    def load_state_dict(self, state: StateDict) -> None:
        self.memory = load_warm_start("rankdad server", state, self.generators)

    def aggregate_layer(self, layer: CapturedLayer, payloads: Sequence[Payload], total: int) -> dict:
        p_key, q_key = tensor_key(layer.module, "P"), tensor_key(layer.module, "Q")
        out = {}
        if layer.bias:
            b_key = tensor_key(layer.bias, GRAD_ROLE)
            out[b_key] = sum_in_order([p.tensors[b_key] for p in payloads]) / total
        if all(p_key in p.tensors for p in payloads):
            Ps = [p.tensors[p_key] for p in payloads]
            Qs = [p.tensors[q_key] for p in payloads]
            if self.options.reduce_on_server and sum(P.shape[-1] for P in Ps) > self.options.rank:
                result = reduce_sum(
                    Ps,
                    Qs,
                    self.options.rank,
                    iterations=self.options.iterations,
                    warm_start=self.memory.get(layer.module),
                    generator=self.generators.on(Ps[0].device),
                    tol=self.options.tol,
                )
                if self.options.warm_start:
                    self.memory[layer.module] = result.Q
                out[p_key], out[q_key] = result.P, result.Q
            else:
                out[p_key], out[q_key] = torch.cat(Ps, dim=2), torch.cat(Qs, dim=2)
            return out
        # Some site sent this layer dense (it was not called there): sum dense.
        weights = []
        for p in payloads:
            if p_key in p.tensors:
                P, Q = p.tensors[p_key], p.tensors[q_key]
                weights.append(torch.bmm(P, Q.transpose(1, 2)).reshape(layer.weight_shape))
            else:
                weights.append(p.tensors[tensor_key(layer.weight, GRAD_ROLE)])
        out[tensor_key(layer.weight, GRAD_ROLE)] = sum_in_order(weights) / total
        return out


@dataclass(frozen=True)
class RankDAD(Strategy):
    """Rank-r factors of each site's Δᵀ A up; concatenated or re-reduced factors down."""

    rank: int = 4
    iterations: int = 2
    warm_start: bool = True
    reduce_on_server: bool = False
    tol: float = 0.0
    raw_input: str = "dense"
    seed: int = 0
    name = "rankdad"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rankdad: rank={self.rank} must be at least 1")
        if self.iterations < 1:
            raise ValueError(f"rankdad: iterations={self.iterations} must be at least 1")
        if self.tol < 0 or self.tol >= 1:
            raise ValueError(f"rankdad: tol={self.tol} must be in [0, 1) (0 keeps all r components)")
        check_raw_input(self.raw_input)

    def site(self, layout: Layout, model=None) -> RankDADSite:
        return RankDADSite(layout, self)

    def server(self, layout: Layout, model=None) -> RankDADServer:
        return RankDADServer(layout, self)

    def describe(self, layout: Layout, messages: Sequence[Payload]) -> dict[str, float]:
        """``rank/<module>``: effective rank of each factored layer's decoded update
        (components above 1e-3 of the largest), from the factors' small Gram matrices."""
        message = messages[-1]
        ranks = {}
        for layer in layout.layers:
            p_key = tensor_key(layer.module, "P")
            if p_key in message.tensors:
                P, Q = message.tensors[p_key], message.tensors[tensor_key(layer.module, "Q")]
                ranks[f"rank/{layer.module}"] = float(effective_rank(P, Q, EFFECTIVE_RANK_RTOL))
        return ranks
