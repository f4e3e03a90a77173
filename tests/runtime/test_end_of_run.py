"""The end of a run: a site that joins while the last step ends, or after it, hears
`finished`, gets the final model and stops at once; the server stops listening after linger_s."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import threading
import time

import pytest

import dadfl.client.site as site_module
from dadfl.metrics import read_metrics
from dadfl.server import checkpoint
from dadfl.server.coordinator import Coordinator
from dadfl.server.links import Closed, SiteLink
from tests.helpers.network import ServerThread, SiteThread, dadfl_command, server_config, site_config, write_toml

LATE = "late"


class LateReady(site_module.Session):
    """The late site says hello during the run but answers `ready` only once the run has finished."""

    run_dir = None
    configured: threading.Event  # set once the late site holds the run config: its hello is in

    def handle(self, message):
        if self.site.config.site_id == LATE and message.WhichOneof("kind") == "config":
            LateReady.configured.set()
            deadline = time.monotonic() + 60
            while not (LateReady.run_dir / checkpoint.FINAL_MODEL).exists():
                assert time.monotonic() < deadline, "the run did not finish"
                time.sleep(0.02)
        return super().handle(message)


@pytest.mark.network
def test_site_whose_ready_comes_after_the_last_step_is_told_finished(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    # linger_s is an hour: a server that waited for it would outlast every join below
    config = server_config(tmp_path, training={"steps": 3}, federation={"min_sites": 1, "linger_s": 3600})
    LateReady.run_dir, LateReady.configured = config.run_dir, threading.Event()
    monkeypatch.setattr(site_module, "Session", LateReady)
    server = ServerThread(config).start()
    late = SiteThread(site_config(tmp_path, LATE, server.endpoint, 1, 2)).start()
    assert LateReady.configured.wait(120), "the late site never got the run config"  # its hello is in before the run starts
    honest = SiteThread(site_config(tmp_path, "honest", server.endpoint, 0, 2)).start()
    summary = late.join(120)
    assert honest.join(120).steps == 3
    server.join(120)  # it stopped once every site heard the run finished, not after linger_s
    final = list(read_metrics(tmp_path / "run" / "metrics.jsonl"))[-1]["fingerprint"]
    assert summary.finished and summary.connections == 1 and summary.steps == 0
    assert summary.fingerprint == final, "the late site loaded the final model"
    assert "CancelledError" not in caplog.text and "Traceback" not in caplog.text


@pytest.mark.network
def test_site_joining_a_finished_run_exits_0_promptly(tmp_path):
    # linger_s is an hour: a server that waited for it would outlast the joins below
    config = server_config(tmp_path, training={"steps": 2}, federation={"min_sites": 1, "linger_s": 3600})
    server = ServerThread(config).start()
    SiteThread(site_config(tmp_path, "first", server.endpoint, 0, 1)).start().join(60)
    server.join(90)
    # a second `docker compose up`: the server resumes a finished run, a site of the federation starts
    again = ServerThread(config).start()
    site_toml = site_config(tmp_path, "first", again.endpoint, 0, 1).model_dump(mode="json", exclude_none=True)
    result = subprocess.run([*dadfl_command("site", "--config", str(write_toml(tmp_path / "site.toml", site_toml)), "--insecure")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "has finished" in result.stdout and "0 steps" in result.stdout
    again.join(120)  # it stopped once every enrolled site heard it, not after linger_s


@pytest.mark.network
def test_ctrl_c_stops_the_coordinator_with_one_line_and_no_traceback(tmp_path):
    """Ctrl-C while sites are connected: a clean stop (the step finishes, checkpoint, the
    sites told, exit 0), their streams end before the process does (gRPC printed a
    CancelledError traceback per stream before)."""
    config = server_config(tmp_path, training={"steps": 100_000, "eval_every": 1000, "checkpoint_every": 0}, federation={"min_sites": 1})
    server_toml = write_toml(tmp_path / "server.toml", config.model_dump(mode="json", exclude_none=True))
    server = subprocess.Popen(dadfl_command("server", "--config", str(server_toml), "--insecure"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (config.run_dir / "endpoint").exists():
            assert time.monotonic() < deadline and server.poll() is None, "the coordinator did not start"
            time.sleep(0.05)
        endpoint = (config.run_dir / "endpoint").read_text()
        for index in range(2):
            SiteThread(site_config(tmp_path, f"s{index}", endpoint, index, 2, connect={"max_attempts": 2})).start()
        while not (config.run_dir / "metrics.jsonl").exists() or len(list(read_metrics(config.run_dir / "metrics.jsonl"))) < 20:
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        server.send_signal(signal.SIGINT)
        stdout, stderr = server.communicate(timeout=30)
    finally:
        server.kill()
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert server.returncode == 0, stderr
    assert "stopped by the operator after" in stdout.strip().splitlines()[-1] and "checkpoint at step" in stdout, stdout
    assert (config.run_dir / "checkpoint.pt").exists()


def test_a_ctrl_c_that_lands_with_a_site_answer_still_stops_the_step(tmp_path):
    """Ctrl-C cancels the coordinator's task. When the cancel lands in the loop turn that
    brings a site's answer, the wait for answers must still end cancelled: with
    ``asyncio.wait_for`` (Python 3.11) it returned the answer instead, the run went on and
    the Ctrl-C above went unheard once in a busy run."""
    coordinator = Coordinator(server_config(tmp_path))

    async def cancel_as_an_answer_arrives():
        link = SiteLink("s0", "peer", coordinator.arrivals)
        answers = []

        async def collect():
            async for answer in coordinator._answers([link], 0, 0, 0):
                answers.append(answer)

        task = asyncio.create_task(collect())
        await asyncio.sleep(0)  # the task now waits for an answer
        link.deliver(Closed("the site left"))
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        return task, answers

    task, answers = asyncio.run(cancel_as_an_answer_arrives())
    assert task.done() and task.cancelled() and answers == []
