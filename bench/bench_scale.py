"""Hundreds of sites against one coordinator over real gRPC (a benchmark, not a test).

    python bench/bench_scale.py [--sites 64 256 1024] [--steps 20] [--processes 4]

For each site count N: one coordinator process (``dadfl server``, plain text on loopback)
and ``--processes`` worker processes, each running N / processes sites as coroutines of
the real asyncio client (:func:`dadfl.client.site.run_site_async`: handshake, run checks,
data checks, half states, one gRPC stream and one channel per site). The workload is tiny
(Linear 4 -> 2, 16 samples per site, dSGD), so what is measured is coordination: the
coordinator's step loop, gRPC, the protocol (one round trip per step). Every site is
enrolled with the real enrolment code.

Reported per N (medians over the steps after a warm-up), in ``--out``: ``scale.json`` and
``scale.png`` (step time against sites, and step time per site):

- step time: the coordinator's ``seconds`` record (start of the step to the update applied);
- coordinator CPU per site per step: the coordinator's user + system CPU over the measured
  steps, divided by steps and sites;
- memory per site: the workers' resident memory after the run minus a worker's before
  its sites started, divided by sites; and the coordinator's growth from listening to
  the last step, divided by sites.

The workers run with Python's cyclic garbage collector off: with hundreds of sites in one
heap its full passes grow with the heap and made a worker's time per site grow with the
sites it holds (a real site runs in a process of its own). The coordinator runs as
deployed.

Step time growing no faster than linearly in sites means the time per site is flat or
falling. The machine's cores are shared by coordinator and workers: a figure per site
includes the sites' own compute.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # `python bench/bench_scale.py`: the bench package next to this file

from bench.bench_overhead import tiny_workload as tiny_linear  # noqa: E402
from bench.coordinator_process import cpu_seconds, rss_kib, start_coordinator, write_server_toml  # noqa: E402

WORKLOAD = "bench_scale:tiny_workload"
SAMPLES_PER_SITE = 16
WARMUP = 3
RUN_TIMEOUT_S = 1800.0


def tiny_workload(sites: int = 1):
    """The overhead benchmark's Linear 4 -> 2, on ``16 * sites`` random samples (every site gets 16)."""
    return tiny_linear(SAMPLES_PER_SITE * sites)


def site_settings(folder: Path, endpoint: str, index: int, n_sites: int, token: str) -> dict:
    return {
        "site_id": f"site-{index:04d}", "token": token, "device": "cpu", "threads": 1,
        "allowed_workloads": [WORKLOAD],
        "connect": {"server": endpoint, "backoff_initial_s": 0.5, "backoff_max_s": 5.0, "max_attempts": 1000, "give_up_after_s": 3600},
        "data": {"source": "partition", "site_index": index, "num_sites": n_sites},
    }


# ----------------------------------------------------------------------------- one worker process


def worker(folder: Path, first: int, count: int) -> None:
    """Run sites ``first .. first + count - 1`` as coroutines; print their summary as JSON."""
    import torch

    from dadfl.client.config import SiteConfig
    from dadfl.client.site import run_site_async

    torch.set_num_threads(1)
    plan = json.loads((folder / "sites.json").read_text())
    configs = [SiteConfig.model_validate(plan[index]) for index in range(first, first + count)]
    before = rss_kib(os.getpid())["VmRSS"]

    async def everyone():
        return await asyncio.gather(*(run_site_async(config, insecure=True) for config in configs))

    # Hundreds of sites' replicas in one heap made the cyclic collector's full passes about
    # half of a worker's time per step at 256 sites per process (a real site is a process
    # of its own): the workers run without it, and their memory per site includes what it
    # would have freed.
    gc.disable()

    summaries = asyncio.run(everyone())
    after = rss_kib(os.getpid())
    print(json.dumps({
        "sites": count, "rss_before_kib": before, "rss_after_kib": after["VmRSS"], "rss_peak_kib": after["VmHWM"],
        "steps": [s.steps for s in summaries], "connections": sum(s.connections for s in summaries),
    }))


# ----------------------------------------------------------------------------- one site count


def enrol(folder: Path, n_sites: int) -> list[str]:
    """Tokens for ``site-0000`` ... with the real enrolment code (``dadfl enroll``)."""
    from dadfl.server.enrol import enroll

    return [enroll(folder / "tokens.json", f"site-{index:04d}") for index in range(n_sites)]


def run_scale(n_sites: int, steps: int, processes: int) -> dict:
    from dadfl.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokens = enrol(folder, n_sites)
        coordinator, endpoint = start_coordinator(folder, write_server_toml(
            folder, steps, workload={"spec": WORKLOAD, "options": {"sites": n_sites}},
            training={"batch_size": SAMPLES_PER_SITE, "progress_every_s": 30},
            federation={"min_sites": n_sites, "quorum_timeout_s": RUN_TIMEOUT_S, "phase_timeout_s": 300, "linger_s": 0},
        ))
        rss_listening = rss_kib(coordinator.pid)["VmRSS"]
        plan = [site_settings(folder, endpoint, i, n_sites, tokens[i]) for i in range(n_sites)]
        (folder / "sites.json").write_text(json.dumps(plan))
        shares = [n_sites // processes + (1 if p < n_sites % processes else 0) for p in range(processes)]
        firsts = [sum(shares[:p]) for p in range(processes)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        workers = [
            subprocess.Popen([sys.executable, str(Path(__file__)), "--worker", str(folder), str(first), str(count)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for first, count in zip(firsts, shares) if count
        ]
        try:
            metrics = folder / "run" / "metrics.jsonl"
            # (records seen, CPU seconds) when a poll first sees the warm-up and the last step done: the
            # poll may land a few steps late, so CPU is divided by the records between the two readings
            cpu_marks: dict[int, tuple[int, float]] = {}
            rss_last = float("nan")  # the coordinator's memory once the last step is done
            started = time.monotonic()
            while coordinator.poll() is None:
                done = metrics.read_bytes().count(b"\n") if metrics.exists() else 0  # complete records only
                for mark in (WARMUP, steps):
                    if done >= mark and mark not in cpu_marks:
                        cpu_marks[mark] = (done, cpu_seconds(coordinator.pid))
                if done >= steps:  # read on every poll until it exits (linger_s = 0): the last one counts
                    try:
                        rss_last = rss_kib(coordinator.pid)["VmRSS"]
                    except ProcessLookupError:
                        pass
                if time.monotonic() - started > RUN_TIMEOUT_S:
                    raise RuntimeError(f"{n_sites} sites: the run did not end in {RUN_TIMEOUT_S:.0f} s; see {folder / 'server.log'}")
                time.sleep(0.1)
            reports = [json.loads(w.communicate(timeout=120)[0].splitlines()[-1]) for w in workers]
        finally:  # a failed run leaves no site retrying against a coordinator that is gone
            for process in (*workers, coordinator):
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
        records = list(read_metrics(metrics))
        if len(records) != steps or coordinator.returncode != 0:
            raise RuntimeError(f"{n_sites} sites: {len(records)} of {steps} steps, coordinator exit {coordinator.returncode}")
        if math.isnan(rss_last):
            raise RuntimeError(f"{n_sites} sites: the coordinator exited before its memory was read after the last step")
    measured = records[WARMUP:]
    step_s = statistics.median(r["seconds"] for r in measured)
    (first, cpu_first), (last, cpu_last) = cpu_marks.get(WARMUP, (0, 0.0)), cpu_marks.get(steps, (0, 0.0))
    cpu = (cpu_last - cpu_first) / (last - first) if last > first else float("nan")  # nan: no two readings apart
    site_kib = sum(r["rss_after_kib"] - r["rss_before_kib"] for r in reports) / n_sites
    return {
        "sites": n_sites,
        "processes": len(workers),
        "steps": steps,
        "step_ms": step_s * 1e3,
        "step_us_per_site": step_s * 1e6 / n_sites,
        "participants": min(r["sites"] for r in measured),
        "coordinator_cpu_us_per_site_step": cpu * 1e6 / n_sites,
        "site_memory_kib": site_kib,
        "coordinator_memory_kib_per_site": (rss_last - rss_listening) / n_sites,
        "reconnections": sum(r["connections"] for r in reports) - n_sites,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = [r["sites"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sites, [r["step_ms"] for r in results], "o-", label="step time")
    scale = results[0]["step_ms"] / sites[0]
    left.plot(sites, [scale * n for n in sites], "--", color="grey", label="linear from the smallest N")
    left.set(xlabel="sites", ylabel="step time (ms)", title="one coordinator, dSGD, tiny model", xscale="log", yscale="log")
    left.legend()
    right.plot(sites, [r["step_us_per_site"] for r in results], "o-", label="step time / site")
    right.plot(sites, [r["coordinator_cpu_us_per_site_step"] for r in results], "s-", label="coordinator CPU / site / step")
    right.set(xlabel="sites", ylabel="µs", title="per site", xscale="log", ylim=(0, None))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=4, help="worker processes the sites are spread over")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-scale"))
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # the coordinator imports the workload
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.sites:
        result = run_scale(n, args.steps, args.processes)
        results.append(result)
        print(
            f"{n:5d} sites ({result['processes']} processes): step {result['step_ms']:8.1f} ms = {result['step_us_per_site']:6.1f} µs/site | "
            f"coordinator CPU {result['coordinator_cpu_us_per_site_step']:6.1f} µs/site/step | memory {result['site_memory_kib']:6.0f} KiB/site "
            f"(coordinator {result['coordinator_memory_kib_per_site']:5.1f} KiB/site) | reconnections {result['reconnections']}",
            flush=True,
        )
    (args.out / "scale.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "scale.png")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
