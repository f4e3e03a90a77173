"""Accuracy against ε under sample-level differential privacy (a benchmark, not a test).

    nice -n 10 python -m bench.bench_privacy [--steps 200] [--seeds 0 1 2] [--out bench-privacy.json]

For breast cancer (MLP) and digits (MLP), 4 IID sites, batch 32 per site, SGD 0.1 with
momentum 0.9, the in-process simulation runs dsgd, dad and rank-dAD (rank 4, raw input
as low-rank factors) without privacy, and dsgd and dad with [dp] at ε = 1, 3 and 8
(δ = 1e-5, max_grad_norm = 1, σ calibrated by Opacus's RDP accountant for the steps; Poisson
sampling at the sites). It reports held-out accuracy (mean ± std over seeds), ε reached,
σ, payload bytes per step up and down (all sites together) and milliseconds per step
(median over seeds; 4 sites one after another in one process). rank-dAD is refused with
[dp] (``dadfl.privacy`` says why), so it has non-private rows only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from dadfl.metrics import MetricsWriter
from dadfl.simulation import SimulationConfig, StrategySpec, simulate

WORKLOADS = {"breast-cancer-mlp": {}, "digits-mlp": {"hidden": 64}}
STRATEGIES = [("dsgd", {}), ("dad", {}), ("rankdad", {"rank": 4, "raw_input": "low_rank"})]
EPSILONS = (1.0, 3.0, 8.0)
PRIVATE = ("dsgd", "dad")


def run(workload: str, options: dict, strategy: str, strategy_options: dict, seed: int, steps: int, eps: float | None) -> dict:
    config = SimulationConfig(
        workload=workload, workload_options=options, sites=4, partition="iid", batch_size=32, steps=steps,
        eval_every=steps, seed=seed, device="cpu", strategies=[StrategySpec(name=strategy, options=strategy_options)],
        dp=None if eps is None else {"target_epsilon": eps, "max_grad_norm": 1.0, "delta": 1e-5},
    )
    with tempfile.TemporaryDirectory() as folder, MetricsWriter(Path(folder) / "metrics.jsonl") as metrics:
        return simulate(config, config.strategies[0], metrics)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for workload, options in WORKLOADS.items():
        for strategy, strategy_options in STRATEGIES:
            for eps in (None, *EPSILONS) if strategy in PRIVATE else (None,):
                runs = [run(workload, options, strategy, strategy_options, seed, args.steps, eps) for seed in args.seeds]
                accuracy = [r["metric"] for r in runs]
                rows.append({
                    "workload": workload, "strategy": strategy, "target_epsilon": eps,
                    "epsilon": runs[0].get("dp_epsilon"), "noise_multiplier": runs[0].get("dp_noise_multiplier"),
                    "accuracy_mean": statistics.mean(accuracy), "accuracy_std": statistics.pstdev(accuracy),
                    "bytes_up_per_step": runs[0]["bytes_up_per_step"], "bytes_down_per_step": runs[0]["bytes_down_per_step"],
                    "ms_per_step": 1000 * statistics.median(r["seconds_per_step"] for r in runs),
                    "steps": args.steps, "seeds": len(args.seeds),
                })
                print(table_row(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    print("\n".join(table(rows)))
    return rows


def table_row(row: dict) -> str:
    eps = "∞ (no DP)" if row["epsilon"] is None else f"{row['epsilon']:.2f}"
    sigma = "-" if row["noise_multiplier"] is None else f"{row['noise_multiplier']:.2f}"
    return (
        f"| {row['workload']} | {row['strategy']} | {eps} | {sigma} | {100 * row['accuracy_mean']:.1f} ± {100 * row['accuracy_std']:.1f} "
        f"| {row['bytes_up_per_step'] / 1024:.1f} | {row['bytes_down_per_step'] / 1024:.1f} | {row['ms_per_step']:.1f} |"
    )


def table(rows: list[dict]) -> list[str]:
    return [
        "| workload | strategy | ε | σ | accuracy % | KiB up/step | KiB down/step | ms/step |",
        "|---|---|---|---|---|---|---|---|",
        *(table_row(row) for row in rows),
    ]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
