"""A real coordinator as a subprocess on loopback (plain text), for the trust benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dadfl.server.processes import write_toml

START_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def write_server_toml(
    tmp: Path, steps: int, strategy: str = "dsgd", optimizer: dict | None = None, federation: dict | None = None,
    workload: dict | None = None, training: dict | None = None,
) -> Path:
    """A run of ``steps`` in ``tmp`` (by default digits-mlp, hidden 64, batch 16); the dicts
    replace or extend those sections."""
    return write_toml(tmp / "server.toml", {
        "run_dir": str(tmp / "run"), "threads": 1,
        "listen": {"address": "127.0.0.1:0", "tokens": str(tmp / "tokens.json")},
        "workload": workload or {"spec": "digits-mlp", "options": {"hidden": 64}},
        "strategy": {"name": strategy},
        "optimizer": optimizer or {},
        "training": {"steps": steps, "batch_size": 16, "eval_every": steps, "checkpoint_every": 0, **(training or {})},
        "federation": federation or {},
    })


def start_coordinator(tmp: Path, config: Path) -> tuple[subprocess.Popen, str]:
    """Start ``dadfl server`` on ``config`` (log in ``tmp/server.log``); its endpoint once it listens."""
    with open(tmp / "server.log", "w") as log:  # the process keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "dadfl.cli", "server", "--config", str(config), "--insecure"], stdout=log,
            stderr=subprocess.STDOUT,
        )
    endpoint_file = tmp / "run" / "endpoint"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not endpoint_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the coordinator did not start; see {tmp / 'server.log'}")
        time.sleep(0.1)
    return process, endpoint_file.read_text()


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB.

    Raises ProcessLookupError once the process has exited: a zombie keeps its
    /proc entry but no memory fields, so a poll can land between the two.
    """
    fields = {}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} is gone") from None
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    if len(fields) < 2:
        raise ProcessLookupError(f"process {pid} has exited")
    return fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (every thread) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK
