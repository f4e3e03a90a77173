"""Tiny workloads of the networked-runtime tests, plugged in by import path like any other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dadfl.workloads import Split, Workload


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.argmax(-1) == targets).float().mean())


def big_linear(features: int = 5120, samples: int = 8) -> Workload:
    """One Linear layer of features² weights (5120² floats = 105 MB): payloads beyond 100 MB."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, features, generator=generator)
    targets = torch.randint(0, features, (samples,), generator=generator)

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return nn.Linear(features, features, bias=False)

    return Workload(
        name="big-linear",
        build_model=build,
        train=Split(inputs, targets),
        test=Split(inputs[:0], targets[:0]),
        loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
        metric=_accuracy,
    )


# ----------------------------------------------------------------------------- a two-phase strategy
# Multi-phase exchanges without depending on PowerSGD: phase 0 uploads the dense gradient,
# phase 1 uploads it again and counts the steps it has seen (cross-step state); the update
# is the phase-1 mean. Registered into STRATEGIES by the tests that use it.

from dataclasses import dataclass  # noqa: E402

from dadfl.strategies.base import Strategy  # noqa: E402
from dadfl.strategies.dsgd import DenseServer, DenseSite  # noqa: E402


class TwoPhaseSite(DenseSite):
    def __init__(self, layout):
        super().__init__(layout)
        self.first = None
        self.steps_seen = 0

    def begin(self, local, step):
        self.first = super().begin(local, step)
        return self.first

    def receive(self, message):
        if message.phase == 0:
            self.steps_seen += 1
            return type(self.first)(self.first.step, 1, self.first.num_samples, self.first.tensors)
        return None


@dataclass(frozen=True)
class TwoPhase(Strategy):
    name = "twophase"
    needs_factors = False

    def site(self, layout, model=None):
        return TwoPhaseSite(layout)

    def server(self, layout, model=None):
        return DenseServer(layout)

    def upload_units(self, layout, facts, phase, step, model=None):
        return facts.dense_units(layout.params) + facts.buffer_units(layout.buffers) if phase in (0, 1) else None


# ----------------------------------------------------------------------------- a replica altered at one site

TAMPER_ENV = "DADFL_TEST_TAMPER_AT_CALL"


def tampering_mlp(hidden: int = 16) -> Workload:
    """The digits MLP; in a process whose environment sets ``TAMPER_ENV`` to k, the k-th
    training forward call adds 1 to the output layer's first bias (a replica altered at one
    site, as a bug or an operator would)."""
    import dataclasses
    import os

    from dadfl.workloads.digits import mlp

    workload = mlp(hidden=hidden)
    tamper_at = int(os.environ.get(TAMPER_ENV, "0"))

    def build() -> nn.Module:
        model = workload.build_model()
        calls = 0

        def tamper(module: nn.Module, args) -> None:
            nonlocal calls
            if module.training and torch.is_grad_enabled():
                calls += 1
                if calls == tamper_at:
                    with torch.no_grad():
                        list(module.parameters())[-1][0] += 1.0

        if tamper_at:
            model.register_forward_pre_hook(tamper)
        return model

    return dataclasses.replace(workload, build_model=build)
