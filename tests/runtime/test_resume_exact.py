"""Bit-identical resume: a SIGKILLed coordinator restarted from its checkpoint, and a SIGKILLed
site that rejoins, end with exactly the model of an uninterrupted run (real processes, loopback)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dadfl.metrics import read_metrics
from dadfl.server import checkpoint
from tests.helpers.network import ServerThread, SiteThread, dadfl_command, free_port, server_config, site_config, write_toml

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process

# Three sites: the robust rule weighs agreement, so each site's standing and, on momenta (dAD,
# rank-dAD: agreement_momentum), its momentum (coordinator state) go through the kill and the resume too.
STEPS, SITES, CHECKPOINT_EVERY = 60, 3, 6
SERVER_KILL_AFTER, SITE_KILL_AFTER = 8, 30
STRATEGIES = {
    "dad": {"downlink": "factors"},
    "rankdad": {"rank": 2, "raw_input": "low_rank", "reduce_on_server": True},
    "powersgd": {"rank": 1, "start_iter": 2},
    "diloco": {"local_steps": 2, "inner_lr": 0.003},  # each site's AdamW moments, the outer momentum
}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def configs(tmp: Path, strategy: str, port: int = 0):
    """A digits-mlp run of STEPS steps that needs every site (``min_sites`` = all)."""
    server = server_config(
        tmp,
        threads=1,
        listen={"address": f"127.0.0.1:{port}"},
        strategy={"name": strategy, "options": STRATEGIES[strategy]},
        training={"steps": STEPS, "batch_size": 16, "eval_every": STEPS, "checkpoint_every": CHECKPOINT_EVERY},
        federation={"min_sites": SITES, "phase_timeout_s": 20, "quorum_timeout_s": 60, "linger_s": 5, "agreement_momentum": 0.9},
    )
    connect = {"max_attempts": 2000, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}  # minutes on a busy machine
    sites = [  # none while the port is not known yet (0: the server picks one)
        site_config(tmp, f"site-{i}", f"127.0.0.1:{port}", i, SITES, connect=connect, state_dir=str(tmp / f"site-{i}-state"))
        for i in range(SITES if port else 0)
    ]
    return server, sites


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / checkpoint.FINAL_MODEL, weights_only=True)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return list(read_metrics(path)) if path.exists() else []


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Federation:
    """A ``dadfl server`` process, site-1 as a ``dadfl site`` process, the other sites in threads."""

    def __init__(self, tmp: Path, strategy: str):
        self.tmp = tmp
        self.server_cfg, site_cfgs = configs(tmp, strategy, port=free_port())
        self.server_toml = write_toml(tmp / "server.toml", self.server_cfg.model_dump(mode="json"))
        self.site_toml = write_toml(tmp / "site-1.toml", site_cfgs[1].model_dump(mode="json"))
        self.server = self.start("server", self.server_toml)
        self.process_site = self.start("site", self.site_toml)
        # A slow machine can take longer to start the server than a site retries for.
        wait_for(lambda: "coordinator listening" in self.log("server"), 180, "the coordinator to listen")
        self.thread_sites = [SiteThread(c).start() for i, c in enumerate(site_cfgs) if i != 1]

    def start(self, kind: str, toml: Path) -> subprocess.Popen:
        log = (self.tmp / f"{toml.stem}.log").open("a")
        return subprocess.Popen(dadfl_command(kind, "--config", str(toml), "--insecure"), env=ENV, stderr=log, stdout=log)

    def kill_after(self, steps: int, process: subprocess.Popen) -> int:
        """SIGKILL ``process`` once the run is ``steps`` steps in; return the steps done by then."""
        run_dir = self.server_cfg.run_dir
        wait_for(lambda: len(records(run_dir)) >= steps or self.server.poll() is not None, 180, f"{steps} steps")
        assert self.server.poll() is None, self.log("server")
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        done = len(records(run_dir))
        assert done < STEPS, "the run finished before the kill: make it longer"
        return done

    def finish(self) -> dict[str, torch.Tensor]:
        assert self.server.wait(120) == 0, self.log("server")
        assert self.process_site.wait(60) == 0, self.log("site-1")
        self.thread_site_summaries = [site.join(60) for site in self.thread_sites]
        assert [r["step"] for r in records(self.server_cfg.run_dir)] == list(range(STEPS)), "every step once, none lost or doubled"
        return final_model(self.server_cfg.run_dir)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def stop(self) -> None:
        for process in (self.server, self.process_site):
            if process.poll() is None:
                process.kill()
                process.wait(10)


def uninterrupted(tmp: Path, strategy: str) -> tuple[ServerThread, list[SiteThread]]:
    """The reference: the same run with nobody killed, the coordinator and both sites in
    threads of this process (on one torch thread, as each process of the killed run)."""
    server_cfg, _ = configs(tmp, strategy)
    server = ServerThread(server_cfg).start()
    _, site_cfgs = configs(tmp, strategy, port=int(server.endpoint.rsplit(":", 1)[1]))
    return server, [SiteThread(c).start() for c in site_cfgs]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_killed_coordinator_and_killed_site_resume_bit_identically(tmp_path, strategy):
    """One run per strategy: the coordinator is SIGKILLed and restarted from its checkpoint
    (it replays the steps after it), later a site process is SIGKILLed and started again."""
    for name in ("reference", "killed"):
        (tmp_path / name).mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference_server, reference_sites = uninterrupted(tmp_path / "reference", strategy)  # alongside the killed run
        federation = Federation(tmp_path / "killed", strategy)
        try:
            done = federation.kill_after(SERVER_KILL_AFTER, federation.server)
            # SIGKILL may land mid-write and leave checkpoint.pt.tmp; the renamed file is always whole.
            assert (federation.server_cfg.run_dir / checkpoint.CHECKPOINT).exists()
            federation.server = federation.start("server", federation.server_toml)
            federation.kill_after(SITE_KILL_AFTER, federation.process_site)
            federation.process_site = federation.start("site", federation.site_toml)
            resumed = federation.finish()
        finally:
            federation.stop()
        reference_server.join()
        for site in reference_sites:
            site.join()
    finally:
        torch.set_num_threads(threads)
    reference = final_model(tmp_path / "reference" / "run")
    server_log = federation.log("server")
    assert "resuming run" in server_log and "site-1 joined" in server_log.rsplit("resuming run", 1)[1]
    last_checkpoint = done // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # or the one before, if the kill hit its write
    assert re.search(rf"resuming run \S+ at step ({last_checkpoint}|{last_checkpoint - CHECKPOINT_EVERY}) ", server_log), server_log[-3000:]
    assert all(s.connections >= 2 for s in federation.thread_site_summaries), "the thread sites followed the restarted coordinator"
    standing = [r.get("robust_standing") for r in records(tmp_path / "killed" / "run")]
    assert standing == [r.get("robust_standing") for r in records(tmp_path / "reference" / "run")] and standing[-1], "standing resumed"
    assert "strategy state reset" not in server_log
    saved = sorted(p.name for p in (tmp_path / "killed" / "site-1-state").rglob("half-*.pt"))
    assert 1 <= len(saved) <= 3, f"a site keeps only the states the server may ask for, not {saved}"
    diff = max_abs_diff(reference, resumed)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference), f"{strategy}: max abs diff {diff}"


def test_a_site_without_the_steps_state_resets_strategy_state_everywhere(tmp_path, caplog):
    """The case that cannot be restored: a site joins mid-run with no strategy state. Every
    replica resets at that step (one log line says why) and the replicas stay identical."""
    server_cfg, _ = configs(tmp_path, "powersgd")
    long_run = server_cfg.training.model_copy(update={"steps": 200, "eval_every": 200})  # time for the late site to join
    server_cfg = server_cfg.model_copy(update={"training": long_run})
    caplog.set_level(logging.WARNING, logger="dadfl.server")
    server = ServerThread(server_cfg).start()
    _, site_cfgs = configs(tmp_path, "powersgd", port=int(server.endpoint.rsplit(":", 1)[1]))
    sites = [SiteThread(c).start() for c in site_cfgs]
    wait_for(lambda: len(records(server_cfg.run_dir)) >= 5, 60, "5 steps")
    late = site_config(tmp_path, "site-late", server.endpoint, 0, SITES, connect=site_cfgs[0].connect.model_dump())
    sites.append(SiteThread(late).start())
    server.join()
    summaries = [site.join() for site in sites]
    resets = [r.getMessage() for r in caplog.records if "strategy state reset" in r.getMessage()]
    assert len(resets) == 1 and "site-late cannot restore the strategy state" in resets[0], resets
    history = records(server_cfg.run_dir)
    assert {s.fingerprint for s in summaries} == {history[-1]["fingerprint"]}
    assert history[-1]["sites"] == SITES + 1
