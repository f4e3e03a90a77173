"""Real links: coordinator and sites as processes in their own network namespaces, each
site behind a veth link shaped with ``tc tbf``, talking real gRPC; on the wide-area links a
user-space relay in each site's namespace adds the latency (``bench/delay_relay.py``).

Topology (all created here and removed afterwards; names carry this process's id):
the coordinator's namespace holds a bridge (10.213.0.1/24); site i's namespace holds
one end of a veth pair (10.213.0.<10+i>), the other end is a bridge port. A ``tbf``
qdisc on the site's end shapes its uplink, one on the bridge port its downlink, both to
the same rate. Each strategy runs ``steps`` steps of the runtime's coordinator and site
processes (``python -m dadfl.server`` / ``dadfl.client``, plain text) on the matrix's
``digits-mlp-wide`` setting (digits MLP, hidden 1024, 1.13M parameters; its optimizer and
batch size), first on unshaped links, then on each link. For FedAvg and DiLoCo a step is a
round: H local steps at every site, then one exchange. The strategies are the matrix's,
under the same labels, so the report can put the matrix's steps to dSGD's target (the
runtime is bit-identical to the simulation) beside each link's measured seconds per step. The links with a round-trip time (20 Mbit/s with 40 ms, 100 Mbit/s with 10 ms, as a
hospital's wide-area link) put a relay between each site and the coordinator that holds
every byte for half the RTT in each direction; ``tc`` here has no ``netem``.

The emulator's own accuracy is measured on every link and reported: the RTT a 64-byte TCP
echo sees through the relay minus the one it sees directly (against the configured RTT), and
the goodput of a bulk transfer (against the configured rate; TCP/IP headers take ~3–5%).

Per strategy and link we report the measured seconds per step (median over steps after
the first) beside the **physical bound**

    bound = compute + max_site(wire bytes up + down) / rate + phases · RTT

where *compute* is the measured step time on unshaped veth links (local passes,
serialisation, aggregation, updates: everything except the bandwidth), wire bytes are
what the runtime counted on the gRPC stream per site, and RTT is measured with a TCP
echo across the shaped link. The token bucket holds a millisecond of traffic
(``burst_bytes``), so the bandwidth term is what the link allows. Goals (issue 4):
every strategy within 1.3× of its bound; rank-dAD ≥ 20× faster per step than dSGD at
10 Mbit/s.

The 4 sites and the coordinator share this machine's cores, so *compute* here includes
their wait for a core. A hospital's sites each run on their own machine. For the compressed
strategies each link is therefore also measured with **one site** (the coordinator and one
site process, a core each on a 2-core machine): the same link, the same bytes per site
and the same round trips, with no wait for a core. It leaves out the coordinator's work
on the other sites' payloads and the wait for the slowest site.

Needs root with network namespaces, veth, bridge and tbf; otherwise it says what is
missing and writes ``{"skipped": reason}``.
"""

from __future__ import annotations

import contextlib
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
from dadfl.strategies.quantize import FULL_PRECISION

from .execute import run_part
from .matrix import strategy_specs
from .presets import CONCATENATED_RANKS, INTEGER_BITS, LINK_RANKS, WIDE

SITES = WIDE.sites[0]  # the setting's sites: the matrix's steps to target for it set the seconds to target
STEPS = 6
# rank-dAD's and PowerSGD's steps take tens of milliseconds: 5× the steps make their median
# steady to a few percent (with 6, two runs of the same strategy differed by up to 18%)
COMPRESSED_STEPS_FACTOR = 5
PORT = 50061
RELAY_PORT = 50071
# name: (rate in bit/s, round-trip time the relay adds in seconds)
LINKS = {
    "10 Mbit/s": (10_000_000, 0.0),
    "100 Mbit/s": (100_000_000, 0.0),
    "20 Mbit/s, 40 ms RTT": (20_000_000, 0.040),
    "100 Mbit/s, 10 ms RTT": (100_000_000, 0.010),
}
BULK_SECONDS = 2.0  # bulk transfer that measures goodput: this long at the configured rate
REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.213.0"
COORDINATOR_IP = f"{SUBNET}.1"
WORKLOAD, OPTIONS = WIDE.workload, {**WIDE.options, "seed": 0}
# rank-dAD and PowerSGD at ranks 1, 2 and 4, their factors as floats and as 8-bit codes, and
# rank-dAD's concatenated downlink: the integer-factors preset's wide MLP runs these too, so
# each has its steps to target.
STRATEGIES = strategy_specs(feed_forward=True, ranks=LINK_RANKS, exact=True, ablation=False, local_steps=True,
                            factor_bits=(FULL_PRECISION, INTEGER_BITS), concatenated=CONCATENATED_RANKS)
COMPRESSED = ("rankdad", "powersgd")
# Also run with one site: its compute beside the link's. Not the concatenated downlink: with
# one site it sends what the re-reduced one does, without the server's re-reduction.
ONE_SITE = [spec for spec in STRATEGIES if spec.name in COMPRESSED and spec.options.get("reduce_on_server") is not False]
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


PROBE_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = c.recv(1)
    if mode == b"e":  # echo 64-byte messages until the client closes
        while (b := c.recv(64)):
            c.sendall(b)
    elif mode == b"s":  # sink: an 8-byte length, that many bytes, then one byte back
        header = b""
        while len(header) < 8 and (part := c.recv(8 - len(header))):
            header += part
        left = int.from_bytes(header, "big") if len(header) == 8 else 0
        while left > 0 and (part := c.recv(min(left, 1 << 20))):  # a client gone early ends the loop
            left -= len(part)
        if left == 0 and len(header) == 8:
            c.sendall(b"k")
    c.close()
"""

PROBE_CLIENT = """
import socket, statistics, sys, time
host, port, rounds, bulk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.create_connection((host, port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.sendall(b"e"); times = []
for _ in range(rounds):
    t = time.perf_counter(); s.sendall(b"x" * 64); got = 0
    while got < 64: got += len(s.recv(64))
    times.append(time.perf_counter() - t)
s.close(); seconds = 0.0
if bulk:
    s = socket.create_connection((host, port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"s"); block = bytes(1 << 16); t = time.perf_counter()
    s.sendall(bulk.to_bytes(8, "big"))
    for start in range(0, bulk, len(block)):
        s.sendall(block[:min(len(block), bulk - start)])
    s.recv(1); seconds = time.perf_counter() - t; s.close()
print(statistics.median(times), seconds)
"""


@contextlib.contextmanager
def relays(network: "Network", target_port: int, added_rtt: float):
    """The address sites use to reach the coordinator's ``target_port``: directly, or through a
    delay relay in each site's namespace (half of ``added_rtt`` each way) while in the block."""
    if not added_rtt:
        yield f"{COORDINATOR_IP}:{target_port}"
        return
    command = [sys.executable, "-m", "bench.delay_relay", "--listen", f"127.0.0.1:{RELAY_PORT}",
               "--target", f"{COORDINATOR_IP}:{target_port}", "--delay-ms", str(added_rtt * 1e3 / 2)]
    processes = [network.run_in(ns, command, cwd=REPO, stdout=subprocess.PIPE, text=True) for ns in network.sites]
    try:
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the delay relay did not start (exit {process.wait()})")
        yield f"127.0.0.1:{RELAY_PORT}"
    finally:
        for process in processes:
            process.kill()
            process.wait()


def probe_link(network: Network, port: int, address: str, bulk_bytes: int = 0, rounds: int = 50) -> tuple[float, float]:
    """From site 0 through ``address`` to a probe server on the coordinator's ``port``: the median
    64-byte TCP round trip and the seconds a ``bulk_bytes`` transfer took until acknowledged."""
    server = network.run_in(network.coordinator, [sys.executable, "-c", PROBE_SERVER, COORDINATOR_IP, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "ready"
        host, _, target = address.rpartition(":")
        result = subprocess.run(
            ["ip", "netns", "exec", network.sites[0], sys.executable, "-c", PROBE_CLIENT, host, target, str(rounds),
             str(bulk_bytes)], capture_output=True, text=True, check=True, timeout=120)
        rtt, seconds = map(float, result.stdout.split())
        return rtt, seconds
    finally:
        server.kill()
        server.wait()


def measure_link(network: Network, port: int, rate: int | None, added_rtt: float) -> dict:
    """RTT and goodput as a site sees them on the current shaping, and the relay's accuracy."""
    bulk = int(rate * BULK_SECONDS / 8) if rate else 0
    direct_rtt, seconds = probe_link(network, port, f"{COORDINATOR_IP}:{port}", 0 if added_rtt else bulk)
    rtt = direct_rtt
    if added_rtt:
        with relays(network, port, added_rtt) as address:
            rtt, seconds = probe_link(network, port, address, bulk)
    measured = {"bits_per_second": rate, "added_rtt": added_rtt, "rtt": rtt, "added_rtt_measured": rtt - direct_rtt}
    if bulk:
        # the transfer's last byte arrives one one-way delay after it left, and the ack takes another
        measured["goodput"] = 8 * bulk / max(seconds - rtt, 1e-9)
    return measured


def run_strategy(network: Network, spec: StrategySpec, steps: int, port: int, site_address: str,
                 sites: int | None = None) -> list[dict]:
    """One federation: coordinator and the first ``sites`` sites (default: all) in their
    namespaces; the coordinator's records."""
    config = SimulationConfig(
        workload=WORKLOAD, workload_options=OPTIONS, sites=sites or len(network.sites), partition="iid",
        batch_size=WIDE.batch_size, steps=steps, eval_every=steps, seed=0, device="cpu", optimizer=WIDE.optimizer,
        strategies=[spec],
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="dadfl-links-") as tmp:
        folder = Path(tmp)
        server_toml, site_tomls = simulation_configs(config, spec, folder, f"{COORDINATOR_IP}:{port}", site_address)
        logs = {name: (folder / f"{name}.log").open("w") for name in ["coordinator", *(t.stem for t in site_tomls)]}
        processes = {
            "coordinator": network.run_in(
                network.coordinator, [sys.executable, "-m", "dadfl.server", "--config", str(server_toml), "--insecure"],
                cwd=folder, env=env, stdout=logs["coordinator"], stderr=subprocess.STDOUT),
        }
        for namespace, toml in zip(network.sites, site_tomls):  # zip stops at the config's sites
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


def clock() -> str:
    """UTC time of day on each progress line: a measurement that shared the machine with
    other work can be told from the lines that ran beside it."""
    return time.strftime("%H:%M:%S", time.gmtime())


def measure(steps: int = STEPS, log=print) -> dict:
    reason = unavailable()
    if reason:
        log(f"real links skipped: {reason}")
        return {"skipped": reason}
    results = {
        "setting": WIDE.key, "workload": WORKLOAD, "options": OPTIONS, "sites": SITES, "steps": steps,
        "steps_compressed": steps * COMPRESSED_STEPS_FACTOR, "rates": {}, "strategies": {}, "failed": {},
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the namespaces when killed
    with Network(SITES) as network:
        for link_name, (rate, added_rtt) in [("unshaped", (None, 0.0)), *LINKS.items()]:
            network.shape(rate)
            results["rates"][link_name] = measure_link(network, PORT + 1, rate, added_rtt)
            with relays(network, PORT, added_rtt) as site_address:
                runs = [(spec, SITES, "strategies") for spec in STRATEGIES] + [(spec, 1, "one_site") for spec in ONE_SITE]
                for spec, sites, kind in runs:
                    name = spec.display if sites == SITES else f"{spec.display}, 1 site"
                    if name in results["failed"]:
                        continue
                    try:
                        spec_steps = steps * COMPRESSED_STEPS_FACTOR if spec.name in COMPRESSED else steps
                        summary = step_summary(run_strategy(network, spec, spec_steps, PORT, site_address, sites))
                    except RuntimeError as exc:  # recorded and reported; the other strategies still run
                        results["failed"][name] = str(exc).splitlines()[0] + " " + last_error(str(exc))
                        log(f"{clock()} {link_name:>22} {name:>20}: FAILED {results['failed'][name]}")
                        continue
                    results.setdefault(kind, {}).setdefault(spec.display, {})[link_name] = summary
                    log(f"{clock()} {link_name:>22} {name:>20}: {summary['seconds']:.3f} s/step, "
                        f"{summary['wire_bytes_site'] / 1e3:.0f} KB per site on the wire")
    for kind in ("strategies", "one_site"):
        for runs in results.get(kind, {}).values():
            add_bounds(runs, results["rates"])
    return results


def add_bounds(runs: dict[str, dict], rates: dict[str, dict]) -> None:
    """Each shaped link's physical bound and measured/bound, with the unshaped run as compute."""
    if "unshaped" not in runs:
        return
    compute = runs["unshaped"]["seconds"]
    for link_name, run in runs.items():
        if link_name == "unshaped":
            continue
        rate = LINKS[link_name][0]
        run["bound"] = compute + 8 * run["wire_bytes_site"] / rate + run["phases"] * rates[link_name]["rtt"]
        run["over_bound"] = run["seconds"] / run["bound"]


def main(argv: list[str] | None = None) -> int:
    run_part(argv, "python -m bench.links", __doc__, measure, "links.json", STEPS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
