"""``dadfl.strategies.local_steps`` — fedAvg and DiLoCo: H local optimizer steps at every site, then one averaged model delta.

These are the baselines a federated-learning user compares factor sharing against. One
step of the federation is one **round**: every site starts from the shared weights θ_t,
takes H steps of its *inner* optimizer on its own batches (batches t·H … t·H + H − 1 of
its stream, so a round reads as many samples as H steps of dSGD), and uploads its
**pseudo-gradient** in sum units, n_s · (θ_t − θ_s), with n_s the samples it read this
round. The server sums and divides by N = Σ n_s: the sample-weighted mean delta

    Δ_t = Σ_s (n_s / N) (θ_t − θ_s)

and every replica applies the strategy's *outer* optimizer to Δ_t as if it were a
gradient, so replicas stay bit-identical exactly as with dSGD:

- **FedAvg** (McMahan et al., 2017): the inner optimizer is the run's ``[optimizer]``,
  fresh every round; the outer one is SGD with ``server_lr`` (1.0 gives the plain
  sample-weighted average of the sites' models).
- **DiLoCo** (Douillard et al., 2023): the inner optimizer is AdamW (``inner_lr``,
  ``weight_decay``) whose moments each site keeps across rounds (its strategy state, saved
  and restored with checkpoints); the outer one is SGD with Nesterov momentum
  (``outer_lr`` 0.7, ``outer_momentum`` 0.9, the paper's values). The run's ``[optimizer]``
  is not used.

Cost per round: every parameter and floating buffer once up and once down, as one dSGD
step; rounds are H times fewer. Trade-offs, measured in ``docs/benchmarks.md``: the update is
*not* the gradient of any batch, so the exactness every other strategy here keeps is gone;
with non-IID sites the local models drift apart (client drift) and more rounds are needed;
a round costs H local steps of compute, which on a fast link dominates.

Reveals: each site's model delta after H steps to the server (gradient-inversion attacks
apply, weaker than on one step's gradient); sites see only the mean. Refused with ``[dp]``:
the per-sample clipping there bounds one step's gradient, not an H-step delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from .base import Batch, LocalResult, OptimizerFactory, StateDict, check_state_keys, tensors_under, with_prefix
from .capture import as_args, sample_losses
from .checks import all_finite
from .dsgd import DSGD, DenseServer, DenseSite
from .layout import Layout

MAX_LOCAL_STEPS = 10_000  # a coordinator cannot make a site train for ever in one round


class LocalStepsSite(DenseSite):
    """Site half: H inner steps, then the pseudo-gradient as dSGD's dense upload. FedAvg's
    inner optimizer starts fresh every round, so this half carries nothing.

    The half never holds the model (a runtime may pickle the half between messages, which
    would train a stale copy): ``train_round`` is handed the replica's model every round.
    """

    def train_round(self, model: nn.Module, loss_fn: Callable, batches: Iterable[Batch], run_optimizer: OptimizerFactory) -> LocalResult:
        """H inner steps from the current weights; the weights are put back afterwards, so
        the replica applies the round's update from θ_t like every other replica."""
        params = dict(model.named_parameters())
        start = {name: params[name].detach().clone() for name in self.layout.params}
        start_buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
        optimizer = self.inner_optimizer(model, run_optimizer)
        reached: set[str] = set()
        samples, loss_sums = 0, []
        for inputs, targets in batches:
            optimizer.zero_grad(set_to_none=True)
            losses = sample_losses(loss_fn, model(*as_args(inputs)), targets)
            losses.mean().backward()
            reached.update(name for name in self.layout.params if params[name].grad is not None)
            optimizer.step()
            samples += int(targets.shape[0])
            loss_sums.append(losses.detach().sum())  # read once after the loop: no device sync per step
        optimizer.zero_grad(set_to_none=True)
        self.keep(optimizer)
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            # A parameter no batch reached has no delta, as it would have no gradient.
            deltas = {name: (start[name] - params[name]) * samples for name in self.layout.params if name in reached}
            local_buffers = {name: buffers[name].detach().clone() for name in self.layout.buffers}
            for name, value in start.items():
                params[name].copy_(value)
            for name, value in start_buffers.items():
                buffers[name].copy_(value)
        return LocalResult(num_samples=samples, loss_sum=float(torch.stack(loss_sums).sum()), grads=deltas, factors={}, buffers=local_buffers)

    def inner_optimizer(self, model: nn.Module, run_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        return run_optimizer(list(model.parameters()))

    def keep(self, optimizer: torch.optim.Optimizer) -> None:
        """What of the inner optimizer carries to the next round: nothing, for FedAvg."""


MOMENTS = ("step", "exp_avg", "exp_avg_sq")


class DiLoCoSite(LocalStepsSite):
    """DiLoCo's site half: AdamW whose moments carry from round to round, as tensors by
    parameter position (the half's state, checked against the model's shapes on load)."""

    def __init__(self, layout: Layout, model: nn.Module, config: "DiLoCo"):
        super().__init__(layout)
        self.config = config
        self.shapes = [tuple(param.shape) for param in model.parameters()]
        self.moments: dict[int, dict[str, torch.Tensor]] = {}

    def inner_optimizer(self, model: nn.Module, run_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.config.inner_lr, weight_decay=self.config.weight_decay)
        if self.moments:
            state = optimizer.state_dict()
            state["state"] = {index: {k: v.clone() for k, v in entry.items()} for index, entry in self.moments.items()}
            optimizer.load_state_dict(state)
        return optimizer

    def keep(self, optimizer: torch.optim.Optimizer) -> None:
        # The round's optimizer is dropped after it, so its tensors need no copy; they are
        # cloned when loaded into the next one, so a round that fails leaves these intact.
        self.moments = {index: dict(entry) for index, entry in optimizer.state_dict()["state"].items()}

    def state_dict(self) -> StateDict:
        return with_prefix("inner", {f"{index}/{key}": value for index, entry in self.moments.items() for key, value in entry.items()})

    def load_state_dict(self, state: StateDict) -> None:
        check_state_keys("diloco site", state, ["inner"])
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors_under(state, "inner").items():
            index, _, name = key.partition("/")
            if not index.isdigit() or name not in MOMENTS:
                raise ValueError(f"diloco site: unexpected state entry inner/{key}")
            moments.setdefault(int(index), {})[name] = value
        for index, entry in moments.items():
            if index >= len(self.shapes) or set(entry) != set(MOMENTS):
                raise ValueError(f"diloco site: the state of parameter {index} does not fit this model")
            step = entry["step"]
            if step.numel() != 1 or not step.is_floating_point() or not 1 <= float(step) < float("inf"):
                raise ValueError(f"diloco site: step of parameter {index} must be one finite number ≥ 1 (AdamW's bias correction divides by 1 − β^step)")
            for name in ("exp_avg", "exp_avg_sq"):
                if tuple(entry[name].shape) != self.shapes[index] or not entry[name].is_floating_point():
                    raise ValueError(f"diloco site: {name} of parameter {index} has shape {tuple(entry[name].shape)}, "
                                     f"the parameter {self.shapes[index]}")
                if not all_finite(entry[name]):
                    raise ValueError(f"diloco site: {name} of parameter {index} is not finite")
            if (entry["exp_avg_sq"] < 0).any():
                raise ValueError(f"diloco site: exp_avg_sq of parameter {index} is negative (a square's running mean)")
        self.moments = {index: {k: v.clone() for k, v in entry.items()} for index, entry in moments.items()}


@dataclass(frozen=True)
class LocalSteps(DSGD):
    """What FedAvg and DiLoCo share: the round, the dense wire format and its checks (dSGD's)."""

    exact = False  # the update is a model delta after several local steps, not the step's gradient
    supports_dp = False  # one record can act in many local steps: per-sample clipping does not bound the delta
    has_local_steps = True
    local_steps: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.local_steps <= MAX_LOCAL_STEPS:
            raise ValueError(f"{self.name}: local_steps={self.local_steps} must be between 1 and {MAX_LOCAL_STEPS}")

    def batch_indices(self, step: int) -> range:
        return range(step * self.local_steps, (step + 1) * self.local_steps)

    def server(self, layout: Layout, model=None) -> DenseServer:
        return DenseServer(layout)

    def momenta_agree(self, step: int, phase: int) -> bool:
        """Never: a delta of several local steps already sums a site's noise over them, and its
        momentum then holds the site's own optimum: once the model fitted, honest sites pushed
        back on each other's momenta and were zeroed (docs/robustness.md). Agreement reads each
        round's deltas."""
        return False


@dataclass(frozen=True)
class FedAvg(LocalSteps):
    name = "fedavg"
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.server_lr < math.inf:
            raise ValueError(f"fedavg: server_lr={self.server_lr} must be positive (1.0 is the plain average)")

    def site(self, layout: Layout, model=None) -> LocalStepsSite:
        return LocalStepsSite(layout)

    def outer_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.server_lr)


@dataclass(frozen=True)
class DiLoCo(LocalSteps):
    name = "diloco"
    inner_lr: float = 1e-3
    weight_decay: float = 0.1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        finite = all(math.isfinite(v) for v in (self.inner_lr, self.outer_lr, self.weight_decay))
        if not (finite and self.inner_lr > 0 and self.outer_lr > 0 and self.weight_decay >= 0 and 0 <= self.outer_momentum < 1):
            raise ValueError(
                f"diloco: need finite inner_lr > 0, outer_lr > 0, weight_decay >= 0 and 0 <= outer_momentum < 1 "
                f"(got {self.inner_lr}, {self.outer_lr}, {self.weight_decay}, {self.outer_momentum})"
            )

    def site(self, layout: Layout, model=None) -> DiLoCoSite:
        if model is None:
            raise ValueError("diloco: the site half needs the model (its parameters' shapes check a restored state)")
        return DiLoCoSite(layout, model, self)

    def outer_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
