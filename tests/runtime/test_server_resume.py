"""Checkpoints are atomic; a coordinator killed mid-run resumes from its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from dadfl.metrics import read_metrics
from dadfl.server import checkpoint
from dadfl.server.coordinator import Coordinator
from tests.helpers.network import SiteThread, dadfl_command, free_port, server_config, site_config, write_toml


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def records(run_dir):
    path = run_dir / "metrics.jsonl"
    return list(read_metrics(path)) if path.exists() else []


@pytest.mark.slow
@pytest.mark.network
def test_killed_server_resumes_from_its_checkpoint_and_sites_follow(tmp_path):
    port, steps = free_port(), 150
    config = server_config(
        tmp_path,
        listen={"address": f"127.0.0.1:{port}"},
        training={"steps": steps, "eval_every": 50, "checkpoint_every": 5},
        federation={"min_sites": 2, "phase_timeout_s": 10, "linger_s": 5},
    )
    toml = write_toml(tmp_path / "server.toml", config.model_dump(mode="json"))
    run_dir = config.run_dir
    # the sites wait for a server process to start, twice: that can take minutes on a busy machine
    connect = {"max_attempts": 2000, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", f"127.0.0.1:{port}", i, 2, connect=connect)).start() for i in range(2)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "first.log").open("w+")
    first = subprocess.Popen(dadfl_command("server", "--config", str(toml), "--insecure"), env=env, stderr=log, text=True)
    try:
        wait_for(lambda: len(records(run_dir)) >= 12 or first.poll() is not None, 300, "the first server to run 12 steps")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        first.kill()
    saved = records(run_dir)
    assert len(saved) < steps, "the run finished before the kill: make it longer"
    resumed_at = (len(saved) // 5) * 5
    # SIGKILL may land mid-write and leave checkpoint.pt.tmp; the renamed file is always whole.
    assert (run_dir / checkpoint.CHECKPOINT).exists()

    second = subprocess.run(dadfl_command("server", "--config", str(toml), "--insecure"), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"at step {resumed_at}" in second.stderr or f"at step {resumed_at - 5}" in second.stderr, second.stderr[-3000:]
    final = records(run_dir)
    assert [r["step"] for r in final] == list(range(steps)), "every step exactly once, none lost, none doubled"
    summaries = [s.join(60) for s in sites]
    assert {s.fingerprint for s in summaries} == {final[-1]["fingerprint"]}
    assert all(s.connections >= 2 for s in summaries)
    assert (run_dir / checkpoint.FINAL_MODEL).exists()


def test_resume_refuses_a_checkpoint_of_a_different_run(tmp_path):
    config = server_config(tmp_path)
    coordinator = Coordinator(config)
    checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {})
    assert Coordinator(config).step == 3
    other = server_config(tmp_path, strategy={"name": "dad"})
    with pytest.raises(ValueError, match="different strategy"):
        Coordinator(other)


def test_a_record_cut_short_by_a_kill_is_not_read_and_the_resume_trims_it(tmp_path):
    """A coordinator killed while writing a step's record leaves a last line without its newline
    (that step has no checkpoint yet and runs again); a reader polling the file mid-write sees the
    same. Neither raises, and trimming for the resume drops that line; a broken complete line still raises."""
    path = tmp_path / "metrics.jsonl"
    complete = [json.dumps({"step": step, "train_loss": 1.0 / (step + 1)}) + "\n" for step in range(3)]
    path.write_text("".join(complete) + '{"step": 3, "train_loss": 0.')
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    checkpoint.trim_metrics(path, next_step=3)
    assert path.read_text() == "".join(complete)
    path.write_text(complete[0] + '{"step": 1, "train_loss": 0.\n' + complete[2])
    with pytest.raises(json.JSONDecodeError):
        list(read_metrics(path))
