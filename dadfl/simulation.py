"""``dadfl.simulation`` — in-process federation: N sites and a coordinator in one process, one replica each.

Every site has its own model replica, optimizer, data partition and strategy site half;
the coordinator has a replica and the server half. Payloads go through the same
``exchange`` loop the networked runtime implements over gRPC, so the same strategy code
runs in every mode. After every step all replicas must hold bit-identical weights
(checked by fingerprint); a mismatch stops the run.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from dadfl.strategies import exchange, make_strategy
from dadfl.strategies.introspect import gradient_ranks
from dadfl.strategies.robust import DEFAULT_AGREEMENT_MARGIN, DEFAULT_CLIP_RATIO, DEFAULT_MOMENTUM, FULL_COUNT_SHARE, check_clip_ratio
from dadfl.workloads import load_workload, partition, site_batches
from dadfl.workloads.batches import PoissonBatches, SplitDataset

from .config import Precision, StrictModel
from .metrics import MetricsWriter, is_eval_step, run_summary
from .privacy.accounting import DPConfig, PrivacyBudget, check_dp_strategy, expected_batch, log_plan, site_sample_rate
from .privacy.coordinator import CoordinatorNoise, private_step
from .records import StepRecord
from .replica import OptimizerConfig, Replica, check_dp_precision, resolve_device
from .trust.screening import Screening


log = logging.getLogger("dadfl.simulation")


class StrategySpec(StrictModel):
    """A strategy by name with its options; ``label`` names it in tables and plots."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)
    label: str = ""

    @property
    def display(self) -> str:
        if self.label:
            return self.label
        suffix = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}({suffix})" if suffix else self.name

    def raw_input_exposure(self) -> str:
        """What this strategy sends the coordinator of a layer that reads the raw input."""
        strategy = make_strategy(self.name, **self.options)
        policy = getattr(strategy, "raw_input", None)
        if strategy.has_local_steps:
            return "part of a model delta"
        if not strategy.exact:  # low rank: A and Δ never leave a site, "activations" allows factors
            return "its dense gradient" if policy == "dense" else "a rank-r projection of its gradient"
        return "raw activations" if policy == "activations" else "its dense gradient"

    @classmethod
    def parse(cls, text: str) -> "StrategySpec":
        """``"rankdad:rank=4,reduce_on_server=true"`` -> name and typed options."""
        name, _, rest = text.strip().partition(":")
        options = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"strategy option {item!r} in {text!r} must look like key=value")
            options[key.strip()] = _parse_value(value.strip())
        return cls(name=name, options=options)


def _parse_value(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# The demo's comparison, at equal exposure: no raw input leaves a site (dad, auto and edad send
# the raw-input layer's dense gradient), rank-dAD and PowerSGD send the same rank-r projection of
# every layer's gradient (the one raw-input policy, ``raw_input="low_rank"``), as floats and as
# the 8-bit codes the benchmarks recommend; PowerSGD compresses from step 0, as benchmarked.
DEMO_RANK = 4
DEMO_STRATEGIES = (
    StrategySpec(name="dsgd", label="dSGD"),
    StrategySpec(name="dad", label="dAD"),
    StrategySpec(name="auto", label="auto"),
    StrategySpec(name="edad", label="edAD"),
    StrategySpec(name="rankdad", options={"rank": DEMO_RANK}, label=f"rank-dAD r={DEMO_RANK}"),
    StrategySpec(name="rankdad", options={"rank": DEMO_RANK, "factor_bits": 8}, label=f"rank-dAD r={DEMO_RANK} 8-bit"),
    StrategySpec(name="powersgd", options={"rank": DEMO_RANK, "start_iter": 0}, label=f"PowerSGD r={DEMO_RANK}"),
    StrategySpec(name="powersgd", options={"rank": DEMO_RANK, "start_iter": 0, "factor_bits": 8},
                 label=f"PowerSGD r={DEMO_RANK} 8-bit"),
)


class SimulationConfig(StrictModel):
    workload: str = "digits-mlp"
    workload_options: dict[str, Any] = Field(default_factory=dict)
    workload_path: list[Path] = Field(default_factory=list, description="folders searched for a workload module outside the project")
    sites: int = Field(4, ge=1)
    partition: Literal["iid", "dirichlet", "quantity"] = "iid"
    alpha: float = Field(0.5, gt=0)
    batch_size: int = Field(32, ge=1, description="samples per site per step")
    steps: int = Field(300, ge=1)
    eval_every: int = Field(50, ge=1)
    seed: int = Field(0, ge=0, lt=2**63, description="seeds the data split, the batches and the strategies")
    device: str = "auto"
    threads: int = Field(1, ge=1, description="torch CPU threads; sites run one after another, and small models run fastest on one")
    precision: Precision = Field("fp32", description="autocast of every site's forward/backward: fp32 (none), bf16 or fp16 (loss-scaled)")
    optimizer: OptimizerConfig = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)
    strategies: list[StrategySpec] = Field(default_factory=lambda: list(DEMO_STRATEGIES))

    clip_ratio: float = Field(
        DEFAULT_CLIP_RATIO, description="bounded influence as the coordinator applies it (federation.clip_ratio, "
        "docs/robustness.md): each site's update scaled down to this multiple of the others' median norm; 0: off"
    )
    agreement: bool = Field(True, description="bounded influence: weight 0 for a site against the majority (federation.agreement)")
    agreement_margin: float = Field(
        DEFAULT_AGREEMENT_MARGIN, ge=0, le=10, description="how much more than its peers a site may push back (federation.agreement_margin)"
    )
    agreement_momentum: float = Field(
        DEFAULT_MOMENTUM, ge=0, lt=1, description="agreement on each site's momentum of its updates (federation.agreement_momentum); 0: each step alone"
    )
    full_count_share: float = Field(
        FULL_COUNT_SHARE, ge=0, le=1, description="a kept site keeping less of its peers' pull counts less in the mean "
        "(federation.full_count_share); 0: every kept site counts whole"
    )
    phase_timeout_s: float = Field(60.0, gt=0, description="--mode processes: how long the coordinator waits for a site's "
                                   "payload (federation.phase_timeout_s); raise it for a large model on a busy CPU")
    rank_every: int = Field(5, ge=0, description="read the effective rank of each site's gradient and of their sum off the factors "
                            "every this many steps (strategies/introspect.py; factor strategies; each reading costs about "
                            "what the sites' forward/backward passes cost on the digits MLP); 0: never")
    dp: DPConfig | None = Field(None, description="sample-level differential privacy (docs/privacy.md); off when absent")

    _clip_ratio = field_validator("clip_ratio")(check_clip_ratio)

    @field_validator("strategies")
    @classmethod
    def _known_strategies(cls, specs: list[StrategySpec]) -> list[StrategySpec]:
        for spec in specs:
            make_strategy(spec.name, **spec.options)  # raises with the valid names/options
        return specs

    @field_validator("dp")
    @classmethod
    def _private_strategies(cls, dp: DPConfig | None, info: ValidationInfo) -> DPConfig | None:
        if dp is not None:
            for spec in info.data.get("strategies", []):
                check_dp_strategy(spec.name)
            check_dp_precision(info.data.get("precision", "fp32"))
        return dp


class ReplicaDivergence(RuntimeError):
    """Replicas applied the same messages but ended with different weights."""


Progress = Callable[[int], None]


def simulate(
    config: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter, progress: Progress | None = None
) -> dict[str, Any]:
    """Train one strategy for ``config.steps`` steps; write one record per step; return a summary."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _simulate(config, spec, metrics, progress)
    finally:
        torch.set_num_threads(threads)


def _simulate(config: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter, progress: Progress | None) -> dict[str, Any]:
    device = resolve_device(config.device)
    workload = load_workload(config.workload, config.workload_path, **config.workload_options)
    strategy = make_strategy(spec.name, **spec.options)
    train = workload.training_data()
    indices = partition(
        config.sites, len(train), config.partition, labels=workload.labels, alpha=config.alpha, seed=config.seed
    )
    dp, budget = config.dp, None
    if dp is None:
        batches = [site_batches(train, index, config.batch_size, seed=config.seed + s) for s, index in enumerate(indices)]
    else:
        rates = [site_sample_rate(config.batch_size, len(index)) for index in indices]
        batches = [PoissonBatches(SplitDataset(train, index), rate, config.seed + s) for s, (index, rate) in enumerate(zip(indices, rates))]
        budget = PrivacyBudget.resolve(dp, max(rates), config.steps)
        noise = CoordinatorNoise(budget, seed=config.seed)  # seeded: a simulation is a reproducible experiment
        expected = expected_batch(config.batch_size, [len(index) for index in indices])
        log_plan(budget, config.steps)
    last_step = budget.max_steps(config.steps) if budget is not None else config.steps
    clip = dp.max_grad_norm if dp else None
    coordinator = Replica(workload, strategy, config.optimizer, device, max_grad_norm=clip, precision=config.precision)
    sites = [Replica(workload, strategy, config.optimizer, device, max_grad_norm=clip, precision=config.precision) for _ in indices]
    for site in sites:
        site.load_weights_from(coordinator)
    server = strategy.server(coordinator.layout, coordinator.model)
    # The coordinator's robust weights, as a networked run applies them (off under [dp], as there).
    screening = Screening(
        coordinator, math.inf, None, clip_ratio=config.clip_ratio, agreement=config.agreement, agreement_margin=config.agreement_margin,
        momentum=config.agreement_momentum, full_count_share=config.full_count_share,
    )
    names = [f"site-{s}" for s in range(len(sites))]
    has_test = workload.test is not None and len(workload.test) > 0

    def introspects(step: int) -> bool:  # not under DP: its records would carry more than ε accounts for
        return budget is None and config.rank_every > 0 and step % config.rank_every == 0

    records: list[dict[str, Any]] = []
    for step in range(config.steps):
        if step + 1 > last_step:
            log.info("%s: stopping after %d steps: one more would take ε above %g", spec.display, step, budget.stop_epsilon)
            break
        start = time.perf_counter()
        if budget is None:
            locals_ = [site.work(batch.at, step) for site, batch in zip(sites, batches)]
            messages, traffic = exchange([site.half for site in sites], server, locals_, step, functools.partial(screening.weigh, sites=names))
            bytes_up, bytes_down = traffic.up_total, traffic.down_per_site * len(sites)
        else:
            drawn = [batch.at(step) for batch in batches]
            present = [s for s, (_, targets) in enumerate(drawn) if len(targets)]  # a Poisson draw may be empty
            locals_ = [sites[s].local(*drawn[s]) for s in present]
            downlink, bytes_up = private_step(
                strategy, coordinator.layout, coordinator.model, [sites[s].half for s in present], server, locals_, noise, expected, step,
            )
            messages, bytes_down = [downlink], downlink.nbytes() * len(sites)
        fingerprints = {replica.apply(messages) for replica in [*sites, coordinator]}
        elapsed = time.perf_counter() - start
        if len(fingerprints) != 1:
            raise ReplicaDivergence(f"{spec.display}: replicas differ after step {step}")
        samples = sum(local.num_samples for local in locals_)
        record = StepRecord(
            strategy=spec.display,
            step=step,
            sites=len(sites),
            samples=samples,
            train_loss=sum(local.loss_sum for local in locals_) / samples if samples else float("nan"),
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            seconds=elapsed,
            fingerprint=fingerprints.pop(),
            diagnostics={
                **(strategy.describe(coordinator.layout, messages) if budget is None else {}),
                **screening.commit(step, names),
                **(gradient_ranks(coordinator.layout, [local.factors for local in locals_]) if introspects(step) else {}),
            },
        )
        evaluates = is_eval_step(step, config.eval_every, config.steps) or step + 1 == last_step  # the model released
        if budget is not None and evaluates:  # the last step is an eval step (is_eval_step)
            record.dp_epsilon = budget.epsilon(step + 1)
        if has_test and evaluates:
            record.evaluation.update({f"test_{k}": v for k, v in coordinator.evaluate().items()})
        row = record.to_json()
        metrics.write(row)
        records.append(row)
        if progress:
            progress(step)
    summary = run_summary(records, spec.display, workload.metric_name)
    if budget is not None:
        summary.update(budget.summary(len(records)))
        log.info("%s: (ε = %.3g, δ = %g)-differentially private after %d steps", spec.display, summary["dp_epsilon"], budget.delta, len(records))
    return summary


def run_directory(root: str | Path, name: str | None = None) -> Path:
    """A new run folder under ``root``: ``<root>/<timestamp>`` unless ``name`` is given."""
    path = Path(root) / (name or time.strftime("%Y%m%d-%H%M%S"))
    suffix, candidate = 1, path
    while candidate.exists():
        candidate = path.with_name(f"{path.name}-{suffix}")
        suffix += 1
    candidate.mkdir(parents=True)
    return candidate
