"""Bytes per step from the cost formulas, and the round trips a strategy needs per step.

Every strategy splits a model's parameters the same way (``Layout``): *captured* layers
(Linear, Conv) whose weight gradient is Σ_rows Δᵀ A, and everything else — embeddings,
tied weights, LayerNorm, raw ``nn.Parameter``s — which no factor capture covers and
which travels dense. A captured layer's bias gradient Σ_rows Δ is the gradient of one
more input column of ones, so a rank-r method can send it inside the layer's factors
(r'·(k + 1 + G·m), a grouped layer's G groups stacked as one matrix: rank-dAD folds the
bias in with error feedback, and stacks the groups with ``stack_groups``; by default it
factors each group, G·r'·(k + 1 + m)); PowerSGD sends the bias dense.

Uncovered *matrices* (learned positions, weights tied across modules, raw
``nn.Parameter`` matrices; m × k viewed as shape[0] × rest) are compressed from their
dense gradient at rank r when that pays (rank-dAD with ``raw_input`` allowing it, and
PowerSGD); uncovered vectors (norms) stay dense. For a rank-r strategy the floats per
site and direction per step are therefore at least

    low_rank(r) = uncovered vectors + Σ_layers r·(k + [1 with a bias] + G·m)
                  + Σ_uncovered matrices min(r·(m + k), m·k)

against dSGD's ``dense = Σ all parameters``, so no rank-r method can beat
``dense / low_rank(r)`` per step; with r → 0 the bound
is ``dense / uncovered vectors``. ``Breakdown`` holds these numbers for one model; the report
prints them beside the measured ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dadfl.replica import OptimizerConfig, Replica
from dadfl.simulation import StrategySpec
from dadfl.strategies import exchange, make_strategy
from dadfl.strategies.quantize import FULL_PRECISION
from dadfl.workloads import load_workload

FLOAT_BYTES = 4


@dataclass(frozen=True)
class LayerCost:
    module: str
    groups: int
    k: int  # inputs per group
    m: int  # outputs per group
    bias: int  # bias floats (0 without bias)
    raw_input: bool

    @property
    def weight(self) -> int:
        return self.groups * self.k * self.m

    def factors(self, rank: int) -> int:
        """r'·(k' + G·m) with k' = k (+ 1 with a bias, folded in) and r' = min(r, k', G·m): the
        rank-r factors of the groups' rows stacked (G·m × k'), fewer than G·r'·(k' + m) for
        one factorisation per group."""
        k, m = self.k + (self.bias > 0), self.groups * self.m
        return min(rank, k, m) * (k + m)


@dataclass(frozen=True)
class Breakdown:
    """Floats of one model by how they travel."""

    parameters: int  # every trainable parameter: dSGD's floats per site per direction
    float_buffers: int  # BatchNorm statistics and the like: dense in every strategy
    uncovered: dict[str, int]  # parameters no capture covers, by name
    layers: tuple[LayerCost, ...]
    uncovered_matrices: dict[str, tuple[int, int]]  # the uncovered ones with 2+ dimensions, as (m, k)

    @property
    def dense(self) -> int:
        return self.parameters + self.float_buffers

    @property
    def always_dense(self) -> int:
        """What travels dense under any low-rank strategy: uncovered vectors, buffers."""
        vectors = sum(count for name, count in self.uncovered.items() if name not in self.uncovered_matrices)
        return vectors + self.float_buffers

    def low_rank(self, rank: int, raw_input_dense: bool = False) -> int:
        """Floats per site per direction of a rank-``rank`` factorisation of every captured
        weight and uncovered matrix (the raw-input layer, and the uncovered matrices, dense
        when ``raw_input_dense``: the ``raw_input="dense"`` privacy policy)."""
        weights = sum(
            layer.weight + layer.bias if (raw_input_dense and layer.raw_input) else layer.factors(rank)
            for layer in self.layers
        )
        matrices = sum(
            m * k if raw_input_dense else min(min(rank, m, k) * (m + k), m * k)
            for m, k in self.uncovered_matrices.values()
        )
        return self.always_dense + weights + matrices

    def low_rank_bytes(self, rank: int, raw_input_dense: bool = False, factor_bits: int = FULL_PRECISION) -> float:
        """Bytes per site per direction of :meth:`low_rank`, with the factors' entries at
        ``factor_bits`` each plus one float scale per factor column (``strategies/quantize.py``)
        below full precision; what travels dense stays floats."""
        floats = self.low_rank(rank, raw_input_dense)
        if factor_bits == FULL_PRECISION:
            return FLOAT_BYTES * floats
        factored = [(layer.k + (layer.bias > 0), layer.groups * layer.m) for layer in self.layers
                    if not (raw_input_dense and layer.raw_input)]
        if not raw_input_dense:
            factored += [(k, m) for m, k in self.uncovered_matrices.values() if min(rank, m, k) * (m + k) < m * k]
        entries = sum(min(rank, k, m) * (k + m) for k, m in factored)
        scales = sum(2 * min(rank, k, m) for k, m in factored)
        return FLOAT_BYTES * (floats - entries + scales) + entries * factor_bits / 8

    @property
    def bound_rank_zero(self) -> float:
        """dSGD bytes over the always-dense bytes: the bound as r → 0 (∞ when nothing is always dense)."""
        return self.dense / self.always_dense if self.always_dense else math.inf

    def bound(self, rank: int, raw_input_dense: bool = False, factor_bits: int = FULL_PRECISION) -> float:
        """dSGD bytes over rank-r bytes per step: no rank-r method with factors of ``factor_bits``
        compresses more."""
        return FLOAT_BYTES * self.dense / self.low_rank_bytes(rank, raw_input_dense, factor_bits)


def breakdown(workload: str, options: dict) -> Breakdown:
    loaded = load_workload(workload, **options)
    model = loaded.build_model()
    replica_layout = Replica(loaded, make_strategy("dsgd"), OptimizerConfig()).layout
    params = dict(model.named_parameters())
    covered = set()
    layers = []
    for layer in replica_layout.layers:
        covered.add(layer.weight)
        bias = 0
        if layer.bias is not None:
            covered.add(layer.bias)
            bias = params[layer.bias].numel()
        layers.append(LayerCost(layer.module, layer.groups, layer.in_per_group, layer.out_per_group, bias, layer.raw_input))
    uncovered = {name: params[name].numel() for name in replica_layout.params if name not in covered}
    matrices = {
        name: (params[name].shape[0], params[name][0].numel()) for name in uncovered if params[name].dim() > 1
    }
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return Breakdown(sum(p.numel() for p in params.values()), buffers, uncovered, tuple(layers), matrices)


def round_trips(workload: str, options: dict, spec: StrategySpec, sites: int = 2, batch: int = 4) -> int:
    """Server round trips one step of ``spec`` takes (its number of phases), measured by
    running one step on ``sites`` replicas."""
    torch.set_num_threads(1)
    loaded = load_workload(workload, **options)
    strategy = make_strategy(spec.name, **spec.options)
    replicas = [Replica(loaded, strategy, OptimizerConfig()) for _ in range(sites)]
    server = strategy.server(replicas[0].layout, replicas[0].model)
    inputs, targets = loaded.train.inputs[:batch], loaded.train.targets[:batch]
    locals_ = [replica.local(inputs, targets) for replica in replicas]
    _, traffic = exchange([replica.half for replica in replicas], server, locals_, step=0)
    return len(traffic.up)
