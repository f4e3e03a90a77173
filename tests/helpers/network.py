"""Helpers of the networked-runtime tests: a coordinator in a thread, sites in threads, configs.

Everything here runs the real components (gRPC server and channels on loopback, real
TLS, real files); threads only save the seconds a fresh Python process costs.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from dadfl.client.config import SiteConfig
from dadfl.client.site import run_site
from dadfl.server.config import ServerConfig
from dadfl.server.enrol import enroll, write_tokens
from dadfl.server.processes import free_port  # noqa: F401 (for the tests that import it from here)
from dadfl.server.runtime import serve
from dadfl.workloads import BUILTIN


def server_config(tmp: Path, **sections) -> ServerConfig:
    """A small digits-mlp run in ``tmp``: 2 sites, a few steps, short timeouts."""
    base = {
        "run_dir": str(tmp / "run"),
        "listen": {"address": "127.0.0.1:0", "tokens": str(tmp / "tokens.json")},
        "workload": {"spec": "digits-mlp", "options": {"hidden": 16}},
        "strategy": {"name": "dsgd"},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "training": {"steps": 4, "batch_size": 16, "eval_every": 2, "checkpoint_every": 2},
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

        try:
            asyncio.run(serve(self.config, self.insecure, listening))
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
