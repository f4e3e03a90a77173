"""Real links: coordinator and sites as processes in their own network namespaces, each
site behind a veth link shaped with ``tc tbf``, talking real gRPC.

Topology (all created here and removed afterwards; names carry this process's id):
the coordinator's namespace holds a bridge (10.213.0.1/24); site i's namespace holds
one end of a veth pair (10.213.0.<10+i>), the other end is a bridge port. A ``tbf``
qdisc on the site's end shapes its uplink, one on the bridge port its downlink, both to
the same rate. Each strategy runs ``steps`` steps of the runtime's coordinator and site
processes (``python -m dadfl.server`` / ``dadfl.client``, plain text) on the built-in
digits MLP with hidden 1024 (1.13M parameters), first on unshaped links, then at each
rate.

Per strategy and rate we report the measured seconds per step (median over steps after
the first) beside the **physical bound**

    bound = compute + max_site(wire bytes up + down) / rate + phases · RTT

where *compute* is the measured step time on unshaped veth links (local passes,
serialisation, aggregation, updates: everything except the bandwidth), wire bytes are
what the runtime counted on the gRPC stream per site, and RTT is measured with a TCP
echo across the shaped link. The token bucket holds a millisecond of traffic
(``burst_bytes``), so the bandwidth term is what the link allows. Goals (issue 4):
every strategy within 1.3× of its bound; rank-dAD ≥ 20× faster per step than dSGD at
10 Mbit/s.

Needs root with network namespaces, veth, bridge and tbf; otherwise it says what is
missing and writes ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dadfl.metrics import read_metrics
from dadfl.server.processes import simulation_configs
from dadfl.simulation import SimulationConfig, StrategySpec

from .matrix import SGD

SITES = 4
STEPS = 6
PORT = 50061
RATES = {"10 Mbit/s": 10_000_000, "100 Mbit/s": 100_000_000}
SUBNET = "10.213.0"
COORDINATOR_IP = f"{SUBNET}.1"
WORKLOAD, OPTIONS = "digits-mlp", {"hidden": 1024, "seed": 0}
STRATEGIES = [
    StrategySpec(name="dsgd"),
    StrategySpec(name="dad"),
    StrategySpec(name="auto"),
    StrategySpec(name="edad"),
    StrategySpec(name="rankdad", options={"rank": 4, "raw_input": "low_rank", "reduce_on_server": False},
                 label="rankdad r=4"),
    StrategySpec(name="rankdad", options={"rank": 4, "raw_input": "low_rank", "reduce_on_server": True},
                 label="rankdad r=4 reduced"),
    StrategySpec(name="powersgd", options={"rank": 4, "start_iter": 0}, label="powersgd r=4"),
]
RUN_TIMEOUT_S = 300


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why this machine cannot run the real-links part, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command is missing (iproute2)"
    probe = f"dadflprobe{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        sh("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        sh("tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "10mbit", "burst", "64kb", "latency", "100ms")
    except subprocess.CalledProcessError as exc:
        return f"'{' '.join(exc.cmd)}' failed: {exc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def burst_bytes(rate: int) -> int:
    """The token bucket: 1 ms at ``rate``, at least 4 KB. A bigger bucket would let small
    payloads pass at line rate and beat the bandwidth term of the bound; ``latency``
    bounds the queue (drops beyond it would stall TCP)."""
    return max(4096, rate // 8 // 1000)


class Network:
    """The namespaces, bridge and veth links; ``shape`` sets every site link's rate."""

    def __init__(self, sites: int):
        tag = os.getpid()
        self.coordinator = f"dadfl{tag}c"
        self.sites = [f"dadfl{tag}s{i}" for i in range(sites)]
        self.site_ips = [f"{SUBNET}.{10 + i}" for i in range(sites)]

    def __enter__(self) -> "Network":
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self) -> None:
        c = self.coordinator
        sh("ip", "netns", "add", c)
        sh("ip", "-n", c, "link", "set", "lo", "up")
        sh("ip", "-n", c, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", c, "addr", "add", f"{COORDINATOR_IP}/24", "dev", "br0")
        sh("ip", "-n", c, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(self.sites, self.site_ips)):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", c, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", c, "link", "set", f"port{i}", "master", "br0")
            sh("ip", "-n", c, "link", "set", f"port{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def shape(self, rate: int | None) -> None:
        """tbf at ``rate`` bit/s on both directions of every site link; None removes it."""
        for i, ns in enumerate(self.sites):
            for namespace, device in ((ns, "eth0"), (self.coordinator, f"port{i}")):
                subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)
                if rate is not None:
                    sh("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                       "rate", f"{rate}bit", "burst", f"{burst_bytes(rate)}b", "latency", "200ms")

    def run_in(self, namespace: str, command: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", namespace, *command], **kwargs)

    def __exit__(self, *exc) -> None:
        for ns in [self.coordinator, *self.sites]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""


def measure_rtt(network: Network, port: int, rounds: int = 50) -> float:
    """Median TCP round trip (64 bytes) from site 0 to the coordinator, in seconds."""
    server = network.run_in(network.coordinator, [sys.executable, "-c", ECHO_SERVER, COORDINATOR_IP, str(port)],
                            stdout=subprocess.PIPE, text=True)
    client_code = (
        "import socket, sys, time, statistics\n"
        f"s = socket.create_connection(('{COORDINATOR_IP}', {port})); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "times = []\n"
        f"for _ in range({rounds}):\n"
        "    t = time.perf_counter(); s.sendall(b'x' * 64); got = 0\n"
        "    while got < 64: got += len(s.recv(64))\n"
        "    times.append(time.perf_counter() - t)\n"
        "print(statistics.median(times))\n"
    )
    try:
        server.stdout.readline()  # "ready"
        result = subprocess.run(["ip", "netns", "exec", network.sites[0], sys.executable, "-c", client_code],
                                capture_output=True, text=True, check=True, timeout=60)
        return float(result.stdout.strip())
    finally:
        server.kill()
        server.wait()


def run_strategy(network: Network, spec: StrategySpec, steps: int, port: int) -> list[dict]:
    """One federation: coordinator and sites in their namespaces; the coordinator's records."""
    config = SimulationConfig(
        workload=WORKLOAD, workload_options=OPTIONS, sites=len(network.sites), partition="iid", batch_size=32,
        steps=steps, eval_every=steps, seed=0, device="cpu", optimizer=SGD, strategies=[spec],
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="dadfl-links-") as tmp:
        folder = Path(tmp)
        server_toml, site_tomls = simulation_configs(config, spec, folder, f"{COORDINATOR_IP}:{port}")
        logs = {name: (folder / f"{name}.log").open("w") for name in ["coordinator", *(t.stem for t in site_tomls)]}
        processes = {
            "coordinator": network.run_in(
                network.coordinator, [sys.executable, "-m", "dadfl.server", "--config", str(server_toml), "--insecure"],
                cwd=folder, env=env, stdout=logs["coordinator"], stderr=subprocess.STDOUT),
        }
        for namespace, toml in zip(network.sites, site_tomls):
            processes[toml.stem] = network.run_in(
                namespace, [sys.executable, "-m", "dadfl.client", "--config", str(toml), "--insecure"],
                cwd=folder, env=env, stdout=logs[toml.stem], stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while any(p.poll() is None for p in processes.values()) and time.monotonic() < deadline:
                time.sleep(0.2)
            failed = {name: p.returncode for name, p in processes.items() if p.returncode != 0}
            if failed:
                name = next(iter(failed))
                logs[name].flush()
                raise RuntimeError(f"{spec.display}: {name} exited with {failed[name]}:\n"
                                   f"{(folder / f'{name}.log').read_text()[-3000:]}")
            return list(read_metrics(folder / "run" / "metrics.jsonl"))
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for log in logs.values():
                log.close()


def last_error(log_text: str) -> str:
    """The last warning or error line of a process log: why a run failed."""
    lines = log_text.splitlines()
    closing = [line for line in lines if "closing site" in line]  # the coordinator's reason for refusing a site
    errors = closing or [line for line in lines if "WARNING" in line or "error" in line.lower()]
    return errors[-1].strip() if errors else ""


def step_summary(records: list[dict]) -> dict:
    """Median seconds per step after the first, and the busiest site's wire bytes per step."""
    steady = records[1:] or records
    per_site = [
        max(r["wire_bytes_up_by_site"][site] + r["wire_bytes_down_by_site"][site] for site in r["wire_bytes_up_by_site"])
        for r in steady
    ]
    return {
        "seconds": statistics.median(r["seconds"] for r in steady),
        "wire_bytes_site": statistics.median(per_site),
        "bytes_up_per_site": statistics.median(r["bytes_up"] / r["sites"] for r in steady),
        "bytes_down_per_site": statistics.median(r["bytes_down"] / r["sites"] for r in steady),
        "phases": len(steady[0]["phase_seconds"]),
        "steps": len(records),
    }


def measure(steps: int = STEPS, log=print) -> dict:
    reason = unavailable()
    if reason:
        log(f"real links skipped: {reason}")
        return {"skipped": reason}
    results = {
        "workload": WORKLOAD, "options": OPTIONS, "sites": SITES, "steps": steps, "rates": {}, "strategies": {}, "failed": {},
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the namespaces when killed
    with Network(SITES) as network:
        for rate_name, rate in [("unshaped", None), *RATES.items()]:
            network.shape(rate)
            rtt = measure_rtt(network, PORT + 1)
            results["rates"][rate_name] = {"bits_per_second": rate, "rtt": rtt}
            for spec in STRATEGIES:
                if spec.display in results["failed"]:
                    continue
                try:
                    summary = step_summary(run_strategy(network, spec, steps, PORT))
                except RuntimeError as exc:  # recorded and reported; the other strategies still run
                    results["failed"][spec.display] = str(exc).splitlines()[0] + " " + last_error(str(exc))
                    log(f"{rate_name:>10} {spec.display:>20}: FAILED {results['failed'][spec.display]}")
                    continue
                results["strategies"].setdefault(spec.display, {})[rate_name] = summary
                log(f"{rate_name:>10} {spec.display:>20}: {summary['seconds']:.3f} s/step, "
                    f"{summary['wire_bytes_site'] / 1e3:.0f} KB per site on the wire")
    for label, runs in results["strategies"].items():
        compute = runs["unshaped"]["seconds"]
        for rate_name, rate in RATES.items():
            run = runs[rate_name]
            run["bound"] = compute + 8 * run["wire_bytes_site"] / rate + run["phases"] * results["rates"][rate_name]["rtt"]
            run["over_bound"] = run["seconds"] / run["bound"]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.links", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/full"), help="folder for the JSON result")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = measure(args.steps)
    (args.out / "links.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
