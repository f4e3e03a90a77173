"""``dadfl.strategies.rankdad`` — rank-dAD: sites send rank-r factors of their weight gradients, computed from A and Δ,
with error feedback at the sites and on the server's re-reduction.

A site's summed-loss gradient of a captured layer is Δ_sᵀ A_s per group (m × k). Instead
of it (dSGD) or its n_s rows of A_s and Δ_s (dAD), the site sends a rank-r factorisation
computed by structured power iteration from A_s and Δ_s (``power_iteration.py``). One
step, one round trip, per compressed matrix:

    site s:    M_s = Δ_sᵀ [A_s 1] / n_s + e_s             (mean units, e_s: site memory,
                                                          the bias as one more column)
               P̃_s Q_sᵀ ≈ M_s at rank r                    ``iterations`` passes from last Q̂
               e_s ← M_s − P̃_s Q_sᵀ                        (what its own factors missed)
               up: n_s·P̃_s (m × r), Q_s (k × r)
    server:    X = Σ_s (n_s P̃_s) Q_sᵀ / N + E              (E: server memory)
               P̂ Q̂ᵀ ≈ X at rank r;  E ← X − P̂ Q̂ᵀ           (what the re-reduction dropped)
               down: N·P̂, Q̂                                (``reduce_on_server``, the default)
    replicas:  update = (N·P̂) Q̂ᵀ / N                        (``decode``, one shared function)

Sending n_s·P̃_s keeps the n_s/N weights: every replica's Σ P Qᵀ / N is the weighted
mean of the sites' approximations. The memory update needs M_s dense (m × k per matrix,
local to the site), so the site forms it once, from autograd's gradient (the layout's probe
checked that it equals Δ_sᵀ A_s), and runs the passes on it: 4·m·k·r' flops per pass,
where applying M_s v = Δ_sᵀ(A_s v)/n_s + e_s v takes 2·(n·(k + m) + m·k)·r' and the
residual then needs Δ_sᵀ A_s all the same. The server forms X once the same way. Without
error feedback nothing is dense and the passes never form Δ_sᵀ A_s. With
``reduce_on_server=False`` the server concatenates the factors instead (rank ≤ S·r down,
nothing dropped, no server memory).

**Why this residual rule.** PowerSGD's memory is "local M minus the *global* update"
(``powersgd.py``). That works there because every site projects on the same shared
P̂ and Q, so compression is linear across sites and Σ_s e_s is exactly what the global
rank-r step left out. rank-dAD compresses each site separately (no shared projection,
one round trip): the global update is not the projection of any site's M, so that
memory would accumulate each site's deviation from the others and grow without bound.
Each site therefore keeps what *its own* factors missed, and the server, whose
re-reduction is a second lossy compression, keeps what *it* dropped; without the server
memory the re-reduction loses that information for good. (The dropped part could go back
to the sites instead — the update is Û Ûᵀ X exactly, so each site can add
(I − Û Ûᵀ) P̃_s Q_sᵀ to its own memory — but that trains worse, so the server keeps it.)

**Where it loses: many sites with small batches.** Each site compresses its own batch's
gradient, and a small batch's top-r subspace can lie far from that of the sites' mean,
on which PowerSGD projects (its second round trip buys that). No option here closes
that gap; fewer, larger site batches do.

**Shared warm start.** The re-reduction drops what the sites' rank-r subspaces disagree
on, and the server memory has to carry it. Each site therefore starts its passes from
the re-reduced Q̂ that came down with the last update (``shared_warm_start``, the
default; identical at every site, already in the downlink, so no byte more) rather than
from its own last Q; step 0 starts every site from the same seeded random Q. A Q̂ of the
wrong shape (concatenated factors, ``tol`` dropping components) or not finite is
ignored: the site keeps its own.

**Embeddings.** Without error feedback a captured embedding table (tied to a head or not)
is power-iterated on its lookups by gather/scatter (``power_iteration.Lookups``), never
forming the one-hot or the table's gradient; with it, the table's memory is dense anyway.

**Other matrices.** Matrix-shaped parameters that no factor capture covers (learned
positions, raw ``nn.Parameter`` matrices, weights the probe sends dense), viewed as
shape[0] × rest as PowerSGD does, are compressed the same way from their dense
gradient (``dense_power_iteration``, same memories) whenever r'·(m + k) < m·k; else
they travel dense. Since the layout cannot tell whether such a parameter reads the raw
input, they are compressed only when ``raw_input`` allows low-rank factors of raw-input
layers ("low_rank", the default, or "activations"); with "dense" they travel dense.
1-D parameters (norms) and buffers travel dense and exact.

**Biases in the factors** (``bias_in_factors``, the default, with error feedback). A
captured layer's bias gradient Σ_rows Δ_s is the gradient of one more input column of
ones: Δ_sᵀ [A_s 1] is the (m × (k + 1)) matrix of weight and bias together, and rank-dAD
compresses that, memories included, so the bias costs r' floats instead of m (Q has k + 1
rows; ``decode_message`` splits the last one off). Each step's bias is then approximate
like the weight, and the memories carry what rank r left of it; reading a bias off the
factors of the weight alone (P Qᵀ without that column) would be wrong, which is why the
column is part of the matrix. Without error feedback nothing would carry what rank r
drops, so the bias travels dense and exact (as with ``bias_in_factors=False``).

**Integer factors** (``factor_bits`` 8 or 16, error feedback only). Each factor a site
or the server sends travels as integer codes with one float scale per column
(``quantize.py``): at 8 bits r'·(k' + m) bytes plus 8·r' for the scales instead of
4·r'·(k' + m), a quarter; what travels dense (norms, the privacy guard's layers) stays
float. The rounding error is fed back like what rank r drops: the site's memory is
e_s ← M_s − P̄_s Q̄_sᵀ / n_s with P̄_s, Q̄_s what the codes decode to (n_s·P̃_s is rounded,
as sent), and the server's E ← X − P̄ Q̄ᵀ / N, so every replica's update plus the memories
still adds up to the gradients (``tests/strategies/test_integer_factors.py``). A concatenated
downlink rounds each site's decoded factors again, one scale per column. Not exact at
any rank: full rank with integer factors leaves the rounding in the memories.

**Concatenating** (``reduce_on_server=False``). The server sends every site's factors
down side by side (rank ≤ S·r, S× the downlink bytes) and keeps no memory: nothing is
dropped at the server, so fewer steps reach a target, each costing more bytes, and each
step is shorter (no re-reduction at the server). Re-reduction is the default (fewer bytes
to a target); concatenating suits links where a step's time is round trips and compute
rather than bytes.

**Grouped layers.** A grouped convolution's gradient is G blocks Δ_gᵀ A_g (m × k each),
and rank-dAD factors each block: G·r'·(k' + m) floats. With ``stack_groups`` (error
feedback only: the passes run on the dense M, whatever its shape) it compresses the
G·m × k matrix of the blocks' rows stacked instead, as PowerSGD views the weight:
r'·(k' + G·m) floats, but rank r then covers the whole matrix rather than each block.
Neither form wins on every data split, so each block keeps its own factors by default.

Exact when r ≥ the rank of every compressed matrix and factors are floats; at full rank
(r ≥ min(m, k)) the memories stay at rounding level and every step is exact to fp32.
``tol`` > 0 drops components below tol·σ_max (the memories keep them). Components
beyond min(r, m, k) do not exist: that is the rank sent (r' below).

How to tune: the defaults are one setting for every workload. ``rank`` trades bytes per
step against steps to a target (r = 1 to 4 covers the benchmarks; a larger r for a
model whose layers are small). ``factor_bits=8`` cuts the factors' bytes to a quarter at
about the same steps. ``iterations`` costs local flops, never a round trip (2 is enough;
1 loses accuracy). Keep ``error_feedback`` (without it rank r's losses are never made
up). ``reduce_on_server=False`` on a latency-bound link (above). ``bias_in_factors=False``
sends biases dense and exact for more bytes per step. What each default was measured
against is in ``docs/strategies.md``.

Cost per compressed matrix (floats, at 8 bits a quarter of the factors' bytes plus the
scales; G groups, k in and m out per group, k' = k + 1 with a folded bias, else k;
r' = min(r, m, k'), S sites), one round trip per step:
    up   = G·r'·(k' + m)                                 per site (+ G·m: a bias apart)
    down = G·r'·(k' + m)        with reduce_on_server (default)
         = G·S·r'·(k' + m)      concatenated factors
(with ``stack_groups``, G·m rows and one group: r'·(k' + G·m), r' = min(r, G·m, k')).
Compute per site and step, with error feedback: ``iterations`` × 4·G·m·k'·r' for the passes
and 2·G·m·k'·r' for the residual, on autograd's gradient; without: ``iterations`` ×
2·G·n·(k + m)·r'. Memory: G·m·k' floats per matrix at each site and, with re-reduction, at
the server.

Reveals: to the server (and, through the downlink, to every site) each site's
rank-r approximation of its gradient plus memory (with a bias apart, also its exact bias
gradient, whose ratio to a row of the weight gradient gives a single sample's input) —
less than the gradient itself, but the leading singular directions of a small batch's
gradient still carry its inputs ("Deep Leakage from Gradients"). Layers reading the
raw input travel as rank-r factors like the others (``raw_input="low_rank"``, the
default: the same projection PowerSGD sends of them, no more than their dense gradient
reveals), or as dense gradients with ``raw_input="dense"``; A and Δ never leave the site.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch

from .base import (
    DEFAULT_RAW_INPUT,
    GRAD_ROLE,
    LocalResult,
    Payload,
    StateDict,
    Strategy,
    check_raw_input,
    check_state_keys,
    decode_entries,
    dense_aggregate,
    dense_upload,
    layer_gradient,
    low_rank_allowed,
    numel,
    sum_in_order,
    tensor_key,
    tensors_under,
    with_prefix,
)
from .payload import Factors
from .checks import RANK, Form, Spec, Unit, all_finite, layerwise_terms
from .introspect import energy_ranks, factor_energies
from .layout import CapturedLayer, Layout
from .power_iteration import Lookups, LowRank, dense_power_iteration, make_generator, power_iteration, reduce_sum
from .quantize import FULL_PRECISION, Quantized, check_factor_bits, factor_entries, quantize, quantized_specs, unpack

Factor = torch.Tensor | Quantized  # a factor as it is sent: floats, or codes and scale (``quantize.py``)



@dataclass(frozen=True)
class Compressed:
    """One matrix rank-dAD sends as factors: a captured layer or an uncovered parameter.

    ``key`` names it in payloads (``"<key>:P"``, ``"<key>:Q"``): the layer's module name,
    or the parameter's name. The matrix is (G, m, k); P is (G, m, r), Q (G, k, r). With
    ``bias`` its last column is that bias's gradient (k = the weight's inputs + 1).
    """

    key: str
    weight: str
    groups: int
    m: int
    k: int
    weight_shape: tuple[int, ...]
    layer: CapturedLayer | None  # None: an uncovered parameter, compressed from its dense gradient
    bias: str | None = None  # the bias folded in as the last column

    def matrix(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, scale: float = 1.0, memory: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """scale·[weight bias] + memory, the (G, m, k) matrix of a weight's and (folded) its
        bias's gradients, each part written once into the result (no [weight bias] copy
        first); a missing part is zero; None when both are."""
        if weight is None and (bias is None or self.bias is None):
            return None
        like = weight if weight is not None else bias
        width = self.k - (self.bias is not None)
        weight = like.new_zeros(self.weight_shape) if weight is None else weight
        if self.bias is None:
            return with_memory(weight.reshape(self.groups, self.m, width), scale, memory)
        bias = like.new_zeros(self.m * self.groups) if bias is None else bias
        out = like.new_empty(self.groups, self.m, self.k)
        for part, columns in ((weight, slice(0, width)), (bias, slice(width, None))):
            part = part.reshape(self.groups, self.m, -1)
            if memory is None:
                torch.mul(part, scale, out=out[..., columns])
            else:
                torch.add(memory[..., columns], part, alpha=scale, out=out[..., columns])
        return out

    def dense(self, M: torch.Tensor, with_bias: bool) -> dict[str, torch.Tensor]:
        """Payload entries of a (G, m, k) matrix sent dense: the weight's gradient and, when
        ``with_bias`` (some part of it had one), the folded bias's; a bias that got no
        gradient gets no update, as under autograd."""
        if self.bias is None:
            return {tensor_key(self.weight, GRAD_ROLE): M.reshape(self.weight_shape)}
        entries = {tensor_key(self.weight, GRAD_ROLE): M[..., :-1].reshape(self.weight_shape)}
        if with_bias:
            entries[tensor_key(self.bias, GRAD_ROLE)] = M[..., -1].reshape(-1)
        return entries

    def factors(self, P: Factor, Q: Factor, bits: int = FULL_PRECISION) -> dict[str, torch.Tensor]:
        """Payload entries of (G, m, r) and (G, k, r) factors: integer codes with their scales,
        float factors coded to ``bits`` first, floats at full precision; an uncovered
        parameter's are 2-D, (m, r) and (k, r), as PowerSGD sends a parameter's."""
        if self.layer is None:
            P, Q = (Quantized(F.codes[0], F.scale[0]) if isinstance(F, Quantized) else F[0] for F in (P, Q))
        return {**factor_entries(tensor_key(self.key, "P"), P, bits), **factor_entries(tensor_key(self.key, "Q"), Q, bits)}

    def read(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(G, m, r) and (G, k, r) factors of this matrix in ``payload`` (unpacked: floats), or
        None if absent."""
        P, Q = payload.tensors.get(tensor_key(self.key, "P")), payload.tensors.get(tensor_key(self.key, "Q"))
        if P is None or Q is None:
            return None
        return (P, Q) if self.layer is not None else (P.unsqueeze(0), Q.unsqueeze(0))


@dataclass(frozen=True)
class Plan:
    """What travels as factors, what travels dense: the same on every replica."""

    matrices: tuple[Compressed, ...]
    dense_layers: tuple[CapturedLayer, ...]  # captured layers the privacy guard keeps dense
    dense_params: tuple[str, ...]  # uncovered parameters that travel dense

    @property
    def dense_biases(self) -> tuple[str, ...]:
        """Biases of the compressed layers that travel dense (not folded into their matrix)."""
        return tuple(c.layer.bias for c in self.matrices if c.layer is not None and c.layer.bias and c.bias is None)


def plan(layout: Layout, rank: int, raw_input: str, fold_bias: bool, stack_groups: bool) -> Plan:
    """``fold_bias``: each captured layer's bias is its matrix's last column; ``stack_groups``:
    a grouped layer is one matrix, its groups' rows stacked (G·m × k, as PowerSGD views it);
    else each group is factored apart. What may travel as factors is ``low_rank_allowed``'s
    (the policy PowerSGD plans with too)."""
    allowed = low_rank_allowed(layout, raw_input)
    matrices = []
    for l in (layer for layer in layout.layers if layer.weight in allowed):
        fold = l.bias if fold_bias else None
        groups, m = (1, l.groups * l.out_per_group) if stack_groups else (l.groups, l.out_per_group)
        matrices.append(Compressed(l.module, l.weight, groups, m, l.in_per_group + bool(fold), l.weight_shape, l, fold))
    compressed_layers = {c.key for c in matrices}
    dense_layers = tuple(l for l in layout.layers if l.module not in compressed_layers)
    dense_params = []
    for name in layout.uncovered:
        shape = layout.shape(name)
        if name in allowed and len(shape) > 1:
            m, k = shape[0], numel(shape[1:])
            if min(rank, m, k) * (m + k) < m * k:
                matrices.append(Compressed(name, name, 1, m, k, tuple(shape), None))
                continue
        dense_params.append(name)
    return Plan(tuple(matrices), dense_layers, tuple(dense_params))


def with_memory(G: torch.Tensor, scale: float, memory: torch.Tensor | None) -> torch.Tensor:
    """A new M = scale·G + memory (G, m, k), in one pass over the memory."""
    return G * scale if memory is None else torch.add(memory, G, alpha=scale)


def compress_dense(
    M: torch.Tensor, rank: int, keep_residual: bool, units: int, bits: int = FULL_PRECISION, **passes,
) -> tuple[LowRank, Factor, Factor, torch.Tensor | None]:
    """Rank-``rank`` factors of a dense M (G, m, k) in mean units; the P and Q to send, P
    in sum units (× ``units``), rounded to ``bits``-bit codes below full precision; and, with
    ``keep_residual``, the new error memory M − P Qᵀ of what the receivers decode, written
    into M, which the caller made for it (no second m × k tensor)."""
    result = dense_power_iteration(M, rank, **passes)
    if bits == FULL_PRECISION:
        P, Q = result.P * units, result.Q
        residual = M.baddbmm_(result.P, result.Q.transpose(1, 2), alpha=-1) if keep_residual else None
        return result, P, Q, residual
    P, Q = quantize(result.P * units, bits), quantize(result.Q, bits)
    residual = M.baddbmm_(P.value(), Q.value().transpose(1, 2), alpha=-1.0 / units) if keep_residual else None
    return result, P, Q, residual


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


class _Memories:
    """A half's carried state: warm-start Q and error memory per compressed matrix, its RNG."""

    PREFIXES = ("warm", "error", "rng")

    def __init__(self, seed: int):
        self.generators = _Generators(seed)
        self.warm: dict[str, torch.Tensor] = {}  # each matrix's last Q
        self.errors: dict[str, torch.Tensor] = {}  # each matrix's error memory (G, m, k), mean units

    def state_dict(self) -> StateDict:
        return {
            **with_prefix("warm", self.warm), **with_prefix("error", self.errors),
            **with_prefix("rng", self.generators.state_dict()),
        }

    def load_state_dict(self, owner: str, state: StateDict, plan_: Plan) -> None:
        check_state_keys(owner, state, self.PREFIXES)
        targets = {c.key: c for c in plan_.matrices}
        loaded = {}
        for kind in ("warm", "error"):
            loaded[kind] = tensors_under(state, kind)
            for name, value in loaded[kind].items():
                target = targets.get(name)
                if target is None:
                    raise ValueError(
                        f"{owner}: state has unknown keys ['{kind}/{name}']: this model's plan compresses no matrix "
                        f"{name!r}; load a state saved with the same model and options"
                    )
                expected = (target.groups, target.k) if kind == "warm" else (target.groups, target.m, target.k)
                if tuple(value.shape[: len(expected)]) != expected or value.dim() != 3:
                    raise ValueError(
                        f"{owner}: state {kind}/{name} has shape {tuple(value.shape)}; expected {expected} "
                        f"{'(, r)' if kind == 'warm' else ''}: load a state saved with the same model and options"
                    )
        self.warm = {name: value.clone() for name, value in loaded["warm"].items()}
        self.errors = {name: value.clone() for name, value in loaded["error"].items()}
        self.generators.load_state_dict(tensors_under(state, "rng"))


class RankDADSite:
    """Site half: per compressed matrix n_s·P̃_s and Q_s of M_s = Δᵀ A / n_s + e_s; the rest dense."""

    def __init__(self, layout: Layout, strategy: "RankDAD"):
        self.layout = layout
        self.options = strategy
        self.plan = strategy.plan(layout)
        self.state = _Memories(strategy.seed)

    def begin(self, local: LocalResult, step: int) -> Payload:
        tensors = dense_upload(local, self.plan.dense_params, self.layout.buffers)
        for layer in self.plan.dense_layers:
            tensors.update(dense_upload(local, layer.params, ()))
        tensors.update(dense_upload(local, self.plan.dense_biases, ()))
        n = local.num_samples
        for target in self.plan.matrices:
            tensors.update(self._compress(target, local, n))
        return Payload(step, 0, n, tensors)

    def _compress(self, target: Compressed, local: LocalResult, n: int) -> dict[str, torch.Tensor]:
        options, state = self.options, self.state
        memory = state.errors.get(target.key) if options.error_feedback else None
        shape = (target.groups, target.m, target.k)
        passes = dict(iterations=options.iterations, warm_start=state.warm.get(target.key), tol=options.tol)
        factors = local.factors.get(target.key) if target.layer is not None else None
        weight, bias = local.grads.get(target.weight), local.grads.get(target.bias)
        if target.layer is not None and factors is None:
            # Not called this step: its gradient (if any) plus what the memory holds travels
            # dense, which empties the memory.
            with_bias = memory is not None or target.bias in local.grads
            grad = target.matrix(weight, bias)
            if memory is not None:
                grad = n * memory + (0 if grad is None else grad)
            state.errors.pop(target.key, None)
            return {} if grad is None else target.dense(grad, with_bias)
        if factors is not None and not options.error_feedback:
            # Without memory the passes need only A and Δ: Dᵀ A is never formed.
            lookups = None if factors.ids is None else Lookups(factors.ids, factors.rows, target.m)
            generator = state.generators.on((factors.A if factors.A is not None else factors.rows).device)
            result = power_iteration(factors.A, factors.D, options.rank, generator=generator, scale=1.0 / n,
                                     lookups=lookups, **passes)
            # In the weight's dtype, as with error feedback: factors captured under autocast
            # come out of the passes in theirs (``precision.py``).
            P, Q = (result.P * n).to(target.layer.weight_dtype), result.Q.to(target.layer.weight_dtype)
        else:
            # The memory update needs M dense, so the passes run on it: the gradient is
            # autograd's (the probe checked it equals Dᵀ A), or rebuilt from the factors.
            if factors is not None and weight is None and (bias is None or target.bias is None):
                weight, bias = layer_gradient(target.layer, factors.tensors(target.key))
            M = target.matrix(weight, bias, 1.0 / n, memory)
            if M is None and memory is None:
                return {}  # no gradient and nothing remembered: nothing to send, and no update if no site sends it
            if M is None:  # this batch did not reach it: a zero gradient plus the memory
                M = with_memory(memory.new_zeros(shape), 1.0 / n, memory)
            result, P, Q, residual = compress_dense(M, options.rank, options.error_feedback, n, options.factor_bits,
                                                    generator=state.generators.on(M.device), **passes)
            if residual is not None:
                state.errors[target.key] = residual
        if options.warm_start:
            state.warm[target.key] = result.Q
        return target.factors(P, Q)

    def receive(self, message: Payload) -> None:
        """With ``shared_warm_start``, keep the re-reduced Q̂ of each matrix as next step's
        start: every site then starts from the same subspace. A message without rank-r'
        factors of a matrix (sent dense, concatenated), or with a Q̂ of the wrong shape or
        not finite, leaves the site's own Q in place."""
        if not (self.options.warm_start and self.options.shared_warm_start):
            return None
        message = unpack(message)
        for target in self.plan.matrices:
            factors = target.read(message)
            if factors is None:
                continue
            Q = factors[1]
            expected = (target.groups, target.k, min(self.options.rank, target.m, target.k))
            if tuple(Q.shape) == expected and all_finite(Q):
                self.state.warm[target.key] = Q.clone()
        return None

    def state_dict(self) -> StateDict:
        return self.state.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.state.load_state_dict("rankdad site", state, self.plan)


class RankDADServer:
    """Server half: re-reduce the sites' factors (plus its memory) to rank r, or concatenate
    them; average the dense parts."""

    def __init__(self, layout: Layout, strategy: "RankDAD"):
        self.layout = layout
        self.options = strategy
        self.plan = strategy.plan(layout)
        self.state = _Memories(strategy.seed)

    def aggregate(self, payloads: Sequence[Payload]) -> Payload:
        payloads = [unpack(p) for p in payloads]
        total = sum(p.num_samples for p in payloads)
        tensors = dense_aggregate(payloads, self.plan.dense_params, self.layout.buffers)
        # A site whose batch never reached a layer sends no gradient for it: it adds nothing.
        dense_layers = [name for layer in self.plan.dense_layers for name in layer.params]
        tensors.update(dense_aggregate(payloads, [*self.plan.dense_biases, *dense_layers], ()))
        for target in self.plan.matrices:
            tensors.update(self._aggregate_matrix(target, payloads, total))
        return Payload(payloads[0].step, payloads[0].phase, total, tensors)

    def _aggregate_matrix(self, target: Compressed, payloads: Sequence[Payload], total: int) -> dict:
        options, state = self.options, self.state
        memory = state.errors.get(target.key) if options.error_feedback and options.reduce_on_server else None
        factors = [target.read(p) for p in payloads]
        if any(f is None for f in factors):
            # Some site sent this layer dense (it was not called there): the mean travels
            # dense, with the server memory added (which empties it).
            weights, with_bias = [], memory is not None
            for f, p in zip(factors, payloads):
                with_bias |= f is not None or (target.bias is not None and tensor_key(target.bias, GRAD_ROLE) in p.tensors)
                dense = target.matrix(p.tensors.get(tensor_key(target.weight, GRAD_ROLE)),
                                      p.tensors.get(tensor_key(target.bias, GRAD_ROLE)) if target.bias else None)
                if f is not None:
                    weights.append(torch.bmm(f[0], f[1].transpose(1, 2)))
                elif dense is not None:
                    weights.append(dense)
                elif any(tensor_key(target.key, role) in p.tensors for role in ("P", "Q")):
                    raise ValueError(f"{target.key}: P and Q must come together")
                # else: this site's batch gave it no gradient
            state.errors.pop(target.key, None)
            if not weights and memory is None:
                return {}  # no site's batch reached it: no gradient, no update
            mean = memory if not weights else sum_in_order(weights) / total + (0 if memory is None else memory)
            return target.dense(mean, with_bias)
        Ps, Qs = [f[0] for f in factors], [f[1] for f in factors]
        if not options.reduce_on_server or (memory is None and sum(P.shape[-1] for P in Ps) <= options.rank):
            # Below full precision the decoded factors are coded again: each column is one
            # site's, so its codes come back as that site sent them, its scale to float rounding.
            return target.factors(torch.cat(Ps, dim=2), torch.cat(Qs, dim=2), options.factor_bits)
        generator = state.generators.on(Ps[0].device)
        passes = dict(iterations=options.iterations, warm_start=state.warm.get(target.key), tol=options.tol)
        if options.error_feedback:  # the memory update needs X dense, so the passes run on it
            P, Q = torch.cat(Ps, dim=2), torch.cat(Qs, dim=2)
            X = torch.baddbmm(memory, P, Q.transpose(1, 2), alpha=1.0 / total) if memory is not None else (
                torch.bmm(P, Q.transpose(1, 2)).div_(total))
            result, P, Q, state.errors[target.key] = compress_dense(X, options.rank, True, total, options.factor_bits,
                                                                    generator=generator, **passes)
        else:
            result = reduce_sum(Ps, Qs, options.rank, generator=generator, scale=1.0 / total, **passes)
            P, Q = result.P * total, result.Q
        if options.warm_start:
            state.warm[target.key] = result.Q
        return target.factors(P, Q)

    def state_dict(self) -> StateDict:
        return self.state.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.state.load_state_dict("rankdad server", state, self.plan)


@dataclass(frozen=True)
class RankDAD(Strategy):
    """Rank-r factors of each site's Δᵀ A (plus error memory) up; re-reduced factors down."""

    rank: int = 4
    iterations: int = 2
    warm_start: bool = True
    error_feedback: bool = True
    reduce_on_server: bool = True
    tol: float = 0.0
    shared_warm_start: bool = True
    raw_input: str = DEFAULT_RAW_INPUT
    seed: int = 0
    bias_in_factors: bool = True
    stack_groups: bool = False
    factor_bits: int = FULL_PRECISION
    name = "rankdad"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rankdad: rank={self.rank} must be at least 1")
        if self.iterations < 1:
            raise ValueError(f"rankdad: iterations={self.iterations} must be at least 1")
        if self.tol < 0 or self.tol >= 1:
            raise ValueError(f"rankdad: tol={self.tol} must be in [0, 1) (0 keeps all r components)")
        if self.stack_groups and not self.error_feedback:
            raise ValueError("rankdad: stack_groups needs error_feedback=True (without it the passes run on each "
                             "group's A and Δ, one factorisation per group); drop stack_groups or turn error feedback on")
        check_raw_input(self.raw_input)
        check_factor_bits("rankdad", self.factor_bits, self.error_feedback)

    def plan(self, layout: Layout) -> Plan:
        """What travels as factors: biases are folded in only with error feedback, whose
        memories carry what rank r leaves of them; a grouped layer's groups are stacked with
        ``stack_groups`` (which needs error feedback: the passes then run on the dense M)."""
        return plan(layout, self.rank, self.raw_input, self.bias_in_factors and self.error_feedback, self.stack_groups)

    def site(self, layout: Layout, model=None) -> RankDADSite:
        return RankDADSite(layout, self)

    def server(self, layout: Layout, model=None) -> RankDADServer:
        return RankDADServer(layout, self)

    def decode(self, layout: Layout, messages: Sequence[Payload], model=None) -> dict[str, torch.Tensor]:
        """Captured layers as ``decode_message`` does; compressed uncovered parameters: P Qᵀ / N."""
        return dict(self.decode_each(layout, messages, model))

    def decode_each(self, layout: Layout, messages: Sequence[Payload], model=None) -> Iterator[tuple[str, torch.Tensor]]:
        """``decode`` one parameter at a time: each P Qᵀ (float64 at a replica) is made when it is read."""
        message = unpack(messages[-1])
        yield from decode_entries(layout, message)
        for target in self.plan(layout).matrices:
            factors = target.read(message) if target.layer is None else None
            if factors is not None:
                P, Q = factors
                yield target.weight, torch.bmm(P, Q.transpose(1, 2)).reshape(target.weight_shape).div_(message.num_samples)

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model=None) -> list | None:
        """Phase 0: dense parts; each compressed layer as P, Q of one rank ≤ min(rank, m, k)
        with its bias dense, or (not called this step) dense; each compressed uncovered
        matrix as 2-D P, Q; the privacy guard's layers dense."""
        if phase != 0:
            return None
        plan_ = self.plan(layout)
        units = facts.dense_units(plan_.dense_params) + facts.buffer_units(layout.buffers)
        units += [Unit(layer.module, (facts.layer_dense(layer),)) for layer in plan_.dense_layers]
        for target in plan_.matrices:
            max_rank = min(self.rank, target.m, target.k)
            if target.layer is not None:
                forms = (facts.layer_low_rank(target.layer, max_rank, bias_folded=target.bias is not None,
                                              matrices=(target.groups, target.m)),
                         facts.layer_dense(target.layer))
            else:
                dtype = facts.params[target.weight][1]
                forms = (Form("low-rank factors", {
                    tensor_key(target.key, "P"): Spec((target.m, RANK), dtype),
                    tensor_key(target.key, "Q"): Spec((target.k, RANK), dtype),
                }, max_rank=max_rank),)
            forms = tuple(replace(form, tensors=quantized_specs(form.tensors, self.factor_bits)) for form in forms)
            units.append(Unit(target.key, forms, optional=True))  # absent: no gradient at this site
        return units

    def terms(self, layout: Layout, payload: Payload, messages_so_far, model=None) -> tuple[dict, dict]:
        """As the layer-wise terms, with every compressed matrix's factors (P in sum units)."""
        payload = unpack(payload)
        pairs = {target.key: f for target in self.plan(layout).matrices if (f := target.read(payload))}
        return layerwise_terms(layout, payload, low_rank=pairs)

    def describe(self, layout: Layout, messages: Sequence[Payload]) -> dict[str, float]:
        """``rank90/<name>/update`` and ``rank99/…``: the components of each factored matrix's
        decoded update P Qᵀ holding 90% and 99% of its energy (``introspect.py``: from the
        factors' r × r Gram matrices), at most the rank sent."""
        message = unpack(messages[-1])
        ranks = {}
        for target in self.plan(layout).matrices:
            factors = target.read(message)
            if factors is not None:
                P, Q = factors
                energies = factor_energies(Factors(Q.transpose(1, 2), P.transpose(1, 2)), target.groups * target.m, target.k)
                ranks.update(energy_ranks(energies, f"{target.key}/update"))
        return ranks
