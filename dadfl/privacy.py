"""Sample-level DP-SGD across the federation: the [dp] configuration, the coordinator's
noise and the accountant. The sites' half (per-sample clipping read off the factors) is
``dadfl.strategies.privacy``; what each party sees is in ``docs/privacy.md``.

One step, in order:

1. every site draws its batch by **Poisson sampling** (each of its n_s records with
   probability q_s = min(1, batch_size / n_s)) and clips every sample's gradient to C. A
   site process draws each upload's batch from the operating system's randomness, so a
   step replayed after a coordinator restart, or a retried attempt, is a new sample:
   every release is then one independent step of the sampled Gaussian mechanism, as the
   accountant counts it. (Releasing the same sample twice with fresh noise would cost as
   much as one step at σ/√2, far more than two steps at σ.) The in-process simulation,
   which never replays, seeds the draw by (seed, step);
2. the strategy carries the clipped sum to the coordinator exactly (its own factors,
   checks and bounds unchanged) and the coordinator decodes it: S = Σ_i c_i g_i;
3. the coordinator adds N(0, σ²C²) to every parameter's sum from its **own generator**
   (seeded from the operating system at every start, never sent, never logged, never
   saved) and divides by the *expected* batch B = Σ_s q_s n_s, not the drawn one, whose
   size is itself private: update = (S + z) / B;
4. that dense noisy update is the whole downlink, for every strategy: sites never see
   another site's factors, the noise, or the drawn batch size.

**Accounting.** Each step is the sampled Gaussian mechanism with noise multiplier σ and
sampling rate q = max_s q_s (a record sampled less often is protected at least as well);
ε after T steps at δ is Opacus's RDP accountant (or its PRV accountant) for (q, σ, T).
With ``target_epsilon`` alone, σ is the smallest that keeps ε ≤ target after the planned
steps; with both ``noise_multiplier`` and ``target_epsilon``, σ is given and the run stops
before the step that would take ε above the target.

**Strategies.** The guarantee needs the released update to move by at most C when one
record comes or goes. dsgd, dad, auto and edad decode exactly the clipped sum. rank-dAD
and PowerSGD do not: a rank-r approximation computed from the batch, and error-feedback
memory that releases a record's residual again at later steps, have a per-record
sensitivity that C does not bound — so they are refused with [dp] rather than reported
with an ε that does not hold. (PowerSGD's first phase would also send sites an unnoised
aggregate.)

**Restarts: privacy over reproducibility.** A restarted coordinator draws fresh noise and
counts every replayed step as a new release (``server/privacy.py`` keeps the count on
disk before each release goes out). Replaying a step with the noise of its first release
would let a site that saw both subtract them when the participants differ; so under [dp]
a resumed run is not bit-identical to an uninterrupted one (without [dp] it still is).
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from pydantic import Field, model_validator

from dadfl.strategies import Layout, Payload
from dadfl.strategies.base import GRAD_ROLE, tensor_key

from .config import StrictModel

log = logging.getLogger("dadfl.privacy")

EXACT_STRATEGIES = ("dsgd", "dad", "auto", "edad")
LOCAL_STEP_STRATEGIES = ("fedavg", "diloco")


class DPConfig(StrictModel):
    """``[dp]``: sample-level differential privacy (DP-SGD) for the whole federation."""

    noise_multiplier: float | None = Field(
        None, gt=0, le=1000, allow_inf_nan=False, description="σ: noise std is σ·max_grad_norm per step"
    )
    target_epsilon: float | None = Field(
        None, gt=0, le=1000, allow_inf_nan=False,
        description="ε to reach after the planned steps (σ calibrated), or, with noise_multiplier, to stop at",
    )
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False, description="C: every sample's gradient is clipped to this norm")
    delta: float = Field(1e-5, gt=0, lt=1, allow_inf_nan=False, description="δ of (ε, δ)-DP; below 1 / (records in the federation)")
    accountant: Literal["rdp", "prv"] = "rdp"
    max_sample_rate: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False,
        description="q: the largest Poisson rate a site may sample at (its rate is batch_size / its records; a site "
        "with fewer records refuses to join). The coordinator needs it; a simulation takes its sites' largest rate",
    )

    @model_validator(mode="after")
    def _noise_or_target(self) -> "DPConfig":
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("set noise_multiplier (σ), target_epsilon (ε after the planned steps), or both (σ, stopping at ε)")
        return self


class SitePrivacy(StrictModel):
    """The public half of [dp], sent in the run config (``RunConfig.dp``) and checked there:
    what a site needs to clip and sample, and what it needs to check the run against its own
    privacy floor (σ and δ are public in DP; only the noise draws are secret)."""

    max_grad_norm: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    max_sample_rate: float = Field(gt=0, le=1, allow_inf_nan=False)
    noise_multiplier: float = Field(gt=0, le=1000, allow_inf_nan=False)
    delta: float = Field(gt=0, lt=1, allow_inf_nan=False)
    epsilon: float = Field(gt=0, allow_inf_nan=False, description="the most ε the coordinator spends: it stops before passing it")
    accountant: Literal["rdp", "prv"]

    def run_epsilon(self, steps: int) -> float:
        """ε after the run's ``steps`` as this site computes it, not the coordinator's
        ``epsilon``: the RDP accountant for (q, σ, steps, δ). RDP whatever the run's
        accountant: an upper bound, looser than PRV's estimate, and its cost does not grow
        with ``steps``, which the coordinator chooses (PRV's memory does). A coordinator that
        stops earlier at a target ε spends less; the site does not count on it."""
        return epsilon(self.noise_multiplier, self.max_sample_rate, steps, self.delta, "rdp")

    def site_rate(self, batch_size: int, num_samples: int) -> float:
        """This site's Poisson rate; refused when it would exceed what the accountant assumes."""
        rate = site_sample_rate(batch_size, num_samples)
        if rate > self.max_sample_rate:
            raise ValueError(
                f"this site's {num_samples} training records sample at rate {rate:.4g} (batch_size {batch_size} / records), "
                f"above the run's dp.max_sample_rate {self.max_sample_rate:g}, which its ε assumes; the site needs at "
                f"least {math.ceil(batch_size / self.max_sample_rate)} records, or the coordinator a larger max_sample_rate"
            )
        return rate


def poisson_cap(batch_size: int) -> int:
    """The largest Poisson batch a site sends: ten standard deviations above the expected
    batch_size (a larger draw has probability below 1e-20 and is not sent)."""
    return batch_size + math.ceil(10 * math.sqrt(batch_size)) + 10


def check_dp_strategy(name: str) -> None:
    """Refuse a strategy whose released update is not exactly the clipped sum (module doc)."""
    if name in LOCAL_STEP_STRATEGIES:
        why = ("its update is a model delta after several local steps, in which one record can act many times; "
               "per-sample clipping bounds one step's gradient, not that delta")
    elif name not in EXACT_STRATEGIES:
        why = ("its update is a low-rank approximation computed from the batch (with error-feedback memory), "
               "whose change when one record comes or goes max_grad_norm does not bound")
    else:
        return
    raise ValueError(f"strategy {name!r} cannot run with [dp]: {why}, so no ε would hold; "
                     f"use one of {', '.join(EXACT_STRATEGIES)} (see docs/privacy.md)")


def site_sample_rate(batch_size: int, num_samples: int) -> float:
    """q_s: each record is in a step's batch with this probability; the expected batch is batch_size."""
    if num_samples < 1:
        raise ValueError("a site with no records cannot sample a batch")
    return min(1.0, batch_size / num_samples)


@functools.lru_cache(maxsize=1024)  # a pure function, asked several times per step (the PRV accountant takes a second)
def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """ε after ``steps`` sampled Gaussian steps, by Opacus's accountant (0 before any step)."""
    if steps <= 0:
        return 0.0
    from opacus.accountants import PRVAccountant, RDPAccountant  # the [dp] extra

    counter = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    counter.history = [(noise_multiplier, sample_rate, steps)]
    return float(counter.get_epsilon(delta))


@dataclass(frozen=True)
class PrivacyBudget:
    """The resolved mechanism of one run: σ, q, δ, C, and where it stops."""

    noise_multiplier: float
    sample_rate: float
    delta: float
    max_grad_norm: float
    accountant: str
    stop_epsilon: float | None  # stop before a step that would exceed it

    @classmethod
    def resolve(cls, config: DPConfig, sample_rate: float, steps: int) -> "PrivacyBudget":
        if config.max_sample_rate is not None:
            if sample_rate > config.max_sample_rate:
                raise ValueError(f"a site samples at rate {sample_rate:.4g}, above dp.max_sample_rate {config.max_sample_rate:g}")
            sample_rate = config.max_sample_rate
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sampling rate {sample_rate} is outside (0, 1]")
        sigma, stop = config.noise_multiplier, None
        if sigma is None:
            from opacus.accountants.utils import get_noise_multiplier

            sigma = float(get_noise_multiplier(
                target_epsilon=config.target_epsilon, target_delta=config.delta, sample_rate=sample_rate,
                steps=steps, accountant=config.accountant,
            ))
        elif config.target_epsilon is not None:
            stop = config.target_epsilon
        budget = cls(sigma, sample_rate, config.delta, config.max_grad_norm, config.accountant, stop)
        if not budget.allows(1):
            raise ValueError(
                f"with noise_multiplier {sigma:g} a single step already gives ε = {budget.epsilon(1):.3g}, above "
                f"target_epsilon {stop:g}: raise noise_multiplier or target_epsilon (or set target_epsilon alone)"
            )
        return budget

    def epsilon(self, steps: int) -> float:
        return epsilon(self.noise_multiplier, self.sample_rate, steps, self.delta, self.accountant)

    def allows(self, steps: int) -> bool:
        """Whether ``steps`` steps in all keep ε within the stop target (if any)."""
        return self.stop_epsilon is None or self.epsilon(steps) <= self.stop_epsilon

    def max_steps(self, limit: int) -> int:
        """The most steps, at most ``limit``, that keep ε within the stop target: found once by
        bisection (ε grows with the steps), so a run asks no accountant step by step."""
        if self.allows(limit):
            return limit
        low, high = 0, limit  # allows(low), not allows(high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.allows(middle) else (low, middle)
        return low

    def summary(self, steps: int) -> dict[str, float]:
        return {
            "dp_epsilon": self.epsilon(steps), "dp_delta": self.delta, "dp_noise_multiplier": self.noise_multiplier,
            "dp_sample_rate": self.sample_rate, "dp_max_grad_norm": self.max_grad_norm,
        }


class CoordinatorNoise:
    """The coordinator's Gaussian noise, from a generator nobody else holds.

    ``seed`` None (the coordinator) draws the seed from the operating system, anew at every
    start, and the generator is never saved: a replayed step gets fresh noise (module doc).
    A simulation may pass a seed so that a benchmark is reproducible.
    """

    def __init__(self, budget: PrivacyBudget, seed: int | None = None):
        self.budget = budget
        self.generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)

    def __repr__(self) -> str:  # never the generator's state
        return f"CoordinatorNoise(σ={self.budget.noise_multiplier:g}, C={self.budget.max_grad_norm:g})"

    def privatize(
        self, layout: Layout, update: dict[str, torch.Tensor], num_samples: int, expected: float, step: int
    ) -> Payload:
        """The noisy dense downlink: for every trainable parameter, (S + z) / B with
        S = update · N the clipped sum, z ~ N(0, σ²C²), B the expected batch."""
        if not expected > 0:
            raise ValueError(f"the expected batch must be positive, got {expected}")
        std = self.budget.noise_multiplier * self.budget.max_grad_norm
        tensors = {}
        for name, shape in zip(layout.params, layout.shapes):
            noise = torch.randn(shape, generator=self.generator)  # CPU, float32: the same numbers on every device
            clipped_sum = update.get(name)
            if clipped_sum is None:  # no sample reached it: the noise alone
                total = noise * std
            else:
                total = clipped_sum.detach().to(torch.float32).cpu() * num_samples + noise * std
            tensors[tensor_key(name, GRAD_ROLE)] = total / expected
        return Payload(step, 0, max(1, round(expected)), tensors)


def expected_batch(batch_size: int, site_sizes: Sequence[int]) -> float:
    """B = Σ_s q_s n_s = Σ_s min(batch_size, n_s)."""
    return float(sum(min(batch_size, n) for n in site_sizes))


def log_plan(budget: PrivacyBudget, steps: int) -> None:
    log.info(
        "differential privacy: σ=%.4g, C=%g, q=%.4g, δ=%g; ε after %d steps: %.3g (%s accountant)%s",
        budget.noise_multiplier, budget.max_grad_norm, budget.sample_rate, budget.delta, steps,
        budget.epsilon(steps), budget.accountant,
        f"; stops before ε exceeds {budget.stop_epsilon:g}" if budget.stop_epsilon is not None else "",
    )


__all__ = [
    "DPConfig", "SitePrivacy", "PrivacyBudget", "poisson_cap", "CoordinatorNoise", "check_dp_strategy", "epsilon", "expected_batch",
    "site_sample_rate",
]


def private_step(strategy, layout: Layout, model, site_halves: Sequence, server, locals_: Sequence, noise: CoordinatorNoise, expected: float, step: int) -> tuple[Payload, int]:
    """One step of a one-phase exact strategy under DP, in process: the sites' uploads, the
    strategy's aggregate decoded at the coordinator (the clipped sum, never sent), and the
    noisy dense downlink every replica applies. Returns (downlink, bytes up)."""
    payloads = [half.begin(local, step) for half, local in zip(site_halves, locals_)]
    total = sum(p.num_samples for p in payloads)
    update = strategy.decode(layout, [server.aggregate(payloads)], model) if payloads else {}
    return noise.privatize(layout, update, total, expected, step), sum(p.nbytes() for p in payloads)
