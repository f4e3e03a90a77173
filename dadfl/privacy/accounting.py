"""``dadfl.privacy.accounting`` — the ``[dp]`` configuration, its public half sent to sites,
and the accountant: ε of the sampled Gaussian mechanism (σ, q, T, δ) by Opacus's RDP or PRV
accountant, and which strategies [dp] admits (the run as a whole: ``dadfl.privacy``).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Literal, Sequence

from pydantic import Field, model_validator

from dadfl.config import StrictModel
from dadfl.strategies import STRATEGIES

log = logging.getLogger("dadfl.privacy")


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
    """Refuse a strategy whose released update is not exactly the clipped sum (``Strategy.supports_dp``;
    ``dadfl.privacy``)."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if cls.supports_dp:
        return
    if cls.has_local_steps:
        why = ("its update is a model delta after several local steps, in which one record can act many times; "
               "per-sample clipping bounds one step's gradient, not that delta")
    else:
        why = ("its update is a low-rank approximation computed from the batch (with error-feedback memory), "
               "whose change when one record comes or goes max_grad_norm does not bound")
    raise ValueError(f"strategy {name!r} cannot run with [dp]: {why}, so no ε would hold; "
                     f"use one of {', '.join(dp_strategies())} (see docs/privacy.md)")


def dp_strategies() -> list[str]:
    """The registered strategies that can run with [dp]."""
    return [name for name, cls in STRATEGIES.items() if cls.supports_dp]


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
