"""Compute per step of each strategy's halves, in process on one torch thread (a benchmark, not a test).

    python -m bench.bench_compute [--steps 30] [--strategies rankdad:rank=2 powersgd:rank=2,start_iter=0]

The real-links benchmark (``bench/links.py``) charges every strategy its compute on
unshaped links; this splits that compute the way the runtime spends it, on the
``digits-mlp-wide`` setting (digits MLP, hidden 1024, 4 sites, IID, batch 32, SGD 0.1
momentum 0.9) with the matrix's options per strategy; ``--sites 1`` takes the first site's
share alone, as the links benchmark's one-site runs do. Per step, medians over the steps
after ``--warmup``:

- **local**: one site's forward/backward (mean over sites);
- **site**: one site's half, ``begin`` plus every ``receive`` (mean over sites);
- **server**: ``aggregate`` over every phase;
- **decode**: one replica's ``decode`` of the step's messages;
- **apply**: one replica's optimizer step and weights fingerprint;
- **step**: the critical path of one step when each site and the coordinator run in
  their own process: local + site + server + decode + apply.

The last column is the coordinator's fingerprint after the last step, so a change meant to
keep the floats can be checked for bit-identical results on the same command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dadfl.replica import OptimizerConfig, Replica
from dadfl.simulation import StrategySpec
from dadfl.workloads import load_workload, partition, site_batches

from .matrix import strategy_specs
from .presets import WIDE

SITES = WIDE.sites[0]  # the setting's 4 sites; --sites 1 keeps the first one's share
DEFAULT = [spec for spec in strategy_specs(feed_forward=True, ranks=(1, 2), exact=False, ablation=False)
           if spec.name in ("rankdad", "powersgd")]
PARTS = ("local", "site", "server", "decode", "apply")


def run(spec: StrategySpec, steps: int, warmup: int, sites_count: int = SITES, seed: int = 0) -> dict:
    """Per-part milliseconds per step (medians after ``warmup``) and the final fingerprint."""
    from dadfl.strategies import make_strategy

    workload = load_workload(WIDE.workload, **WIDE.options)
    strategy = make_strategy(spec.name, **spec.options)
    train = workload.training_data()
    indices = partition(SITES, len(train), "iid", labels=workload.labels, seed=seed)[:sites_count]
    batches = [site_batches(train, index, WIDE.batch_size, seed=seed + s) for s, index in enumerate(indices)]
    optimizer = OptimizerConfig(**WIDE.optimizer)
    coordinator = Replica(workload, strategy, optimizer)
    sites = [Replica(workload, strategy, optimizer) for _ in indices]
    for site in sites:
        site.load_weights_from(coordinator)
    server = strategy.server(coordinator.layout, coordinator.model)
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    fingerprint = ""
    for step in range(steps):
        spent = dict.fromkeys(PARTS, 0.0)
        locals_ = []
        for site, batch in zip(sites, batches):
            start = time.perf_counter()
            locals_.append(site.work(batch.at, step))
            spent["local"] += time.perf_counter() - start
        start = time.perf_counter()
        payloads = [site.half.begin(local, step) for site, local in zip(sites, locals_)]
        spent["site"] += time.perf_counter() - start
        messages = []
        while payloads:
            start = time.perf_counter()
            messages.append(server.aggregate(payloads))
            spent["server"] += time.perf_counter() - start
            start = time.perf_counter()
            replies = [site.half.receive(messages[-1]) for site in sites]
            spent["site"] += time.perf_counter() - start
            payloads = [reply for reply in replies if reply is not None]
        fingerprints = set()
        for replica in [*sites, coordinator]:
            start = time.perf_counter()
            update = replica.decode(messages)
            spent["decode"] += time.perf_counter() - start
            start = time.perf_counter()
            fingerprints.add(replica.apply_update(update))
            spent["apply"] += time.perf_counter() - start
        if len(fingerprints) != 1:
            raise RuntimeError(f"{spec.display}: replicas differ after step {step}")
        fingerprint = fingerprints.pop()
        per_replica = {"local": sites_count, "site": sites_count, "server": 1, "decode": sites_count + 1, "apply": sites_count + 1}
        for part in PARTS:
            times[part].append(1000 * spent[part] / per_replica[part])
    medians = {part: statistics.median(values[warmup:]) for part, values in times.items()}
    medians["step"] = sum(medians.values())
    return {"strategy": spec.display, **{f"{k}_ms": round(v, 2) for k, v in medians.items()}, "fingerprint": fingerprint}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--strategies", nargs="*", type=StrategySpec.parse, default=DEFAULT)
    parser.add_argument("--sites", type=int, choices=range(1, SITES + 1), default=SITES, help=f"sites taking part (default {SITES})")
    parser.add_argument("--json", action="store_true", help="one JSON object per strategy instead of a table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    columns = [f"{part}_ms" for part in (*PARTS, "step")]
    if not args.json:
        print(f"{'strategy':<16}" + "".join(f"{c:>11}" for c in columns) + "  fingerprint")
    for spec in args.strategies:
        row = run(spec, args.steps, args.warmup, args.sites)
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['strategy']:<16}" + "".join(f"{row[c]:>11.2f}" for c in columns) + f"  {row['fingerprint'][:16]}")


if __name__ == "__main__":
    main()
