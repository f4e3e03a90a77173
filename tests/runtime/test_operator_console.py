"""The operator's commands as real processes against a real run folder: ``dadfl server
--check``, ``dadfl status``, ``dadfl enroll --list``, ``dadfl readmit``, ``dadfl stop``;
a site that cannot reach its coordinator gives up within its bound."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import pytest
from typer.testing import CliRunner

from dadfl.audit import verify
from dadfl.cli import app
from dadfl.client.site import GaveUp
from dadfl.metrics import read_metrics, write_summary
from dadfl.protos.state_file import verify as verify_state_file
from dadfl.server import checkpoint
from dadfl.server.coordinator import StoppedByOperator
from dadfl.server.enrol import enroll
from dadfl.server.preflight import build_replica
from dadfl.server.runtime import serve
from tests.helpers.network import SiteThread, dadfl_command, free_port, server_config, site_config, write_toml

NO_EXAMPLE = '''
import torch.nn.functional as F
from torch import nn
from dadfl.workloads import Workload

def model():
    return Workload(name="no-example", build_model=lambda: nn.Linear(4, 2),
                    loss=lambda o, t: F.cross_entropy(o, t, reduction="none"), metric=lambda o, t: 0.0)
'''


def dadfl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(dadfl_command(*args), capture_output=True, text=True, timeout=timeout)


def server_toml(tmp_path, **sections):
    config = server_config(tmp_path, **sections)
    return config, write_toml(tmp_path / "server.toml", json.loads(config.model_dump_json(exclude_none=True)))


def test_summary_json_is_strict_json():
    import math

    from dadfl.metrics import strict_json

    assert strict_json({"metric": math.nan, "steps": [1.0, math.inf], "name": "x"}) == {"metric": None, "steps": [1.0, None], "name": "x"}


def test_summary_file_parses_strictly_and_reads_back_as_nan(tmp_path):
    import math

    from dadfl.metrics import read_summary

    write_summary(tmp_path / "summary.json", [{"metric": math.nan, "steps": 3}])
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text, parse_constant=pytest.fail) == [{"metric": None, "steps": 3}]
    assert math.isnan(read_summary(tmp_path / "summary.json")[0]["metric"])


def test_the_live_line_fits_80_columns_and_counts_the_sites(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import dadfl.server.progress as progress

    screen = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=screen, width=80, force_terminal=True, color_system=None))
    view = progress.OperatorView(steps=100_000, first_step=12_344, metric_name="accuracy", every_s=60, run_dir=tmp_path, tensorboard=False)
    with view:
        view.waiting(1, 3)
        assert json.loads((tmp_path / "status.json").read_text())["joined"] == 1
        view.bar.refresh()
        assert "waiting: 1/3 sites" in screen.getvalue()
        view.step({"step": 12_344, "train_loss": 0.1234, "bytes_up": 10**9, "bytes_down": 10**9, "seconds": 1.5,
                   "eval_accuracy": 0.9876, "eval_loss": 0.1})
        view.bar.refresh()
    lines = [line for line in screen.getvalue().replace("\r", "\n").split("\n") if "step 12344" in line and "━" in line]
    assert lines and all(len(line.rstrip()) <= 80 for line in lines), lines
    assert "12345/100000" in lines[-1] and "accuracy 0.9876" in lines[-1]


@pytest.mark.network
def test_server_check_and_enroll_refuse_a_workload_that_cannot_run(tmp_path):
    (tmp_path / "no_example.py").write_text(NO_EXAMPLE)
    _, good = server_toml(tmp_path)
    good = good.rename(tmp_path / "good.toml")
    config, bad = server_toml(tmp_path, workload={"spec": "no_example:model", "options": {}, "path": [str(tmp_path)]})
    commands = (["server", "--config", str(good), "--check", "--insecure"],
                ["server", "--config", str(bad), "--check", "--insecure"], ["enroll", "site-a", "--config", str(bad)])
    running = [subprocess.Popen(dadfl_command(*command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for command in commands]
    (checked, _), *refused = [process.communicate(timeout=60) for process in running]
    assert running[0].returncode == 0, checked
    assert "ok: workload digits-mlp builds" in checked and "would listen on" in checked
    for command, process, (output, _) in zip(commands[1:], running[1:], refused):
        assert process.returncode == 2 and "neither example_input nor training data" in output, (command, output)
    assert "site-a" not in config.listen.tokens.read_text()  # no token issued for a run that cannot start
    assert not (tmp_path / "run" / "status.json").exists()  # --check wrote nothing


def test_a_full_state_over_the_payload_bound_is_refused_before_the_run_starts(tmp_path):
    """A site joining after the first step could never receive it: said at start, with the fix."""
    config = server_config(tmp_path, optimizer={"name": "adam", "lr": 0.01}, wire={"max_payload_bytes": 8192})
    with pytest.raises(ValueError, match=r"full state \(weights and adam state\) takes [\d,]+ bytes, more than wire\.max_payload_bytes "
                                         r"\(8,192\).*limits\.max_payload_bytes in the sites' configs"):
        build_replica(config)
    build_replica(server_config(tmp_path, optimizer={"name": "adam", "lr": 0.01}))  # the default bound holds it


@pytest.mark.network
def test_a_site_that_cannot_reach_its_coordinator_gives_up_within_its_bound(tmp_path):
    token = enroll(tmp_path / "tokens.json", "site-a")
    path = write_toml(tmp_path / "site.toml", {
        "site_id": "site-a", "token": token, "device": "cpu",
        "connect": {"server": f"127.0.0.1:{free_port()}", "backoff_initial_s": 0.2, "give_up_after_s": 2.0},
        "data": {"source": "partition", "site_index": 0, "num_sites": 2},
    })
    result = dadfl("site", "--config", str(path), "--insecure")
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "gave up after 2 s" in output, output
    assert output.count("not reachable yet") == 1 and "reconnecting" not in output  # one line while it tries


@pytest.mark.slow
@pytest.mark.network
def test_status_list_readmit_and_stop_against_a_running_coordinator(tmp_path):
    """The commands as processes against a coordinator process waiting for its sites."""
    config, path = server_toml(tmp_path, federation={"min_sites": 2, "quorum_timeout_s": 120})
    enroll(config.listen.tokens, "site-0")
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "quarantine.json").write_text(json.dumps({"site-x": {"refusals": 3, "step": 7, "reason": "bad upload"}}))
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(dadfl_command("server", "--config", str(path), "--insecure"), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (config.run_dir / "endpoint").exists())  # listening
        commands = [["status"], ["enroll", "--list"], ["readmit", "site-x"]]  # at once: each process imports torch
        running = [subprocess.Popen(dadfl_command(*command, "--config", str(path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for command in commands]
        (status, _), (listed, _), (readmitted, _) = [process.communicate(timeout=60) for process in running]
        assert [process.returncode for process in running] == [0, 0, 0], (status, listed, readmitted)
        assert "phase: waiting for sites" in status and "sites: 0/2 joined" in status and "step: 0 of 4" in status, status
        assert "1 site(s) enrolled" in listed and "site-0: enrolled" in listed, listed
        assert "site site-x re-admitted" in readmitted and json.loads((config.run_dir / "quarantine.json").read_text()) == {}

        stopped = dadfl("stop", "--config", str(path))
        assert stopped.returncode == 0 and "stopped after 0 of 4 steps" in stopped.stdout, stopped.stdout + stopped.stderr
        server.wait(timeout=60)
    finally:
        server.kill()
        log.close()
    output = (tmp_path / "server.log").read_text()
    assert server.returncode == 0, output[-3000:]
    assert "stopped by the operator after 0 of 4 steps; no step was committed" in output.strip().splitlines()[-1], output[-3000:]
    # Once it has stopped, the same commands in this process (the processes above showed them as such).
    after, again = (CliRunner().invoke(app, [command, "--run-dir", str(config.run_dir)]) for command in ("status", "stop"))
    assert "phase: stopped by the operator" in after.output and "quarantined: none" in after.output, after.output
    assert again.exit_code == 1 and "nothing to stop" in again.output  # nothing runs any more
    operator = [(r["event"], r.get("command"), r.get("action")) for r in verify(config.run_dir / "audit.jsonl").records]
    assert operator == [("run", None, "started"), ("operator", "readmit", None), ("operator", "stop", None), ("run", None, "stopped by the operator")]


@pytest.mark.network
def test_a_stop_mid_run_checkpoints_the_committed_steps_and_tells_the_sites(tmp_path, caplog):
    config = server_config(tmp_path, training={"steps": 100_000, "checkpoint_every": 0, "eval_every": 100_000})
    stop, done, errors, endpoint = asyncio.Event(), threading.Event(), [], []
    loop = asyncio.new_event_loop()

    def main() -> None:
        try:
            loop.run_until_complete(serve(config, True, endpoint.append, stop=stop))
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=main, daemon=True).start()
    wait_for(lambda: endpoint)
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", endpoint[0], i, 2, connect={"give_up_after_s": 1.0, "backoff_initial_s": 0.2})).start()
             for i in range(2)]
    wait_for(lambda: len(list_steps(config.run_dir)) >= 3)
    loop.call_soon_threadsafe(stop.set)
    assert done.wait(60)
    assert len(errors) == 1 and isinstance(errors[0], StoppedByOperator), errors
    committed = len(list_steps(config.run_dir))
    assert f"after {committed} of 100000 steps; checkpoint at step {committed} in" in str(errors[0])
    with (config.run_dir / checkpoint.CHECKPOINT).open("rb") as file:
        assert json.loads(verify_state_file(file, checkpoint.MAGIC)[0])["next_step"] == committed
    for site in sites:  # told why, then gave up within their bound: no coordinator any more
        with pytest.raises(GaveUp, match="gave up after 1 s"):
            site.join(60)
    told = [r for r in caplog.records if r.name == "dadfl.site" and "the coordinator's operator stopped run" in r.getMessage()]
    assert len(told) == 2
    assert json.loads((config.run_dir / "status.json").read_text())["phase"] == "stopped by the operator"


def wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def list_steps(run_dir) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    return [record["step"] for record in read_metrics(metrics)] if metrics.exists() else []
