"""Helpers of the networked-runtime tests: a coordinator in a thread, sites in threads, configs,
a whole simulation's federation in threads, ports that no other test worker takes.

Everything here runs the real components (gRPC server and channels on loopback, real
TLS, real files); threads only save the seconds a fresh Python process costs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

import torch

from dadfl.client.config import SiteConfig
from dadfl.client.site import run_site
from dadfl.config import load_config
from dadfl.metrics import MetricsWriter, read_metrics, read_summary
from dadfl.server.config import ServerConfig
from dadfl.server.enrol import enroll, write_tokens
from dadfl.server.processes import enroll_sites, server_config_file, site_config_files
from dadfl.server.runtime import serve
from dadfl.simulation import SimulationConfig, StrategySpec
from dadfl.workloads import BUILTIN

# Ports for the servers a test must restart on the same address (or tell a process before
# it starts): each xdist worker takes them from its own block below the kernel's ephemeral
# range (32768 and up on Linux), so neither another worker nor a port the kernel hands out
# (a bind to port 0, an outgoing connection) can take a port between its choice and its use.
# Each worker starts at a random place in its block: another test session on the machine
# walks the same blocks from elsewhere.
PORTS = range(10000, 32768)


def _worker_ports():
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = len(PORTS) // workers
    block = PORTS[worker * size : (worker + 1) * size]
    start = random.SystemRandom().randrange(len(block))  # leaves the seeded `random` alone
    return itertools.cycle([*block[start:], *block[:start]])


_ports = _worker_ports()


def free_port() -> int:
    """A loopback port of this worker's block that nobody holds now."""
    for _ in range(len(PORTS)):
        port = next(_ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("every port of this worker's block is in use")


def server_config(tmp: Path, **sections) -> ServerConfig:
    """A small digits-mlp run in ``tmp``: 2 sites, a few steps, short timeouts, no plots
    (matplotlib's import and drawing: a second of CPU per run)."""
    base = {
        "run_dir": str(tmp / "run"),
        "listen": {"address": "127.0.0.1:0", "tokens": str(tmp / "tokens.json")},
        "workload": {"spec": "digits-mlp", "options": {"hidden": 16}},
        "strategy": {"name": "dsgd"},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "training": {"steps": 4, "batch_size": 16, "eval_every": 2, "checkpoint_every": 2, "plots": False},
        "federation": {"min_sites": 2, "phase_timeout_s": 20, "quorum_timeout_s": 30},
    }
    for name, values in sections.items():
        base[name] = {**base[name], **values} if isinstance(base.get(name), dict) else values
    config = ServerConfig.model_validate(base)
    if not config.listen.tokens.exists():  # the server refuses to start without one; sites are enrolled later
        write_tokens(config.listen.tokens, {})
    return config


class ServerThread:
    """``serve`` on its own event loop in a background thread; ``endpoint`` once listening."""

    def __init__(self, config: ServerConfig, insecure: bool = True):
        self.config, self.insecure = config, insecure
        self.endpoint: str | None = None
        self.error: BaseException | None = None
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        def listening(endpoint: str) -> None:
            self.endpoint = endpoint
            self._listening.set()

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await serve(self.config, self.insecure, listening, self._stop)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by join()
            self.error = exc
        finally:
            self._listening.set()

    def start(self) -> "ServerThread":
        self._thread.start()
        self._listening.wait(60)
        if self.error:
            raise self.error
        return self

    def stop(self) -> None:
        """The operator's stop (``serve``'s ``stop``): ``join`` then raises ``StoppedByOperator``."""
        self._loop.call_soon_threadsafe(self._stop.set)

    def join(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the coordinator did not finish in time")
        if self.error:
            raise self.error


def site_config(tmp: Path, site_id: str, endpoint: str, index: int, sites: int, token: str | None = None, **extra) -> SiteConfig:
    if token is None:
        token = enroll(tmp / "tokens.json", site_id, replace=True)
    data = {"site_id": site_id, "token": token, "connect": {"server": endpoint, "backoff_initial_s": 0.1, "max_attempts": 5},
            "data": {"source": "partition", "site_index": index, "num_sites": sites}, "device": "cpu", "threads": 1,
            "allowed_workloads": [*BUILTIN, "tests.helpers.workloads."]}  # the built-ins and the tests' own workloads
    for name, values in extra.items():
        merge = isinstance(data.get(name), dict) and name != "data"
        data[name] = {**data[name], **values} if merge else values
    return SiteConfig.model_validate(data)


class SiteThread:
    def __init__(self, config: SiteConfig, insecure: bool = True):
        self.config, self.insecure = config, insecure
        self.summary = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self.summary = run_site(self.config, self.insecure)
        except BaseException as exc:
            self.error = exc

    def start(self) -> "SiteThread":
        self._thread.start()
        return self

    def join(self, timeout: float = 120):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"site {self.config.site_id} did not finish in time")
        if self.error:
            raise self.error
        return self.summary


def simulate_threads(config: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter) -> dict:
    """:func:`dadfl.server.simulate_processes` with the coordinator and every site in a thread of
    this process instead of a process of its own: the same config files, the same gRPC on
    loopback, the coordinator's records copied into ``metrics``; its summary returned."""
    with tempfile.TemporaryDirectory(prefix="dadfl-threads-") as tmp:
        folder = Path(tmp)
        tokens = enroll_sites(config, folder)
        server_cfg = load_config(server_config_file(config, spec, folder, "127.0.0.1:0"), ServerConfig)
        threads = torch.get_num_threads()
        torch.set_num_threads(config.threads)  # what each process of simulate_processes does
        try:
            server = ServerThread(server_cfg).start()
            site_tomls = site_config_files(config, folder, tokens, server.endpoint)
            sites = [SiteThread(load_config(site_toml, SiteConfig)).start() for site_toml in site_tomls]
            for site in sites:
                site.join()
            server.join()
        finally:
            torch.set_num_threads(threads)
        for record in read_metrics(server_cfg.run_dir / "metrics.jsonl"):
            metrics.write(record)
        return read_summary(server_cfg.run_dir / "summary.json")[0]


def write_toml(path: Path, data: dict) -> Path:
    """A minimal TOML writer for the test configs (tables of scalars, strings, lists, inline tables)."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    def present(table: dict) -> dict:  # TOML has no null: leave unset fields out
        return {k: v for k, v in table.items() if v is not None}

    top = [f"{k} = {value(v)}" for k, v in present(data).items() if not isinstance(v, dict)]
    tables = [
        f"\n[{k}]\n" + "\n".join(f"{kk} = {value(vv)}" for kk, vv in present(v).items())
        for k, v in data.items()
        if isinstance(v, dict)
    ]
    path.write_text("\n".join(top) + "\n" + "\n".join(tables) + "\n")
    return path


def dadfl_command(*args: str) -> list[str]:
    """The ``dadfl`` console script of this interpreter's environment."""
    import sys

    return [sys.executable, "-m", "dadfl.cli", *args]
