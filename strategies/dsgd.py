"""``dadfl.strategies.dsgd`` — dSGD: gradient averaging, the exact reference every other strategy is measured against.

Each site sends the gradient of its summed loss for every parameter; the server sums
and divides by N = Σ n_s, giving the gradient of the mean loss over the union of the
sites' batches, and sends that mean back.

Cost per captured layer (floats, G groups, k inputs and m outputs per group):
    up   = G·k·m (+ G·m bias)       per site
    down = G·k·m (+ G·m bias)       per site
Every other parameter and every floating buffer: its numel, both ways.

Reveals: each site's full gradient to the server ("Deep Leakage from Gradients" can
reconstruct small batches from it); sites see only the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .base import LocalResult, Payload, Stateless, Strategy, dense_aggregate, dense_upload
from .layout import Layout


class DenseSite(Stateless):
    """Site half shared by dSGD and by any strategy whose single phase is all dense."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def begin(self, local: LocalResult, step: int) -> Payload:
        tensors = dense_upload(local, self.layout.params, self.layout.buffers)
        return Payload(step, 0, local.num_samples, tensors)

    def receive(self, message: Payload) -> None:
        return None


class DenseServer(Stateless):
    def __init__(self, layout: Layout):
        self.layout = layout

    def aggregate(self, payloads: Sequence[Payload]) -> Payload:
        first = payloads[0]
        total = sum(p.num_samples for p in payloads)
        tensors = dense_aggregate(payloads, self.layout.params, self.layout.buffers)
        return Payload(first.step, first.phase, total, tensors)


@dataclass(frozen=True)
class DSGD(Strategy):
    name = "dsgd"
    exact = True
    supports_dp = True
    needs_factors = False

    def site(self, layout: Layout, model=None) -> DenseSite:
        return DenseSite(layout)

    def server(self, layout: Layout, model=None) -> DenseServer:
        return DenseServer(layout)

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model=None) -> list | None:
        """Phase 0: every parameter's gradient and every buffer, in their shapes."""
        return facts.dense_units(layout.params) + facts.buffer_units(layout.buffers) if phase == 0 else None
