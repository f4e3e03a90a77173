"""``dadfl.server.processes`` — multi-process simulation: one coordinator and N site processes over loopback gRPC.

``simulate_processes`` has the signature and output of the in-process
:func:`dadfl.simulation.simulate`: the same records (plus wire bytes and per-phase
seconds) in the caller's metrics file, the same summary. Each site process holds one
partition of the built-in workload (the same partition and batch seeds as the in-process
mode), so with the same config both modes train bit-identical models. The processes
talk plain text on 127.0.0.1; every file lives in a temporary folder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from dadfl.metrics import MetricsWriter, read_summary
from dadfl.privacy.accounting import site_sample_rate
from dadfl.simulation import SimulationConfig, StrategySpec

from .enrol import enroll
from .runtime import ENDPOINT_FILE

POLL_S = 0.05


class ProcessFailed(RuntimeError):
    """A coordinator or site process of the simulation exited with an error."""


# Every process of a simulation is the user's own, on one machine: the payload bound is there
# to stop a peer's claims, so here it only has to admit the largest full state (a 100M-parameter
# model with Adam's moments is 1.2 GB, over the 1 GiB default).
SIMULATION_PAYLOAD_BYTES = 1 << 36


def _toml_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, dict) else "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"


def write_toml(path: Path, tables: dict[str, Any]) -> Path:
    """Scalars first, then one [table] per dict; JSON literals are valid TOML for our values."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dp_sample_rate(config: SimulationConfig) -> float:
    """The largest Poisson rate of the simulation's sites (what the in-process mode's accountant uses)."""
    if config.dp.max_sample_rate is not None:
        return config.dp.max_sample_rate
    from dadfl.workloads import load_workload, partition

    workload = load_workload(config.workload, config.workload_path, **config.workload_options)
    train = workload.training_data()
    indices = partition(config.sites, len(train), config.partition, labels=workload.labels, alpha=config.alpha, seed=config.seed)
    return max(site_sample_rate(config.batch_size, len(index)) for index in indices)


def simulation_configs(config: SimulationConfig, spec: StrategySpec, folder: Path, address: str,
                       site_address: str | None = None, site_devices: dict[int, str] | None = None) -> tuple[Path, list[Path]]:
    """The server config and one config per site, enrolled, in ``folder``. Sites connect to
    ``site_address`` when given (a relay in front of the coordinator), else to ``address``;
    a site named in ``site_devices`` (by index) trains on that device instead of ``config.device``."""
    tokens = enroll_sites(config, folder)
    return server_config_file(config, spec, folder, address), site_config_files(config, folder, tokens, site_address or address, site_devices)


def enroll_sites(config: SimulationConfig, folder: Path) -> dict[str, str]:
    """Each site's id and token, enrolled in ``folder/tokens.json``."""
    # zero-padded: site-id order is site-index order
    return {site_id: enroll(folder / "tokens.json", site_id) for site_id in (f"site-{index:03d}" for index in range(config.sites))}


def server_config_file(config: SimulationConfig, spec: StrategySpec, folder: Path, address: str) -> Path:
    """``folder/server.toml``: the coordinator of the simulation, listening on ``address``."""
    return write_toml(
        folder / "server.toml",
        {
            "run_dir": str(folder / "run"),
            "threads": config.threads,
            "listen": {"address": address, "tokens": str(folder / "tokens.json")},
            "workload": {"spec": config.workload, "options": config.workload_options, "path": [str(p.resolve()) for p in config.workload_path]},
            "strategy": {"name": spec.name, "options": spec.options, "label": spec.display},
            "optimizer": config.optimizer.model_dump(),
            # no plots: the folder is temporary (the caller draws its own from the records)
            "training": {"steps": config.steps, "batch_size": config.batch_size, "eval_every": config.eval_every, "checkpoint_every": 0,
                         "precision": config.precision, "plots": False},
            "wire": {"max_payload_bytes": SIMULATION_PAYLOAD_BYTES},
            "federation": {
                "min_sites": config.sites, "initial_sites": config.sites, "linger_s": 0,
                "clip_ratio": config.clip_ratio, "agreement": config.agreement,
                "agreement_margin": config.agreement_margin, "agreement_momentum": config.agreement_momentum,
                "full_count_share": config.full_count_share,
                "phase_timeout_s": config.phase_timeout_s,
            },
            **({"dp": {**config.dp.model_dump(exclude_none=True), "max_sample_rate": dp_sample_rate(config)}} if config.dp else {}),
        },
    )


def site_config_files(config: SimulationConfig, folder: Path, tokens: dict[str, str], address: str,
                      site_devices: dict[int, str] | None = None) -> list[Path]:
    """``folder/SITE_ID.toml`` for each site of ``tokens`` (in site-index order), dialling ``address``."""
    sites = []
    for index, (site_id, token) in enumerate(tokens.items()):
        sites.append(
            write_toml(
                folder / f"{site_id}.toml",
                {
                    "site_id": site_id,
                    "token": token,
                    "allowed_workloads": [config.workload],  # the simulation's own workload, built-in or not
                    "device": (site_devices or {}).get(index, config.device),
                    "threads": config.threads,
                    "limits": {"max_payload_bytes": SIMULATION_PAYLOAD_BYTES},
                    "workload_path": [str(p.resolve()) for p in config.workload_path],
                    # retry until the coordinator listens (bench/links.py starts every process at once)
                    "connect": {"server": address, "backoff_initial_s": 0.2, "backoff_max_s": 1.0, "max_attempts": 100},
                    "data": {
                        "source": "partition", "scheme": config.partition, "site_index": index,
                        "num_sites": config.sites, "alpha": config.alpha, "seed": config.seed,
                    },
                },
            )
        )
    return sites


def _module(package: str, *args: str) -> list[str]:
    # ``python -m dadfl.server`` / ``dadfl.client`` skip the plotting imports of the full CLI
    return [sys.executable, "-m", package, *args]


def simulate_processes(
    config: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter, progress: Callable[[int], None] | None = None,
    site_env: dict[int, dict[str, str]] | None = None, site_devices: dict[int, str] | None = None,
) -> dict[str, Any]:
    """Train one strategy with real processes; copy the coordinator's records into ``metrics``.

    ``site_env`` adds environment variables to the process of a site by index: e.g.
    ``{1: {"ATEN_CPU_CAPABILITY": "default"}}`` runs site 1 on another machine's kernels;
    ``site_devices`` puts a site on another device (``{1: "cuda"}``)."""
    with tempfile.TemporaryDirectory(prefix="dadfl-processes-") as tmp:
        folder = Path(tmp)
        tokens = enroll_sites(config, folder)
        # Port 0: the coordinator takes a free port when it listens and writes it to its run
        # folder; a port chosen here and handed over could be taken by then.
        server_toml = server_config_file(config, spec, folder, "127.0.0.1:0")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        logs: dict[str, Path] = {}
        processes: dict[str, subprocess.Popen] = {}

        def start(name: str, command: list[str], extra_env: dict[str, str] | None = None) -> None:
            logs[name] = folder / f"{name}.log"
            with logs[name].open("w") as log:
                processes[name] = subprocess.Popen(command, cwd=folder, env={**env, **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT)

        try:
            start("coordinator", _module("dadfl.server", "--config", str(server_toml), "--insecure"))
            endpoint = _endpoint(folder / "run" / ENDPOINT_FILE, processes["coordinator"], logs["coordinator"])
            site_tomls = site_config_files(config, folder, tokens, endpoint, site_devices)
            for index, site_toml in enumerate(site_tomls):
                start(site_toml.stem, _module("dadfl.client", "--config", str(site_toml), "--insecure"), (site_env or {}).get(index))
            _follow(folder / "run" / "metrics.jsonl", processes, logs, metrics, progress)
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
        summary = folder / "run" / "summary.json"
        if not summary.exists():
            raise ProcessFailed(f"the coordinator exited without writing {summary.name}:\n{logs['coordinator'].read_text()[-3000:]}")
        return read_summary(summary)[0]  # the coordinator's summary of its records (metrics.run_summary)


def _endpoint(path: Path, coordinator: subprocess.Popen, log: Path) -> str:
    """The address the coordinator listens on, once it does."""
    while not path.exists():
        if coordinator.poll() is not None:
            raise ProcessFailed(f"coordinator exited with {coordinator.returncode} before listening:\n{log.read_text()[-3000:]}")
        time.sleep(POLL_S)
    return path.read_text()


def _follow(path: Path, processes: dict, logs: dict, metrics: MetricsWriter, progress) -> None:
    """Copy records as the coordinator writes them, until every process has exited."""
    offset = 0
    while True:
        running = [name for name, p in processes.items() if p.poll() is None]
        failed = [name for name, p in processes.items() if p.returncode not in (None, 0)]
        if path.exists():
            with path.open() as file:
                file.seek(offset)
                for line in iter(file.readline, ""):
                    if not line.endswith("\n"):
                        break  # a record being written: read it next time
                    offset += len(line.encode())
                    record = json.loads(line)
                    metrics.write(record)
                    if progress:
                        progress(record["step"])
        if failed:
            name = failed[0]
            raise ProcessFailed(f"{name} exited with {processes[name].returncode}:\n{logs[name].read_text()[-3000:]}")
        if not running:
            return
        time.sleep(POLL_S)
