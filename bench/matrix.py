"""What the benchmark measures: workload settings, strategy specs, and the cells they span.

A *cell* is one training run: one strategy on one workload setting with a number of
sites, a split and a seed. The seed drives everything random in the run: the model's
initial weights and the train/test split (workload ``seed``), the partition across
sites and every site's batch order (simulation ``seed``), and the random starts of the
low-rank strategies (strategy ``seed``).

The presets, which choose the settings and grids, are ``bench/presets.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from dadfl.simulation import StrategySpec
from dadfl.strategies.quantize import FULL_PRECISION

RANKS = (1, 2, 4, 8)
HEADLINE_SITES = 4  # each workload is judged on its 4-site IID group
DIRICHLET_ALPHA = 0.5
# rank-dAD also factors the layer that reads the raw input (PowerSGD compresses it too,
# so both compress the same layers); the default "dense" would send it as a gradient.
RANKDAD_RAW_INPUT = "low_rank"
# PowerSGD from the first step: dense warm-up steps would cost it dSGD's bytes.
POWERSGD_START_ITER = 0
# Strategies whose updates are dSGD's to float rounding: they run a setting's steps, which
# define the target; every other strategy runs steps × catch_up.
REFERENCE = ("dsgd", "dad", "auto", "edad")

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
# FedAvg and DiLoCo: local steps per round; one matrix step is one round (H local steps,
# H batches per site), and the same number of rounds runs as dSGD's steps, so their
# compute is H times dSGD's and the time-to-target tables charge it. FedAvg's inner
# optimizer is the setting's; DiLoCo's AdamW learning rate below, the outer Nesterov step
# the paper's (0.7, momentum 0.9).
LOCAL_STEPS = 8
DILOCO = {"inner_lr": 0.003}  # of {0.001, 0.003} on seed 0, IID: 98.2% against 97.6% after 200 rounds


@dataclass(frozen=True)
class WorkloadSetting:
    """One workload with its options, its training recipe and the grid it runs on."""

    key: str  # names the setting in paths, tables and plots
    workload: str  # built-in name or "module:factory"
    options: dict[str, Any]
    optimizer: dict[str, Any]
    steps: int
    eval_every: int
    batch_size: int
    sites: tuple[int, ...]
    partitions: tuple[str, ...]
    seeds: tuple[int, ...]
    feed_forward: bool = False  # an nn.Sequential MLP: edAD applies
    purpose: str = "matrix"  # "matrix" (the grid) or "target" (sized for the bytes target)
    note: str = ""
    ratio_target: bool = False  # judged on the ≥100× bytes target
    ablation: bool = True  # also run rank-dAD without error feedback
    local_steps: bool = False  # also run FedAvg and DiLoCo (LOCAL_STEPS local steps per round)
    # Steps the approximate strategies may take to reach dSGD's final metric, as a multiple of
    # ``steps``: where dSGD is still climbing steeply at its last step, a method a few steps
    # behind it per step never reaches the target within the same budget, and its bytes to
    # target would go unmeasured rather than be large.
    catch_up: int = 1
    # The widths rank-dAD's and PowerSGD's factors run at, each at every rank: below 32,
    # integer codes with a scale per column (``strategies/quantize.py``); 32: floats.
    factor_bits: tuple[int, ...] = (FULL_PRECISION,)
    ranks: tuple[int, ...] | None = None  # the low-rank strategies' ranks, if not the preset's
    # Ranks at which rank-dAD also runs with the sites' factors concatenated on the downlink
    # (``reduce_on_server=False``), at each width of ``factor_bits``.
    concatenated_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # The final metric of a strategy that runs on is read at ``steps``: that step must be on
        # its evaluation grid, or the analysis would fail only after the whole matrix ran.
        if self.catch_up < 1 or (self.catch_up > 1 and self.steps % self.eval_every):
            raise ValueError(
                f"setting {self.key}: catch_up={self.catch_up} needs catch_up ≥ 1 and, above 1, steps ({self.steps}) "
                f"a multiple of eval_every ({self.eval_every})"
            )


@dataclass(frozen=True)
class Cell:
    setting: WorkloadSetting
    sites: int
    partition: str
    seed: int
    strategy: StrategySpec = field(compare=False)

    @property
    def group(self) -> str:
        """Cells that differ only by seed share a group: ``<setting>/<sites>-<partition>``."""
        return f"{self.setting.key}/{self.sites}-{self.partition}"

    @property
    def name(self) -> str:
        return f"{self.group}/seed{self.seed}/{slug(self.strategy.display)}"

    @property
    def steps(self) -> int:
        if self.strategy.name in REFERENCE:
            return self.setting.steps
        return self.setting.steps * self.setting.catch_up


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_=." else "_" for c in text)


def strategy_specs(
    feed_forward: bool, ranks: tuple[int, ...] = RANKS, seed: int = 0, exact: bool = True, ablation: bool = True,
    local_steps: bool = False, factor_bits: tuple[int, ...] = (FULL_PRECISION,), concatenated: tuple[int, ...] = (),
) -> list[StrategySpec]:
    """dsgd; dad, auto, edad (feed-forward only) when ``exact``; rank-dAD with its defaults
    (error feedback, server re-reduction) and, with ``ablation``, without error feedback (as
    floats: codes need error feedback); rank-dAD with the sites' factors concatenated on the
    downlink at the ranks in ``concatenated`` (labelled *concat*); PowerSGD — every rank in
    ``ranks``, their factors at each width of ``factor_bits`` (labelled below 32); FedAvg and
    DiLoCo with ``local_steps``."""
    widths = [({}, "") if bits == FULL_PRECISION else ({"factor_bits": bits}, f" {bits}-bit") for bits in factor_bits]
    specs = [StrategySpec(name="dsgd")]
    if exact:
        specs += [StrategySpec(name="dad"), StrategySpec(name="auto")]
        if feed_forward:
            specs.append(StrategySpec(name="edad"))
    rankdad = {"reduce_on_server": True, "raw_input": RANKDAD_RAW_INPUT, "seed": seed}
    for rank in ranks:
        specs += [StrategySpec(name="rankdad", options={"rank": rank, "error_feedback": True, **rankdad, **bits},
                               label=f"rankdad r={rank}{suffix}") for bits, suffix in widths]
        if ablation:
            specs.append(StrategySpec(name="rankdad", options={"rank": rank, "error_feedback": False, **rankdad},
                                      label=f"rankdad r={rank} no EF"))
    for rank in concatenated:
        concat = {**rankdad, "reduce_on_server": False}
        specs += [StrategySpec(name="rankdad", options={"rank": rank, "error_feedback": True, **concat, **bits},
                               label=f"rankdad r={rank}{suffix} concat") for bits, suffix in widths]
    for rank in ranks:
        specs += [StrategySpec(name="powersgd", options={"rank": rank, "start_iter": POWERSGD_START_ITER, "seed": seed, **bits},
                               label=f"powersgd r={rank}{suffix}") for bits, suffix in widths]
    if local_steps:
        specs += [
            StrategySpec(name="fedavg", options={"local_steps": LOCAL_STEPS}, label=f"fedavg H={LOCAL_STEPS}"),
            StrategySpec(name="diloco", options={"local_steps": LOCAL_STEPS, **DILOCO}, label=f"diloco H={LOCAL_STEPS}"),
        ]
    return specs


def cells(settings: list[WorkloadSetting], ranks: tuple[int, ...] = RANKS, exact: bool = True) -> list[Cell]:
    """Every cell, seed-major: a run cut short still has complete early seeds; the
    no-error-feedback ablation last."""
    found = []
    for setting in settings:
        for sites in setting.sites:
            for partition in setting.partitions:
                for seed in setting.seeds:
                    for spec in strategy_specs(setting.feed_forward, setting.ranks or ranks, seed, exact, setting.ablation,
                                               setting.local_steps, setting.factor_bits, setting.concatenated_ranks):
                        found.append(Cell(setting, sites, partition, seed, spec))
    return sorted(
        found,
        key=lambda c: (c.strategy.options.get("error_feedback") is False, c.seed, c.sites != HEADLINE_SITES,
                       c.partition != "iid"),
    )


def select(settings: list[WorkloadSetting], keys: list[str] | None, seeds: tuple[int, ...] | None) -> list[WorkloadSetting]:
    """Settings whose key is in ``keys`` (all when None), with ``seeds`` replacing theirs."""
    known = [s.key for s in settings]
    unknown = sorted(set(keys or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown workload setting(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    chosen = [s for s in settings if keys is None or s.key in keys]
    if seeds is not None:
        chosen = [replace(s, seeds=seeds) for s in chosen]
    return chosen


def iter_groups(settings: list[WorkloadSetting]) -> Iterator[tuple[WorkloadSetting, int, str]]:
    for setting in settings:
        for sites in setting.sites:
            for partition in setting.partitions:
                yield setting, sites, partition
