"""The ~100M-parameter setting in processes over the networked runtime (a benchmark, not a test).

    python -m bench.bench_large [--workload char-transformer-100m] [--options seq_len=32]
        [--sites 2] [--batch-size 2] [--steps 4] [--strategies dsgd rankdad:rank=4] [--device cpu]

Each strategy runs as ``dadfl sim --mode processes`` does (``simulate_processes``: one
coordinator and ``--sites`` site processes on loopback gRPC), in a child process of its own so
that the operating system's peak of its children (``getrusage(RUSAGE_CHILDREN).ru_maxrss``)
is the largest peak resident set of that strategy's coordinator and sites, exactly; a poller
reads each process's ``VmHWM`` every 0.2 s for the per-role figures. Reported per strategy:

- peak RSS of the coordinator and of the largest site, and the largest over all of them as a
  multiple of the model's state (weights, buffers and the optimizer's per-parameter state:
  Adam 3 × 4 bytes per parameter), the issue's target being ≤ 3;
- the first step's seconds over the median of the later steps' (target ≤ 3), and that median;
- payload bytes per step up and down (all sites) and wire bytes, and their ratio to dSGD's.

Keep ``--steps`` ≥ 3 (a first step and two steady ones). On two CPU cores the default run of
dSGD and rank-dAD takes about five minutes; ``bench/gpu_check.sh`` runs it with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.replica import OptimizerConfig
from dadfl.server.processes import simulate_processes
from dadfl.simulation import SimulationConfig, StrategySpec
from dadfl.workloads import load_workload

from .coordinator_process import rss_kib

POLL_S = 0.2
PHASE_TIMEOUT_S = 900.0  # a 100M-parameter step on a shared CPU can take minutes: never abort one for slowness
MIB = 1 << 20
OPTIMIZER_STATE_COPIES = {"adam": 2, "sgd": 1}  # per-parameter tensors: Adam's two moments, SGD's momentum


def state_bytes(workload: str, options: dict, optimizer: OptimizerConfig) -> int:
    """Bytes of weights, buffers and the optimizer's per-parameter state (built on the meta device)."""
    with torch.device("meta"):
        model = load_workload(workload, **options).build_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    copies = OPTIMIZER_STATE_COPIES[optimizer.name] if optimizer.name == "adam" or optimizer.momentum else 0
    return params * (1 + copies) + buffers


def role(pid: int) -> str | None:
    """``coordinator`` or ``site-NNN`` for a process of the simulation, from its command line."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    if "dadfl.server" in words:
        return "coordinator"
    if "dadfl.client" in words and "--config" in words:
        return Path(words[words.index("--config") + 1]).stem
    return None


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def poll_peaks(peaks: dict[str, int], stop: threading.Event) -> None:
    """The largest VmHWM seen of every simulation process, by role, until ``stop``."""
    while not stop.wait(POLL_S):
        for pid in children(os.getpid()):
            name = role(pid)
            if name is None:
                continue
            try:
                peaks[name] = max(peaks.get(name, 0), rss_kib(pid)["VmHWM"] * 1024)
            except (ProcessLookupError, KeyError):
                pass


def run_one(config: SimulationConfig, spec: StrategySpec, metrics_path: Path) -> dict:
    """One strategy's run in this process; its figures as a dict."""
    peaks: dict[str, int] = {}
    stop = threading.Event()
    poller = threading.Thread(target=poll_peaks, args=(peaks, stop), daemon=True)
    poller.start()
    with MetricsWriter(metrics_path) as metrics:
        simulate_processes(config, spec, metrics)
    stop.set()
    poller.join()
    records = [r for r in read_metrics(metrics_path) if "seconds" in r]
    seconds = [r["seconds"] for r in records]
    return {
        "strategy": spec.display,
        "peak_rss_by_process": peaks,
        "peak_rss_any": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "first_step_s": seconds[0],
        "steady_step_s": statistics.median(seconds[1:]),
        "bytes_up": statistics.median(r["bytes_up"] for r in records),
        "bytes_down": statistics.median(r["bytes_down"] for r in records),
        "wire_bytes": statistics.median(r["wire_bytes_up"] + r["wire_bytes_down"] for r in records),
        "steps": len(records),
    }


def table(results: list[dict], state: int) -> list[str]:
    """One line per strategy, under 80 columns: names are short, figures rounded."""
    reference = results[0]
    lines = [
        f"model state (weights + optimizer): {state / MIB:.0f} MiB; ratios against {reference['strategy']}",
        f"{'strategy':<16} {'coord':>6} {'site':>6} {'peak/':>6} {'1st/':>5} {'step':>6} {'bytes/':>9} {'bytes':>6} {'time':>5}",
        f"{'':<16} {'MiB':>6} {'MiB':>6} {'state':>6} {'stdy':>5} {'s':>6} {'step MB':>9} {'ratio':>6} {'ratio':>5}",
    ]
    for r in results:
        sites = [v for k, v in r["peak_rss_by_process"].items() if k != "coordinator"]
        per_step = r["bytes_up"] + r["bytes_down"]
        lines.append(
            f"{r['strategy'][:16]:<16} {r['peak_rss_by_process'].get('coordinator', 0) / MIB:>6.0f} {max(sites, default=0) / MIB:>6.0f} "
            f"{r['peak_rss_any'] / state:>6.2f} {r['first_step_s'] / r['steady_step_s']:>5.2f} {r['steady_step_s']:>6.2f} "
            f"{per_step / 1e6:>9.2f} {per_step / (reference['bytes_up'] + reference['bytes_down']):>6.3f} "
            f"{r['steady_step_s'] / reference['steady_step_s']:>5.2f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="char-transformer-100m")
    parser.add_argument("--options", nargs="*", default=["seq_len=32", "max_sequences=100"],
                        help="workload options, key=value (a small test split: the coordinator evaluates it at the end)")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", nargs="+", default=["dsgd", "rankdad:rank=4"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_STATE_COPIES))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this strategy, print its figures as JSON
    parser.add_argument("--out", type=Path, default=Path("bench_large.json"))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: a first step and two steady ones")
    options = StrategySpec.parse("workload:" + ",".join(args.options)).options  # key=value, typed as strategy options are
    optimizer = OptimizerConfig(name=args.optimizer, lr=3e-4 if args.optimizer == "adam" else 0.01)
    config = SimulationConfig(
        workload=args.workload, workload_options=options, sites=args.sites, batch_size=args.batch_size, steps=args.steps,
        eval_every=args.steps, device=args.device, optimizer=optimizer, rank_every=0, strategies=[],
        phase_timeout_s=PHASE_TIMEOUT_S,
    )
    if args.one:
        with tempfile.TemporaryDirectory(prefix="bench-large-") as tmp:
            print(json.dumps(run_one(config, StrategySpec.parse(args.one), Path(tmp) / "metrics.jsonl")))
        return
    results = []
    for text in args.strategies:
        child = subprocess.run([sys.executable, "-m", "bench.bench_large", *sys.argv[1:], "--one", text],
                               capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"{text} failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"{text}: done", file=sys.stderr, flush=True)
    state = state_bytes(args.workload, options, optimizer)
    args.out.write_text(json.dumps({"state_bytes": state, "results": results}, indent=1))
    print("\n".join(table(results, state)))


if __name__ == "__main__":
    main()
