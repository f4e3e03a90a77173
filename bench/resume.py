"""``python -m bench.resume``: how far a killed and restarted federation ends from an uninterrupted one.

For each strategy, three runs of the same digits-mlp federation (a ``dadfl server`` and two
``dadfl site`` processes on loopback, ``min_sites`` = every site): uninterrupted; the
coordinator SIGKILLed after ``--kill-after`` steps and restarted (it resumes from its last
checkpoint); site-1 SIGKILLed after ``--kill-after`` steps and started again. Prints the
largest absolute difference of any weight of the final ``model.pt`` from the uninterrupted
run's (0.0 = bit-identical).

    python -m bench.resume --strategies dad,rankdad,powersgd --out /tmp/resume-bench
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from dadfl.client.config import SiteConfig
from dadfl.metrics import read_metrics
from dadfl.server.enrol import enroll
from dadfl.server.processes import free_port, write_toml

OPTIONS = {
    "dad": {"downlink": "factors"},
    "rankdad": {"rank": 2, "raw_input": "low_rank", "reduce_on_server": True},
    "powersgd": {"rank": 1, "start_iter": 2},
}


class Federation:
    def __init__(self, folder: Path, strategy: str, steps: int, checkpoint_every: int):
        folder.mkdir(parents=True)
        self.folder, self.steps, port = folder, steps, free_port()
        self.run_dir = folder / "run"
        self.server_toml = write_toml(folder / "server.toml", {
            "run_dir": str(self.run_dir), "threads": 1,
            "listen": {"address": f"127.0.0.1:{port}", "tokens": str(folder / "tokens.json")},
            "workload": {"spec": "digits-mlp", "options": {"hidden": 16}},
            "strategy": {"name": strategy, "options": OPTIONS[strategy]},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "training": {"steps": steps, "batch_size": 16, "eval_every": steps, "checkpoint_every": checkpoint_every},
            "federation": {"min_sites": 2, "phase_timeout_s": 20, "quorum_timeout_s": 120, "linger_s": 5},
        })
        keeps_state = "state_dir" in SiteConfig.model_fields
        self.site_tomls = []
        for index in range(2):
            site_id = f"site-{index}"
            site = {
                "site_id": site_id, "token": enroll(folder / "tokens.json", site_id, replace=True), "device": "cpu", "threads": 1,
                "connect": {"server": f"127.0.0.1:{port}", "backoff_initial_s": 0.05, "backoff_max_s": 0.2, "max_attempts": 400},
                "data": {"source": "partition", "site_index": index, "num_sites": 2},
            }
            if keeps_state:
                site["state_dir"] = str(folder / f"{site_id}-state")
            self.site_tomls.append(write_toml(folder / f"{site_id}.toml", site))
        self.server = self.start("server", self.server_toml)
        self.sites = [self.start("site", toml) for toml in self.site_tomls]

    def start(self, kind: str, toml: Path) -> subprocess.Popen:
        log = (self.folder / f"{toml.stem}.log").open("a")
        command = [sys.executable, "-m", "dadfl.cli", kind, "--config", str(toml), "--insecure"]
        return subprocess.Popen(command, stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def records(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(list(read_metrics(path))) if path.exists() else 0

    def kill_after(self, steps: int, which: str) -> None:
        while self.records() < steps:
            if self.server.poll() is not None:
                raise RuntimeError(f"the server stopped early; see {self.folder / 'server.log'}")
            time.sleep(0.01)
        if which == "coordinator":
            self.server.send_signal(signal.SIGKILL)
            self.server.wait()
            self.server = self.start("server", self.server_toml)
        else:
            self.sites[1].send_signal(signal.SIGKILL)
            self.sites[1].wait()
            self.sites[1] = self.start("site", self.site_tomls[1])

    def finish(self) -> dict[str, torch.Tensor]:
        for process in [self.server, *self.sites]:
            if process.wait(600) != 0:
                raise RuntimeError(f"a process of {self.folder} exited with {process.returncode}; see its logs")
        return torch.load(self.run_dir / "model.pt", weights_only=True)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="dad,rankdad,powersgd")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-after", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the runs and their logs")
    args = parser.parse_args(argv)
    print("strategy  interrupted  max_abs_diff  (0.0 = bit-identical)")
    for strategy in args.strategies.split(","):
        reference = Federation(args.out / strategy / "uninterrupted", strategy, args.steps, args.checkpoint_every)
        runs = {}
        for which in ("coordinator", "site"):
            federation = Federation(args.out / strategy / f"{which}-killed", strategy, args.steps, args.checkpoint_every)
            federation.kill_after(args.kill_after, which)
            runs[which] = federation.finish()
        model = reference.finish()
        for which, final in runs.items():
            print(f"{strategy:9} {which:12} {max_abs_diff(model, final):.3g}", flush=True)


if __name__ == "__main__":
    main()
