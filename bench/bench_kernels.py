"""Replicas on other kernels: a real federation (``--mode processes``) in which one site
runs another machine's float kernels, against the same run on identical kernels.

Site 1's process gets ``ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2`` (no
vector units: what another CPU or another torch build computes), or with ``--cuda-site``
trains on the GPU; the coordinator and the other sites run this machine's CPU kernels. Per
strategy it prints the steps whose fingerprint differed at some site, the full states sent,
the bytes spent repairing replicas as a share of the run's wire bytes (up + down, every
site), and the final test metric of both runs. ``--check`` exits 1 when a run sent a full
state or spent more than 1% of its bytes on repairs.

    python -m bench.bench_kernels --steps 300 --sites 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.replica import OptimizerConfig
from dadfl.server import simulate_processes
from dadfl.simulation import SimulationConfig, StrategySpec

OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
STRATEGIES = {
    "dsgd": StrategySpec(name="dsgd"),
    "dad": StrategySpec(name="dad"),
    "edad": StrategySpec(name="edad"),
    "rankdad-r2": StrategySpec(name="rankdad", options={"rank": 2}),
    "powersgd-r2": StrategySpec(name="powersgd", options={"rank": 2}),
    "fedavg-h3": StrategySpec(name="fedavg", options={"local_steps": 3}),
    "diloco-h2": StrategySpec(name="diloco", options={"local_steps": 2, "inner_lr": 0.003}),
}


def run(config: SimulationConfig, spec: StrategySpec, site_env: dict | None = None, site_devices: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        with MetricsWriter(path) as metrics:
            summary = simulate_processes(config, spec, metrics, site_env=site_env, site_devices=site_devices)
        records = list(read_metrics(path))
    payload = sum(r["wire_bytes_up"] + r["wire_bytes_down"] for r in records)
    repair = sum(sum(r.get("repair_bytes_by_site", {}).values()) for r in records)
    return {
        "mismatched_steps": sum(1 for r in records if r["fingerprint_mismatches"]),
        "repair_bytes": repair,
        "full_states": sum(sum(r.get("full_states_by_site", {}).values()) for r in records),
        "wire_bytes": payload,
        "metric": summary["metric"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--cuda-site", action="store_true", help="site 1 trains on the GPU instead of other CPU kernels")
    parser.add_argument("--check", action="store_true", help="exit 1 on a full state or repairs over 1%% of the bytes")
    options = parser.parse_args(argv)
    config = SimulationConfig(
        workload="digits-mlp", workload_options={"hidden": options.hidden}, sites=options.sites, batch_size=32,
        steps=options.steps, eval_every=options.steps, device="cpu",
        optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), strategies=[STRATEGIES[options.strategies[0]]],
    )
    print(f"| strategy | steps | mismatched steps | full states | repair bytes | repair % of wire bytes | metric ({'CUDA site' if options.cuda_site else 'other kernels'}) | metric (same kernels) |")
    print("|---|---|---|---|---|---|---|---|")
    failed = []
    for name in options.strategies:
        other = run(config, STRATEGIES[name], *(({}, {1: "cuda"}) if options.cuda_site else ({1: OTHER_KERNELS}, None)))
        same = run(config, STRATEGIES[name])
        if other["full_states"] or other["repair_bytes"] > other["wire_bytes"] / 100:
            failed.append(name)
        print(
            f"| {name} | {options.steps} | {other['mismatched_steps']} | {other['full_states']} | {other['repair_bytes']} | "
            f"{100 * other['repair_bytes'] / other['wire_bytes']:.3f} | {other['metric']:.4f} | {same['metric']:.4f} |",
            flush=True,
        )
        print(json.dumps({"strategy": name, "other": other, "same": same}), flush=True)
    if options.check and failed:
        raise SystemExit(f"full states or repairs over 1% of the bytes: {', '.join(failed)}")


if __name__ == "__main__":
    main()
