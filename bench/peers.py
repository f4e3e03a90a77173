"""Our PowerSGD beside PyTorch DDP's ``powerSGD_hook``, same model, data, seed and optimizer.

Two DDP processes (gloo on 127.0.0.1) train the digits MLP with ``powerSGD_hook``
registered; each rank draws exactly the batches a site of the in-process simulation
draws (same partition, same per-site batch seed), and the model starts from the same
seeded weights. Our side is ``dadfl.simulation.simulate`` with ``powersgd`` and the
hook's settings (rank, ``start_iter`` = ``start_powerSGD_iter``, error feedback, warm
start, ``min_compression_rate``, seed). Compared per step: the training loss (mean over
both sites' batches), and the bytes per site:

- ours: exact payload bytes a site sends (up) and receives (down) per step;
- DDP: the bytes of the tensors each rank hands to ``all_reduce`` per step (counted by
  wrapping ``torch.distributed.all_reduce``). An all-reduce of b bytes moves about
  2·(p−1)/p·b per rank each way in a ring (= b for p = 2): the table states b.

``python -m bench.peers --out DIR`` writes ``DIR/peers.json``; the report adds a section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.server.processes import free_port
from dadfl.simulation import SimulationConfig, StrategySpec, simulate

from .execute import run_part
from .matrix import SGD

SITES = 2
WORKLOAD, OPTIONS = "digits-mlp", {"hidden": 256, "seed": 0}
STEPS, BATCH, SEED = 100, 32, 0
START_ITER = 2  # the hook requires start_powerSGD_iter > 1 with error feedback or warm start
RANKS = (1, 4)


def config(steps: int) -> SimulationConfig:
    return SimulationConfig(
        workload=WORKLOAD, workload_options=OPTIONS, sites=SITES, partition="iid", batch_size=BATCH, steps=steps,
        eval_every=steps, seed=SEED, device="cpu", optimizer=SGD, strategies=[StrategySpec(name="dsgd")],
    )


def hook_options(rank: int) -> dict:
    return {"rank": rank, "start_iter": START_ITER, "min_compression_rate": 2.0, "use_error_feedback": True,
            "warm_start": True, "seed": SEED}


def ours(rank: int, steps: int, folder: Path) -> dict:
    spec = StrategySpec(name="powersgd", options=hook_options(rank))
    path = folder / f"ours_r{rank}.jsonl"
    with MetricsWriter(path) as metrics:
        summary = simulate(config(steps), spec, metrics)
    records = list(read_metrics(path))
    return {
        "loss": [r["train_loss"] for r in records],
        "bytes_up_per_site": [r["bytes_up"] / SITES for r in records],
        "bytes_down_per_site": [r["bytes_down"] / SITES for r in records],
        "metric": summary["metric"],
    }


def ddp(rank: int, steps: int, folder: Path) -> dict:
    """Run the two DDP ranks (``bench.ddp_worker``) and collect what they wrote."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.ddp_worker", str(r), str(port), str(folder), json.dumps(
                {"rank": rank, "steps": steps, "config": config(steps).model_dump(), "hook": hook_options(rank)})],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for r in range(SITES)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"DDP worker failed:\n{out[-3000:]}")
    ranks = [json.loads((folder / f"ddp_r{rank}_rank{r}.json").read_text()) for r in range(SITES)]
    return {
        "loss": [sum(values) / SITES for values in zip(*(w["loss"] for w in ranks))],  # equal batches
        "allreduce_bytes_per_site": ranks[0]["allreduce_bytes"],
        "metric": ranks[0]["metric"],
    }


def compare(steps: int = STEPS, ranks: tuple[int, ...] = RANKS) -> dict:
    torch.set_num_threads(1)
    results = {"workload": WORKLOAD, "options": OPTIONS, "sites": SITES, "batch": BATCH, "steps": steps,
               "optimizer": SGD, "start_iter": START_ITER, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="dadfl-peers-") as tmp:
        folder = Path(tmp)
        for rank in ranks:
            a, b = ours(rank, steps, folder), ddp(rank, steps, folder)
            gaps = [abs(x - y) for x, y in zip(a["loss"], b["loss"])]
            results["runs"][str(rank)] = {"ours": a, "ddp": b, "max_loss_gap": max(gaps), "final_loss_gap": gaps[-1]}
    return results


def main(argv: list[str] | None = None) -> int:
    results = run_part(argv, "python -m bench.peers", __doc__, compare, "peers.json", STEPS)
    for rank, run in results["runs"].items():
        print(f"r={rank}: final loss ours {run['ours']['loss'][-1]:.4f}, DDP hook {run['ddp']['loss'][-1]:.4f}, "
              f"max gap {run['max_loss_gap']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
