"""Per-step records of every cell -> statistics over seeds, the targets, and dominance.

Definitions (the report states them too):

- **Bytes** are exact payload bytes. Per step, ``up`` sums what every site sent and
  ``down`` what every site received (each site's copy counted); per-site figures are
  these divided by the number of sites. *Total* = up + down.
- **Curves** are seed means: at every evaluation step, the mean held-out metric over
  seeds against the mean cumulative total bytes.
- **Final metric**: the held-out metric at the setting's last step (dSGD's), seed mean;
  strategies that run on (``catch_up``) are read at that same step.
- **Target** of a group (setting, sites, split): dSGD's final metric, seed mean, minus
  0.5 point (0.005 of accuracy). **Steps / bytes to target**: the first evaluation step
  at which a strategy's seed-mean curve reaches the target, and the cumulative bytes
  spent by then. *Reached* also counts the seeds whose own curve reaches it.
- **Dominance**. A family's envelope E(B) is the best seed-mean metric any of its
  configurations reached with at most B cumulative bytes (−∞ before its first
  evaluation). Family X dominates family Y when E_X(B) ≥ E_Y(B) at every budget B from
  the smallest evaluated budget of either family up to the largest budget both reached
  (envelopes are step functions, so checking every evaluated budget in that range is
  exact). ``fraction`` is the share of those budgets where E_X ≥ E_Y, ``worst_gap`` the
  smallest E_X − E_Y there.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dadfl.metrics import read_metrics
from dadfl.simulation import StrategySpec

from .costs import breakdown, round_trips
from .execute import cell_paths, finished_as_now
from .matrix import Cell, WorkloadSetting

TARGET_TOLERANCE = 0.005  # 0.5 point of accuracy
UNRECORDED_MACHINE = "not recorded"  # runs written before cells recorded their machine
FAMILIES = {"rank-dAD": "rankdad", "PowerSGD": "powersgd"}


@dataclass
class Run:
    """One finished cell, reduced to what the statistics need."""

    summary: dict
    eval_steps: list[int]  # steps done (1-based) at each evaluation
    metric: list[float]
    cumulative_bytes: list[float]  # total bytes (up + down, all sites) spent by each evaluation
    bytes_up: float  # mean per step, all sites
    bytes_down: float
    seconds: float  # median per step
    ranks: dict[str, list[float]]  # effective rank per layer, per step


def load_run(summary_path: Path) -> Run:
    summary = json.loads(summary_path.read_text())
    key = f"test_{summary['metric_name']}"
    eval_steps, metric, cumulative, spent = [], [], [], 0.0
    ups, downs, seconds = [], [], []
    ranks: dict[str, list[float]] = defaultdict(list)
    for record in read_metrics(summary_path.with_suffix(".jsonl")):
        spent += record["bytes_up"] + record["bytes_down"]
        ups.append(record["bytes_up"])
        downs.append(record["bytes_down"])
        seconds.append(record["seconds"])
        for name, value in record.items():
            # rank-dAD's update: the components holding 99% of its energy (``rank99/<layer>/update``);
            # runs recorded before that key logged the components above 1e-3 of the largest (``rank/<layer>``).
            if name.startswith("rank99/") and name.endswith("/update"):
                ranks[name[len("rank99/"):-len("/update")]].append(value)
            elif name.startswith("rank/"):
                ranks[name[len("rank/"):]].append(value)
        if key in record:
            eval_steps.append(record["step"] + 1)
            metric.append(record[key])
            cumulative.append(spent)
    return Run(summary, eval_steps, metric, cumulative, mean(ups), mean(downs), statistics.median(seconds), dict(ranks))


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def spread(values) -> float:
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class StrategyStats:
    label: str
    name: str
    options: dict
    seeds: int
    up_per_site: float  # bytes per step
    down_per_site: float
    total_per_step: float  # up + down, all sites
    round_trips: int
    final_mean: float
    final_std: float
    seconds_mean: float
    seconds_std: float
    curve_steps: list[int]
    curve_metric: list[float]
    curve_metric_std: list[float]
    curve_bytes: list[float]
    ranks: dict[str, list[float]]  # seed-mean effective rank per layer per step
    steps_to_target: int | None = None
    bytes_to_target: float | None = None
    seeds_reached: int = 0
    steps_to_target_per_seed: list[int | None] = field(default_factory=list)
    bytes_ratio_vs_dsgd: float | None = None  # dSGD's bytes to target / this strategy's


def strategy_stats(runs: list[Run], trips: int, final_step: int) -> StrategyStats:
    """Statistics over seeds; the final metric is the one at ``final_step`` (the setting's steps,
    dSGD's last), also for a strategy that ran on to catch up."""
    first = runs[0].summary
    spec = StrategySpec(**first["spec"])
    steps = runs[0].eval_steps
    if any(run.eval_steps != steps for run in runs):
        raise ValueError(f"{first['group']}/{spec.display}: seeds evaluated at different steps")
    if final_step not in steps:
        raise ValueError(f"{first['group']}/{spec.display}: no evaluation at step {final_step}, the setting's last")
    sites = first["sites"]
    finals = [run.metric[steps.index(final_step)] for run in runs]
    layers = sorted({name for run in runs for name in run.ranks})
    ranks = {
        name: [mean(values) for values in zip(*(run.ranks[name] for run in runs if name in run.ranks))] for name in layers
    }
    return StrategyStats(
        label=spec.display,
        name=spec.name,
        options=spec.options,
        seeds=len(runs),
        up_per_site=mean(run.bytes_up for run in runs) / sites,
        down_per_site=mean(run.bytes_down for run in runs) / sites,
        total_per_step=mean(run.bytes_up + run.bytes_down for run in runs),
        round_trips=trips,
        final_mean=mean(finals),
        final_std=spread(finals),
        seconds_mean=mean(run.seconds for run in runs),
        seconds_std=spread(run.seconds for run in runs),
        curve_steps=steps,
        curve_metric=[mean(v) for v in zip(*(run.metric for run in runs))],
        curve_metric_std=[spread(v) for v in zip(*(run.metric for run in runs))],
        curve_bytes=[mean(v) for v in zip(*(run.cumulative_bytes for run in runs))],
        ranks=ranks,
    )


def first_reaching(values: list[float], target: float) -> int | None:
    return next((i for i, value in enumerate(values) if value >= target), None)


def apply_target(stats: StrategyStats, runs: list[Run], target: float) -> None:
    index = first_reaching(stats.curve_metric, target)
    if index is not None:
        stats.steps_to_target = stats.curve_steps[index]
        stats.bytes_to_target = stats.curve_bytes[index]
    per_seed = [first_reaching(run.metric, target) for run in runs]
    stats.steps_to_target_per_seed = [None if i is None else stats.curve_steps[i] for i in per_seed]
    stats.seeds_reached = sum(i is not None for i in per_seed)


# ------------------------------------------------------------------------ dominance


Curve = tuple[list[float], list[float], list[float]]  # cumulative bytes, seed-mean metric, its standard error


def envelope(curves: list[Curve]) -> list[tuple[float, float, float]]:
    """(budget, best metric reached within it, that metric's standard error) at every evaluated
    budget, ascending."""
    points = sorted((b, m, e) for bytes_, metric, errors in curves for b, m, e in zip(bytes_, metric, errors))
    best, error, out = -math.inf, 0.0, []
    for budget, value, value_error in points:
        if value > best:
            best, error = value, value_error
        out.append((budget, best, error))
    return out


def best_within(env: list[tuple[float, float, float]], budget: float) -> tuple[float, float]:
    best = (-math.inf, 0.0)
    for point, value, error in env:
        if point > budget:
            break
        best = (value, error)
    return best


def dominance(ours: list[Curve], theirs: list[Curve]) -> dict:
    """Whether our envelope is ≥ theirs at every budget (``dominates``), and how far theirs
    leads where it does, in standard errors of the difference of the two seed means
    (``largest_lead_se``: 0 when it never leads, ∞ before our first evaluation or where
    neither mean varies over seeds); ``within_noise``: it never leads by more than one."""
    a, b = envelope(ours), envelope(theirs)
    if not a or not b:
        return {"dominates": None, "fraction": None, "worst_gap": None, "budgets": 0, "largest_lead_se": None,
                "within_noise": None}
    high = min(a[-1][0], b[-1][0])
    budgets = sorted({point for point, _, _ in a + b if point <= high})
    gaps, leads = [], [0.0]
    for budget in budgets:
        (value_a, error_a), (value_b, error_b) = best_within(a, budget), best_within(b, budget)
        gaps.append(value_a - value_b)
        if value_a < value_b:
            error = math.hypot(error_a, error_b)
            leads.append((value_b - value_a) / error if error > 0 and math.isfinite(value_a) else math.inf)
    finite = [gap for gap in gaps if math.isfinite(gap)]
    return {
        "dominates": all(gap >= 0 for gap in gaps),
        "fraction": sum(gap >= 0 for gap in gaps) / len(gaps),
        "worst_gap": min(finite) if finite else None,
        "budgets": len(budgets),
        "range": [budgets[0], high],
        "largest_lead_se": max(leads),
        "within_noise": max(leads) <= 1.0,
    }


def family_curves(strategies: dict[str, StrategyStats], name: str, **options) -> list[Curve]:
    return [
        (s.curve_bytes, s.curve_metric, [std / math.sqrt(s.seeds) for std in s.curve_metric_std])
        for s in strategies.values()
        if s.name == name and all(s.options.get(k) == v for k, v in options.items())
    ]


def group_dominance(strategies: dict[str, StrategyStats]) -> dict:
    """rank-dAD with error feedback (all its ranks) against PowerSGD (all ranks), and rank
    by rank (rank-dAD with and without error feedback)."""
    result = {
        "family": dominance(
            family_curves(strategies, "rankdad", error_feedback=True), family_curves(strategies, "powersgd")
        )
    }
    ranks = sorted({s.options["rank"] for s in strategies.values() if s.name == "powersgd"})
    for rank in ranks:
        for error_feedback in (True, False):
            ours = family_curves(strategies, "rankdad", rank=rank, error_feedback=error_feedback)
            if ours:
                theirs = family_curves(strategies, "powersgd", rank=rank)
                result[f"r={rank}{'' if error_feedback else ' no EF'}"] = dominance(ours, theirs)
    return result


# ------------------------------------------------------------------------ everything

STRATEGY_ORDER = ("dsgd", "dad", "auto", "edad", "rankdad", "powersgd", "fedavg", "diloco")


def matrix_order(spec: dict) -> tuple:
    """Tables list strategies as the matrix does: exact ones, rank-dAD, PowerSGD, local steps; by
    rank, floats before codes; rank-dAD's concatenated downlink after its re-reduced one."""
    name, options = spec["name"], spec["options"]
    known = STRATEGY_ORDER.index(name) if name in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return (known, options.get("reduce_on_server") is False, options.get("rank", 0), "factor_bits" in options,
            options.get("error_feedback") is False)



def analyse(out: Path, settings: list[WorkloadSetting], cells: list[Cell], size_sweep: bool = False) -> dict[str, Any]:
    """Read the finished runs of ``cells`` under ``out`` (a run left there by another matrix,
    or of another length or grid, is not read) and return the statistics (JSON-ready);
    ``size_sweep`` adds the per-step bounds of the ``SIZE_SWEEP`` models."""
    by_group: dict[str, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for cell in sorted(cells, key=lambda c: c.name):
        summary_path = cell_paths(out, cell)[1]
        if not finished_as_now(summary_path, cell):
            continue
        run = load_run(summary_path)
        by_group[run.summary["group"]][StrategySpec(**run.summary["spec"]).display].append(run)
    by_key = {setting.key: setting for setting in settings}
    trips_cache: dict[tuple[str, str], int] = {}
    groups = {}
    for group, labelled in sorted(by_group.items()):
        first = next(iter(labelled.values()))[0].summary
        setting = by_key.get(first["setting"])
        if setting is None:
            continue  # results of a setting no longer in the matrix
        strategies = {}
        for label, runs in sorted(labelled.items(), key=lambda item: matrix_order(item[1][0].summary["spec"])):
            spec = StrategySpec(**runs[0].summary["spec"])
            key = (setting.key, label)
            if key not in trips_cache:
                trips_cache[key] = round_trips(setting.workload, {**setting.options, "seed": 0}, spec)
            strategies[label] = strategy_stats(runs, trips_cache[key], setting.steps)
        target = None
        if "dsgd" in strategies:
            target = strategies["dsgd"].final_mean - TARGET_TOLERANCE
            for label, runs in labelled.items():
                apply_target(strategies[label], runs, target)
            reference = strategies["dsgd"].bytes_to_target
            for stats in strategies.values():
                if reference and stats.bytes_to_target:
                    stats.bytes_ratio_vs_dsgd = reference / stats.bytes_to_target
        every_run = [run for runs in labelled.values() for run in runs]
        groups[group] = {
            "setting": setting.key,
            "sites": first["sites"],
            "partition": first["partition"],
            "metric_name": first["metric_name"],
            "target": target,
            "strategies": {label: asdict(stats) for label, stats in strategies.items()},
            "dominance": group_dominance(strategies),
            "runs": len(every_run),
            "run_seconds": sum(run.summary["wall_seconds"] for run in every_run),
            "machines": dict(Counter(run.summary.get("machine", UNRECORDED_MACHINE) for run in every_run).most_common()),
        }
    costs = {}
    for setting in settings:
        parts = breakdown(setting.workload, {**setting.options, "seed": 0})
        costs[setting.key] = {
            "parameters": parts.parameters,
            "dense": parts.dense,
            "always_dense": parts.always_dense,
            "uncovered": parts.uncovered,
            "layers": [asdict(layer) | {"weight": layer.weight} for layer in parts.layers],
            "low_rank": {str(r): parts.low_rank(r) for r in (1, 2, 4, 8)},
            # at the narrowest width the setting runs: what none of its strategies can beat
            "bound": {str(r): parts.bound(r, factor_bits=min(setting.factor_bits)) for r in (1, 2, 4, 8)},
            "bound_raw_input_dense": {
                str(r): parts.bound(r, raw_input_dense=True, factor_bits=min(setting.factor_bits)) for r in (1, 2, 4, 8)
            },
            "bound_rank_zero": parts.bound_rank_zero,
        }
    sizes = [size_bound(workload, options) for workload, options in SIZE_SWEEP] if size_sweep else []
    failed = sorted(cell.name for cell in cells if cell_paths(out, cell)[0].with_suffix(".failed").exists())
    return {
        "groups": groups, "costs": costs, "sizes": sizes, "failed": failed, "settings": [asdict(s) for s in settings],
        **totals(groups),
    }


def totals(groups: dict[str, dict]) -> dict[str, Any]:
    """Runs, their process-seconds and the machines they ran on, over ``groups``."""
    machines: Counter[str] = Counter()
    for group in groups.values():
        machines.update(group["machines"])
    return {
        "cells": sum(group["runs"] for group in groups.values()),
        "cell_seconds": sum(group["run_seconds"] for group in groups.values()),
        "machines": dict(machines.most_common()),
    }


# Model sizes whose per-step bound the report tabulates (built, never trained).
SIZE_SWEEP = [
    *(("digits-mlp", {"hidden": hidden}) for hidden in (256, 1024, 2048)),
    *(("char-transformer", {"seq_len": 16, "d_model": d, "layers": layers}) for layers in (2, 4) for d in (64, 128, 256, 512, 1024)),
]


def size_bound(workload: str, options: dict) -> dict:
    parts = breakdown(workload, options)
    return {
        "workload": workload, "options": options, "parameters": parts.parameters,
        "always_dense_share": parts.always_dense / parts.dense,
        "bound": {str(r): parts.bound(r) for r in (1, 8)}, "bound_rank_zero": parts.bound_rank_zero,
    }


CSV_COLUMNS = (
    "setting", "sites", "partition", "strategy", "seeds", "round_trips", "up_per_site", "down_per_site",
    "total_per_step", "final_mean", "final_std", "target", "steps_to_target", "seeds_reached", "bytes_to_target",
    "bytes_ratio_vs_dsgd", "seconds_mean", "seconds_std",
)


def write_results(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``results.json`` (everything, curves included) and ``results.csv`` (one row per
    group and strategy)."""
    json_path, csv_path = out / "results.json", out / "results.csv"
    json_path.write_text(json.dumps(results, indent=1))
    lines = [",".join(CSV_COLUMNS)]
    for group in results["groups"].values():
        for label, stats in group["strategies"].items():
            row = {**group, **stats, "strategy": label}
            lines.append(",".join(_csv(row.get(column)) for column in CSV_COLUMNS))
    csv_path.write_text("\n".join(lines) + "\n")
    return json_path, csv_path


def _csv(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return f'"{text}"' if "," in text else text
