"""Coordination overhead per step on loopback, beside a bare grpc.aio echo (a benchmark, not a test).

    python bench/bench_overhead.py [--sites 8 32] [--steps 200]

For each site count N it runs, in the same session:

- **echo**: a bare grpc.aio server and a blocking-gRPC client process per client (and again
  with grpc.aio clients, for their CPU); one round = the
  server sends one small message to all N clients and waits for every reply. A step of
  dadfl with a one-phase strategy makes one such round: the server's message of step t
  is also the start of step t + 1, whose upload carries the step_done of t.
- **dadfl**: a real coordinator (in this process) and N ``python -m dadfl.client`` site
  processes training a tiny workload (Linear 4 -> 2, a few bytes per payload) with dSGD,
  so transfer is negligible. Per-step time is the server's ``seconds`` record (start of
  the step to the update applied); compute is the in-process cost of the same work (one
  site's local step, site half, apply and fingerprint, plus the server's aggregate and
  apply), measured here; overhead = step time - compute. With more site processes than
  cores the sites' compute cannot all run at once: the last column also counts it as
  spread over the cores (site compute x sites / cores), which is the share of the step
  no protocol can remove on this machine.

Medians over the steps after a warm-up. Goal: overhead <= 1.5 echo rounds (measured in the
same run) at 8 and at 32 site processes.

**CPU per process.** Each process's CPU time (``/proc/<pid>/stat``, every thread) is read
when the run is ``WARMUP`` steps (rounds) in and again a few before its end: start-up,
imports and teardown (about a second of CPU per process, against well under a millisecond
per step) stay outside the window. Reported: CPU per site process per step beside an echo
client's per round, and their ratio (goal: at most ``GOAL_CPU_RATIO``); beside them a
grpc.aio echo client's (the client stack a site runs on: one coroutine reading and writing
the stream), so that a site's CPU can be set against its own transport too (measured: no
more than the goal's blocking client, docs/benchmarks-runtime.md); the coordinator's
CPU (this process) per site and step beside the echo server's per client and round. The
dadfl window is found by watching the metrics file's size every ``WATCH_S`` (a few stat
calls a second, nothing beside the coordinator's own CPU). With more processes than cores a step can take no less than sites × CPU per site / cores, which the
output sets beside the goal's step time (compute + 1.5 echo rounds): the CPU each site may
use per step for the goal to be reachable on this machine at all is
(compute + 1.5 echo rounds) × cores / sites.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # `python bench/bench_overhead.py`: the bench package next to this file
GOAL_ECHO_ROUNDS = 1.5
GOAL_CPU_RATIO = 2.0  # a site's CPU per step against an echo client's per round
WARMUP = 20
TAIL = 5  # steps (rounds) before the end where the CPU window closes, before any process ends
WATCH_S = 0.05
SITE_EXIT_S = 300  # a loaded machine takes long to end 32 processes that imported torch


def tiny_workload(samples: int = 64):
    """Linear 4 -> 2 on ``samples`` random samples: compute and payloads close to nothing."""
    import torch
    from torch import nn

    from dadfl.workloads import Split, Workload

    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(samples, 4, generator=g), torch.randint(0, 2, (samples,), generator=g)

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return nn.Linear(4, 2)

    return Workload(
        name="tiny",
        build_model=build,
        train=Split(inputs, targets),
        test=Split(inputs[:0], targets[:0]),
        loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
        metric=lambda out, y: float((out.argmax(-1) == y).float().mean()),
    )


# ----------------------------------------------------------------------------- bare echo

ECHO_METHOD = "/bench.Echo/Stream"


def _echo_client(address: str) -> None:
    """Answer every server message with itself until the server ends the stream."""
    import queue

    channel = grpc.insecure_channel(address)
    replies: queue.Queue = queue.Queue()
    stream = channel.stream_stream(ECHO_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)

    def requests():
        yield b"hello"
        while (item := replies.get()) is not None:
            yield item

    for message in stream(requests()):
        replies.put(message)
    replies.put(None)
    channel.close()


def _aio_echo_client(address: str) -> None:
    """``_echo_client`` on grpc.aio, the stack a site's client uses: one read and one write a
    round on one coroutine, as ``Site.connect_once`` does."""

    async def answer() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.stream_stream(ECHO_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)()
            await call.write(b"hello")
            while (message := await call.read()) is not grpc.aio.EOF:
                await call.write(message)

    asyncio.run(answer())


@dataclass
class CpuWindow:
    """CPU seconds used between two readings by some processes and by this one, over ``steps``."""

    pids: list[int]
    steps: int = 0
    others: float = 0.0
    own: float = 0.0

    def read(self, sign: int, step: int) -> None:
        from bench.coordinator_process import cpu_seconds  # here: the sites import this module for its workload

        self.steps += sign * step
        self.others += sign * sum(cpu_seconds(pid) for pid in self.pids)
        self.own += sign * cpu_seconds(os.getpid())


async def _echo_server(n_clients: int, rounds: int, client=_echo_client) -> tuple[list[float], CpuWindow]:
    queues: list[asyncio.Queue] = []
    everyone = asyncio.Event()

    async def handler(request_iterator, context):
        inbox: asyncio.Queue = asyncio.Queue()
        outbox: asyncio.Queue = asyncio.Queue()
        messages = request_iterator.__aiter__()
        await messages.__anext__()  # the client's hello: it is connected
        queues.append((inbox, outbox))
        if len(queues) == n_clients:
            everyone.set()

        async def read():
            async for message in messages:
                inbox.put_nowait(message)

        reader = asyncio.create_task(read())
        while (item := await outbox.get()) is not None:
            yield item
        reader.cancel()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(handler, lambda b: b, lambda b: b)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    spawn = multiprocessing.get_context("spawn")  # forking a process that runs gRPC is unsafe
    clients = [spawn.Process(target=client, args=(f"127.0.0.1:{port}",)) for _ in range(n_clients)]
    for client in clients:
        client.start()
    await asyncio.wait_for(everyone.wait(), 120)
    times, window = [], CpuWindow([client.pid for client in clients])
    for round_ in range(rounds):
        if round_ in (WARMUP, rounds - TAIL):
            window.read(-1 if round_ == WARMUP else 1, round_)
        start = time.perf_counter()
        for _, outbox in queues:
            outbox.put_nowait(b"x" * 16)
        await asyncio.gather(*(inbox.get() for inbox, _ in queues))
        times.append(time.perf_counter() - start)
    for _, outbox in queues:
        outbox.put_nowait(None)
    await server.stop(5)  # lets the handlers end their streams before the blocking joins
    for client in clients:
        client.join(30)
        if client.exitcode != 0:  # a client not waited for would be missing from the CPU figures
            raise RuntimeError(f"an echo client ended with {client.exitcode} (None: still running after 30 s)")
    return times[WARMUP:], window


def watch_steps(metrics: Path, steps: int, window: CpuWindow, done: threading.Event) -> None:
    """Read ``window`` when the run has ``WARMUP`` steps in ``metrics`` and when it has ``steps - TAIL``."""
    size, marks = -1, [WARMUP, steps - TAIL]
    while marks and not done.wait(WATCH_S):
        try:
            if metrics.stat().st_size == size:
                continue
            text = metrics.read_bytes()
        except FileNotFoundError:
            continue
        size, lines = len(text), text.count(b"\n")
        if lines >= marks[0]:
            window.read(-1 if len(marks) == 2 else 1, lines)
            marks.pop(0)


# ----------------------------------------------------------------------------- dadfl


def compute_seconds(n_sites: int) -> tuple[float, float]:
    """What one step computes, without any network: (one site's share, the server's)."""
    from dadfl.replica import OptimizerConfig, Replica
    from dadfl.strategies import make_strategy

    workload, strategy = tiny_workload(), make_strategy("dsgd")
    site, server_replica = Replica(workload, strategy, OptimizerConfig()), Replica(workload, strategy, OptimizerConfig())
    server = strategy.server(server_replica.layout, server_replica.model)
    site_times, server_times = [], []
    for step in range(100):
        start = time.perf_counter()
        local = site.local(workload.train.inputs[:8], workload.train.targets[:8])
        payload = site.half.begin(local, step)
        middle = time.perf_counter()
        message = server.aggregate([payload] * n_sites)
        server_replica.apply([message])
        end = time.perf_counter()
        site.half.receive(message)
        site.apply([message])
        site_times.append(middle - start + time.perf_counter() - end)
        server_times.append(end - middle)
    return statistics.median(site_times[WARMUP:]), statistics.median(server_times[WARMUP:])


def run_dadfl(n_sites: int, steps: int) -> tuple[list[float], CpuWindow]:
    sys.path.insert(0, str(HERE))
    from dadfl.server.config import ServerConfig
    from dadfl.server.enrol import enroll
    from dadfl.server.processes import write_toml
    from dadfl.server.runtime import serve
    from dadfl.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = ServerConfig.model_validate(
            {
                "run_dir": str(folder / "run"),
                "listen": {"address": "127.0.0.1:0", "tokens": str(folder / "tokens.json")},
                "workload": {"spec": "bench_overhead:tiny_workload"},
                "strategy": {"name": "dsgd"},
                "training": {"steps": steps, "batch_size": 8, "eval_every": steps, "checkpoint_every": 0},
                "federation": {"min_sites": n_sites, "quorum_timeout_s": 300, "linger_s": 0},
            }
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        sites: list[subprocess.Popen] = []
        window, done = CpuWindow([]), threading.Event()
        watcher = threading.Thread(target=watch_steps, args=(folder / "run" / "metrics.jsonl", steps, window, done), daemon=True)
        tokens = {f"site-{index:03d}": enroll(folder / "tokens.json", f"site-{index:03d}") for index in range(n_sites)}  # the server checks the file at start

        def start_sites(endpoint: str) -> None:
            for index in range(n_sites):
                site_id = f"site-{index:03d}"
                toml = write_toml(
                    folder / f"{site_id}.toml",
                    {
                        "site_id": site_id, "token": tokens[site_id], "device": "cpu", "threads": 1,
                        "allowed_workloads": ["bench_overhead:tiny_workload"],
                        "connect": {"server": endpoint, "backoff_initial_s": 0.2, "max_attempts": 100, "give_up_after_s": 1800},
                        "data": {"source": "partition", "site_index": index, "num_sites": n_sites},
                    },
                )
                sites.append(subprocess.Popen([sys.executable, "-m", "dadfl.client", "--config", str(toml), "--insecure"], env=env, stderr=subprocess.DEVNULL))
            window.pids = [process.pid for process in sites]
            watcher.start()

        try:
            asyncio.run(serve(config, insecure=True, on_listening=start_sites))
        finally:
            done.set()
            for process in sites:
                process.wait(SITE_EXIT_S)
        failed = [process.returncode for process in sites if process.returncode != 0]
        if failed:  # a site that crashed would still count in the CPU per site
            raise RuntimeError(f"{len(failed)} of {n_sites} site processes ended with {failed[0]}")
        records = list(read_metrics(folder / "run" / "metrics.jsonl"))
    if window.steps <= 0:
        raise RuntimeError(f"the CPU window did not close: a run of {steps} steps needs more than {WARMUP + TAIL} (--steps)")
    return [r["seconds"] for r in records[WARMUP:]], window


def ratio(a: float, b: float) -> float:
    """a / b; nan when b is 0 (a window too short for the CPU clock's ticks: use more --steps)."""
    return a / b if b else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    results = []
    for n in args.sites:
        echo_times, echo_cpu = asyncio.run(_echo_server(n, args.steps))
        _, aio_cpu = asyncio.run(_echo_server(n, args.steps, _aio_echo_client))
        aio_client = aio_cpu.others / (n * aio_cpu.steps)
        step_times, site_cpu = run_dadfl(n, args.steps)
        echo, step = statistics.median(echo_times), statistics.median(step_times)
        echo_client, echo_server = echo_cpu.others / (n * echo_cpu.steps), echo_cpu.own / (n * echo_cpu.steps)
        site_process, coordinator = site_cpu.others / (n * site_cpu.steps), site_cpu.own / (n * site_cpu.steps)
        site, server = compute_seconds(n)
        compute = site + server
        overhead = step - compute
        on_cores = step - server - site * max(1.0, n / cores)
        goal_step = compute + GOAL_ECHO_ROUNDS * echo
        results.append({
            "sites": n, "cores": cores, "echo_round_ms": echo * 1e3, "step_ms": step * 1e3, "compute_ms": compute * 1e3,
            "site_compute_ms": site * 1e3, "overhead_ms": overhead * 1e3, "overhead_per_echo_round": overhead / echo,
            "overhead_on_cores_ms": on_cores * 1e3, "overhead_on_cores_per_echo_round": on_cores / echo,
            "cpu_per_site_step_ms": site_process * 1e3, "cpu_per_echo_client_round_ms": echo_client * 1e3,
            "cpu_site_per_echo_client": ratio(site_process, echo_client),
            "cpu_per_aio_echo_client_round_ms": aio_client * 1e3, "cpu_site_per_aio_echo_client": ratio(site_process, aio_client),
            "coordinator_cpu_per_site_step_ms": coordinator * 1e3, "echo_server_cpu_per_client_round_ms": echo_server * 1e3,
            "cpu_coordinator_per_echo_server": ratio(coordinator, echo_server),
            "cpu_floor_step_ms": n * site_process / max(1, min(n, cores)) * 1e3, "goal_step_ms": goal_step * 1e3,
            "goal_cpu_per_site_step_ms": goal_step * min(n, cores) / n * 1e3,
        })
        print(
            f"{n:3d} sites: echo round {echo * 1e3:6.2f} ms | dadfl step {step * 1e3:6.2f} ms = compute {compute * 1e3:5.2f} ms "
            f"+ overhead {overhead * 1e3:6.2f} ms | overhead / echo round {overhead / echo:5.2f}x (goal <= {GOAL_ECHO_ROUNDS}x) | "
            f"site compute spread over {cores} cores: overhead {on_cores * 1e3:6.2f} ms = {on_cores / echo:5.2f}x",
            flush=True,
        )
        print(
            f"{n:3d} sites: CPU per site process and step {site_process * 1e3:5.3f} ms, an echo client per round "
            f"{echo_client * 1e3:5.3f} ms: {ratio(site_process, echo_client):4.1f}x (goal <= {GOAL_CPU_RATIO}x), a grpc.aio echo client "
            f"{aio_client * 1e3:5.3f} ms: {ratio(site_process, aio_client):4.1f}x | coordinator CPU per site and "
            f"step {coordinator * 1e3:5.3f} ms, the echo server's per client and round {echo_server * 1e3:5.3f} ms: "
            f"{ratio(coordinator, echo_server):4.1f}x | {n} sites on {cores} cores: a step takes at least {results[-1]['cpu_floor_step_ms']:6.2f} ms "
            f"| the goal's step {goal_step * 1e3:5.2f} ms leaves each site {results[-1]['goal_cpu_per_site_step_ms']:5.3f} ms of CPU",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
