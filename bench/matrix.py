"""What the benchmark measures: workload settings, strategy specs, and the cells they span.

A *cell* is one training run: one strategy on one workload setting with a number of
sites, a split and a seed. The seed drives everything random in the run: the model's
initial weights and the train/test split (workload ``seed``), the partition across
sites and every site's batch order (simulation ``seed``), and the random starts of the
low-rank strategies (strategy ``seed``).

Two presets:

- ``FULL``: the issue's matrix. Every workload runs 2, 4 and 8 sites, IID and
  Dirichlet(0.5) splits, two seeds per group, the character workloads on 16-character
  windows. ``digits-mlp-wide`` sizes the MLP for the ≥100x target (4 sites, both
  splits, sixteen seeds evaluated every 5 steps: the links' seconds to target are its
  steps to target, and a coarser grid or fewer seeds move them by ±20 steps; its cells
  take seconds each);
  ``char-transformer-3m`` is the ≥3M-parameter transformer (4 sites, IID, four seeds: two
  seeds of rank-dAD r=2 reached the target 50 steps apart).
- ``SMOKE``: every workload, two sites, a few steps, one seed, a subset of strategies:
  checks the whole pipeline in under two minutes on two cores.
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


def _grid(**overrides) -> dict[str, Any]:
    grid = {"sites": (2, 4, 8), "partitions": ("iid", "dirichlet"), "seeds": (0, 1)}
    grid.update(overrides)
    return grid


ADAM_GRU = {"name": "adam", "lr": 0.01}
ADAM_TRANSFORMER = {"name": "adam", "lr": 0.003}

TEXT = {"seq_len": 16}
# dSGD on the character workloads is still climbing steeply at 100 steps (char-gru 44% → 49%
# by 200): the approximate strategies may take 3× its steps to reach its final metric.
CATCH_UP = 3
# Settings judged on the ≥100× target run four seeds (see FULL above); the full matrix's wide
# MLP, whose steps to target also set the links' seconds to target, runs sixteen.
TARGET_SEEDS = (0, 1, 2, 3)
WIDE_SEEDS = tuple(range(16))
# 3.5M parameters: wide enough that the compressible matrices dominate (bound r=1 ≈ 140×).
TRANSFORMER_3M = {"seq_len": 16, "d_model": 384, "layers": 2}
# The wide MLP, the links' setting, also runs rank-dAD's and PowerSGD's factors as 8-bit codes,
# and rank-dAD with the sites' factors concatenated on the downlink at these ranks (fewer steps
# to the target for more bytes down: the choice on a link with latency), so the links' seconds
# to target weigh every configuration a hospital could pick.
INTEGER_BITS = 8
CONCATENATED_RANKS = (1, 2)

FULL: list[WorkloadSetting] = [
    WorkloadSetting("digits-mlp", "digits-mlp", {"hidden": 256}, SGD, 150, 10, 32, feed_forward=True, **_grid()),
    WorkloadSetting("digits-cnn", "digits-cnn", {}, SGD, 120, 10, 32, **_grid()),
    WorkloadSetting("char-gru", "bench.workloads:char_gru", TEXT, ADAM_GRU, 100, 10, 32, catch_up=CATCH_UP, **_grid()),
    WorkloadSetting(
        "char-transformer", "bench.workloads:char_transformer", TEXT, ADAM_TRANSFORMER, 100, 10, 32, catch_up=CATCH_UP,
        **_grid(),
    ),
    WorkloadSetting(
        "digits-mlp-wide", "digits-mlp", {"hidden": 1024}, SGD, 200, 5, 32, feed_forward=True, purpose="target",
        note="1.1M parameters, sized so the compressible matrices dominate; factors as floats and as "
        f"{INTEGER_BITS}-bit codes",
        ratio_target=True, local_steps=True, factor_bits=(FULL_PRECISION, INTEGER_BITS),
        concatenated_ranks=CONCATENATED_RANKS,
        **_grid(sites=(4,), seeds=WIDE_SEEDS),  # both splits and FedAvg/DiLoCo: the links' seconds to target use them
    ),
    WorkloadSetting(
        "char-transformer-3m", "bench.workloads:char_transformer", TRANSFORMER_3M, ADAM_TRANSFORMER, 100, 10, 32,
        purpose="target", note="3.5M parameters, sized so the compressible matrices dominate", ratio_target=True,
        ablation=False, catch_up=CATCH_UP, **_grid(sites=(4,), partitions=("iid",), seeds=TARGET_SEEDS),
    ),
]

# ``--preset rankdad-ef``: the evidence for rank-dAD with error feedback against PowerSGD —
# bytes to dSGD's target and envelope dominance on four workloads, 4 sites, IID, ranks
# 1, 2, 4; dSGD, rank-dAD and PowerSGD only; rank-dAD without error feedback on the two
# cheapest. Two seeds.
# Every setting is judged for dominance.
EF_RANKS = (1, 2, 4)
_EF_GRID = {"sites": (4,), "partitions": ("iid",), "purpose": "matrix"}
RANKDAD_EF: list[WorkloadSetting] = [
    WorkloadSetting("digits-mlp", "digits-mlp", {"hidden": 256}, SGD, 150, 10, 32, feed_forward=True, seeds=(0, 1),
                    **_EF_GRID),
    WorkloadSetting("digits-mlp-wide", "digits-mlp", {"hidden": 1024}, SGD, 200, 5, 32, feed_forward=True,
                    ratio_target=True, ablation=False, local_steps=True, note="1.1M parameters", seeds=TARGET_SEEDS,
                    **{**_EF_GRID, "partitions": ("iid", "dirichlet")}),
    WorkloadSetting("char-gru", "bench.workloads:char_gru", TEXT, ADAM_GRU, 300, 10, 32, seeds=(0, 1), catch_up=CATCH_UP,
                    note="300 steps: a later, higher target than the full matrix's 100", **_EF_GRID),
    WorkloadSetting("char-transformer-3m", "bench.workloads:char_transformer", TRANSFORMER_3M, ADAM_TRANSFORMER, 100,
                    10, 32, ratio_target=True, ablation=False, note="3.5M parameters", seeds=(0, 1), catch_up=CATCH_UP,
                    **_EF_GRID),
]

# ``--preset dominance``: target (b) measured finer than the full matrix does it (two seeds,
# an evaluation every 10 steps, where a single held-out sample or the byte position of an
# evaluation decides the verdict): the full matrix's four dominance workloads in the group
# judged (4 sites, IID), with eight seeds and an evaluation every 5 steps; dSGD, rank-dAD
# and PowerSGD only.
DOMINANCE_SEEDS = tuple(range(8))
DOMINANCE: list[WorkloadSetting] = [
    replace(setting, sites=(HEADLINE_SITES,), partitions=("iid",), seeds=DOMINANCE_SEEDS, eval_every=5, ablation=False)
    for setting in FULL if setting.purpose == "matrix"
]

# ``--preset integer-factors``: rank-dAD's and PowerSGD's factors as 8-bit codes (one
# float scale per column, the rounding carried by the error memories), dSGD as floats:
# the dominance preset's four workloads (target (b), every rank) and the two settings of
# the ≥100× target, 4 sites, the full matrix's seeds. The 3.5M transformer runs IID at
# ranks 2 and 4 (its cells take minutes each; rank 1 reached its target as floats on no
# seed). The wide MLP, the links' setting, runs as in the full matrix (both splits, floats and
# codes, rank-dAD's concatenated downlink) at ranks 1, 2 and 4, without the ablation and local
# steps: the links' seconds to target (``--parts links``) then weigh every configuration a
# hospital could pick, measured in one run.
TARGET_RANKS = (2, 4)
LINK_RANKS = (1, 2, 4)
_CODED = {"ablation": False, "local_steps": False}
INTEGER_FACTORS: list[WorkloadSetting] = [replace(setting, factor_bits=(INTEGER_BITS,)) for setting in DOMINANCE] + [
    replace(setting, partitions=("iid",), factor_bits=(INTEGER_BITS,), ranks=TARGET_RANKS,
            note=f"{setting.note}; factors as {INTEGER_BITS}-bit codes", **_CODED)
    if setting.key != "digits-mlp-wide" else
    replace(setting, ranks=LINK_RANKS, **_CODED)
    for setting in FULL if setting.ratio_target
]

# The setting the real-links and compute benchmarks run on: ≥1M parameters, rank-dAD's ≥100× target.
WIDE = next(setting for setting in RANKDAD_EF if setting.key == "digits-mlp-wide")

SMOKE: list[WorkloadSetting] = [
    WorkloadSetting("digits-mlp", "digits-mlp", {"hidden": 64}, SGD, 30, 5, 16, feed_forward=True, catch_up=2,
                    sites=(2,), partitions=("iid",), seeds=(0,)),
    WorkloadSetting("digits-cnn", "digits-cnn", {"channels": 8}, SGD, 12, 4, 16, sites=(2,), partitions=("dirichlet",), seeds=(0,)),
    WorkloadSetting("char-gru", "bench.workloads:char_gru", {"seq_len": 8, "hidden": 32, "embed": 16}, ADAM_GRU, 8, 4, 8,
                    sites=(2,), partitions=("dirichlet",), seeds=(0,)),
    WorkloadSetting("char-transformer", "bench.workloads:char_transformer", {"seq_len": 8, "d_model": 32, "layers": 1},
                    ADAM_TRANSFORMER, 8, 4, 8, sites=(2,), partitions=("iid",), seeds=(0,)),
]
SMOKE_RANKS = (2,)


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
