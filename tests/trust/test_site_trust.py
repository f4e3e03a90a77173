"""A site decides what it runs, checks its data before joining, and fails in one line.

A fake coordinator (a real gRPC server in this process) names workloads the site does
not allow; sites run as real processes (``python -m dadfl.client``) so exit codes and
everything they print are what an operator sees. Configuration and data mistakes end in
one ``error:`` line naming the file, the field and the fix, and no token or data value
ever reaches the terminal.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from dadfl.cli import app
from dadfl.client.config import SiteConfig
from dadfl.data_files import DataMismatch
from dadfl.trust.run_checks import RunRefused, build_workload, check_run_config, workload_allowed
from dadfl.model_identity import line_hashes, model_probe
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos.channel import PROTOCOL_VERSION, channel_options
from dadfl.server.enrol import enroll, write_tokens
from dadfl.strategies import probe_layout
from dadfl.workloads import load_workload
from tests.helpers.network import ServerThread, SiteThread, free_port, server_config, site_config, write_toml

SITE_TIMEOUT_S = 60


def run_config(**fields) -> cpb.RunConfig:
    """A run config with the layout and model probe a coordinator of digits-mlp (hidden 16)
    sends, unless ``fields`` set them; the workload named may be another module building the
    same model (imported only by the site)."""
    base = dict(
        run_id="run1", workload="digits-mlp", workload_options='{"hidden": 16}', strategy="dsgd", strategy_options="{}",
        optimizer='{"name": "sgd", "lr": 0.1}', batch_size=16, steps=5, codec="none",
        chunk_bytes=1 << 20, max_payload_bytes=1 << 20,
    )
    workload = load_workload("digits-mlp", hidden=16)
    model, example = workload.build_model(), workload.example()
    layout = probe_layout(model, example)
    sent = dict(layout_fingerprint=layout.fingerprint(), layout_line_hashes=line_hashes(layout.lines()), model_probe=model_probe(model, example))
    return cpb.RunConfig(**{**base, **sent, **fields})


class FakeCoordinator(cpb_grpc.CoordinatorServicer):
    """Answers every hello with ``config``; records what the site sends next, then ends the stream."""

    def __init__(self, config: cpb.RunConfig):
        self.config = config
        self.received: list[str] = []

    def Join(self, request_iterator, context):
        self.received.append(next(request_iterator).WhichOneof("kind"))
        yield cpb.ServerMessage(config=self.config)
        for message in request_iterator:
            self.received.append(message.WhichOneof("kind"))
            return


@pytest.fixture
def fake_coordinator():
    servers = []

    def start(config: cpb.RunConfig) -> tuple[FakeCoordinator, str]:
        coordinator = FakeCoordinator(config)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channel_options(1 << 20))
        cpb_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return coordinator, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def site_toml(tmp: Path, server: str, token: str = "t" * 43, **fields) -> Path:
    data = {
        "site_id": "hospital-a", "token": token, "device": "cpu", "threads": 1,
        "connect": {"server": server, "backoff_initial_s": 0.1, "max_attempts": 1},
        "data": {"source": "partition", "site_index": 0, "num_sites": 2},
    }
    data.update(fields)
    return write_toml(tmp / "site.toml", data)


def run_site_process(config: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "dadfl.client", *args, "--config", str(config), "--insecure"]
    return subprocess.run(command, capture_output=True, text=True, timeout=SITE_TIMEOUT_S, env=env)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def write_marker_workload(tmp: Path) -> Path:
    """A workload module that leaves a marker file the moment it is imported."""
    marker = tmp / "imported.marker"
    (tmp / "marker_wl.py").write_text(textwrap.dedent(f"""\
        from pathlib import Path
        Path({str(marker)!r}).write_text("imported")
        from dadfl.workloads.digits import mlp as build
    """))
    return marker


# ---------------------------------------------------------------- what code a site runs


@pytest.mark.network
@pytest.mark.parametrize(
    "workload, options",
    [("marker_wl:build", {"hidden": 16}), ("os:system", {"command": "touch {marker}"})],
    ids=["workload outside the allowlist", "os:system"],
)
def test_a_workload_the_site_does_not_allow_is_refused_before_any_import(tmp_path, fake_coordinator, workload, options):
    marker = write_marker_workload(tmp_path)
    options = {k: v.format(marker=marker) if isinstance(v, str) else v for k, v in options.items()}
    coordinator, address = fake_coordinator(run_config(workload=workload, workload_options=json.dumps(options)))
    result = run_site_process(site_toml(tmp_path, address), pythonpath=tmp_path)
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert repr(workload) in line and "allowed_workloads" in line and str(tmp_path / "site.toml") in line
    assert not marker.exists(), "the module was imported (or the command ran) although the site refused it"
    assert coordinator.received == ["hello", "leaving"], "the site must not answer ready to a run it refuses, only say it leaves"
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.network
def test_an_allowed_module_prefix_runs_the_workload(tmp_path, fake_coordinator):
    """The control of the test above: the same module, allowed by prefix, is imported and built."""
    marker = write_marker_workload(tmp_path)
    coordinator, address = fake_coordinator(run_config(workload="marker_wl:build"))
    result = run_site_process(site_toml(tmp_path, address, allowed_workloads=["marker_wl."]), pythonpath=tmp_path)
    assert marker.exists()
    assert coordinator.received == ["hello", "ready"]
    assert result.returncode == 1 and "1 attempt to reach the coordinator" in result.stderr  # the fake ends the stream after ready


def test_a_prefix_allowed_module_exposes_only_its_own_factories(tmp_path):
    """An allowlist prefix admits the operator's package, not whatever that package imports."""
    (tmp_path / "hw_pkg.py").write_text("from shutil import rmtree\nfrom dadfl.workloads.digits import mlp as build\n")
    victim = tmp_path / "victim"
    victim.mkdir()
    with pytest.raises(ValueError, match="'rmtree' is not a function defined in package 'hw_pkg'"):
        load_workload("hw_pkg:rmtree", [tmp_path], path=str(victim))
    assert victim.exists()
    assert load_workload("hw_pkg:build", [tmp_path], hidden=8).name == "digits-mlp"  # a re-exported built-in


def test_allowlist_matches_specs_prefixes_and_builtin_names():
    allowed = ["digits-mlp", "hospital_wl.", "lab.models:net"]
    assert workload_allowed("digits-mlp", allowed) and workload_allowed("dadfl.workloads.digits:mlp", allowed)
    assert workload_allowed("hospital_wl.tabular:mlp", allowed) and workload_allowed("hospital_wl:mlp", allowed)
    assert workload_allowed("lab.models:net", allowed)
    for refused in ("hospital_wlx.tabular:mlp", "lab.models:other", "digits-cnn", "os:system", "hospital_wl..x:y", "hospital_wl.a:b; rm"):
        assert not workload_allowed(refused, allowed), refused


def demo_site_config() -> SiteConfig:
    data = {"source": "partition", "site_index": 0, "num_sites": 1}
    return SiteConfig.model_validate({"site_id": "a", "token": "t" * 20, "connect": {"server": "h:1"}, "data": data})


HOSTILE_RUN_CONFIGS = {
    "JSON bomb": (dict(workload_options="[" * 50_000 + "]" * 50_000), "workload_options"),
    "deep nesting": (dict(strategy_options=json.dumps({"a": [[[[[1]]]]]})), "nests deeper"),
    "huge options": (dict(workload_options=json.dumps({"hidden": 16, "pad": "x" * 100_000})), "characters; at most"),
    "not an object": (dict(optimizer="[1, 2]"), "must be a JSON object"),
    "huge batch": (dict(batch_size=1_000_000_000), "limits.max_batch_size"),
    "huge steps": (dict(steps=10**15), "limits.max_steps"),
    "huge rounds": (dict(strategy="fedavg", strategy_options='{"local_steps": 10000}', batch_size=16), "batch_size × local steps"),
    "huge chunks": (dict(chunk_bytes=1 << 30), "chunk_bytes"),
    "huge payloads": (dict(max_payload_bytes=1 << 40), "limits.max_payload_bytes"),
    "unknown codec": (dict(codec="zip"), "codec 'zip'"),
    "unknown strategy": (dict(strategy="evil"), "strategy 'evil'"),
    "unknown strategy option": (dict(strategy="rankdad", strategy_options='{"rank": 2, "exec": "x"}'), "exec: Extra inputs"),
    "option of the wrong type": (dict(strategy="rankdad", strategy_options='{"rank": "4"}'), "rank: Input should be a valid integer"),
    "option out of range": (dict(strategy="rankdad", strategy_options='{"rank": 99999999999}'), "rank: Input should be less than"),
    "strategy's own range": (dict(strategy="rankdad", strategy_options='{"tol": 2.0}'), "tol=2.0 must be in [0, 1)"),
    "optimizer NaN": (dict(optimizer='{"name": "sgd", "lr": NaN}'), "lr"),
    "optimizer extra key": (dict(optimizer='{"name": "sgd", "lr": 0.1, "hook": "x"}'), "hook: Extra inputs"),
    "run id with a newline": (dict(run_id="a\nforged line"), "'a\\nforged line'"),
    "layout fingerprint": (dict(layout_fingerprint="zz" * 1000), "expected hex digits"),
    "huge model probe": (dict(model_probe=[1.0] * 100_000), "model_probe values"),
    "huge layout lines": (dict(layout_line_hashes=list(range(100_000))), "layout_line_hashes"),
    "unknown precision": (dict(precision="fp8"), "precision 'fp8'"),
}


@pytest.mark.parametrize("name", list(HOSTILE_RUN_CONFIGS))
def test_hostile_run_config_fields_are_refused_with_the_field(name):
    fields, message = HOSTILE_RUN_CONFIGS[name]
    site = demo_site_config()
    with pytest.raises(RunRefused) as refused:
        check_run_config(run_config(**fields), site, max_chunk_bytes=4 << 20)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400


def test_workload_options_are_typed_and_the_model_size_is_bounded_before_allocation():
    site = demo_site_config()
    bad_type = check_run_config(run_config(workload_options='{"hidden": "16"}'), site, max_chunk_bytes=4 << 20)
    with pytest.raises(RunRefused, match="hidden: Input should be a valid integer"):
        build_workload(bad_type, site.limits)
    unknown = check_run_config(run_config(workload_options='{"hidden": 16, "path": "/etc"}'), site, max_chunk_bytes=4 << 20)
    with pytest.raises(RunRefused, match="has no option 'path'"):
        build_workload(unknown, site.limits)
    # 10^6 hidden units: ~10^12 parameters (4 TB) would be allocated; measured on the meta device instead
    huge = check_run_config(run_config(workload_options='{"hidden": 1000000}'), site, max_chunk_bytes=4 << 20)
    with pytest.raises(RunRefused, match=r"1,000,076,000,010 parameters, above limits.max_parameters"):
        build_workload(huge, site.limits)


# ---------------------------------------------------------------- config mistakes: one line each


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    lines = error_lines(result.output)
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return result.exit_code, lines[0]


def server_toml(tmp: Path, listen: dict, **sections) -> Path:
    return write_toml(tmp / "server.toml", {"run_dir": str(tmp / "run"), "listen": {"tokens": str(tmp / "tokens.json"), **listen}, **sections})


@pytest.mark.parametrize(
    "address, message",
    [("localhost", "write host:port"), ("localhost:99999", "port 99999 is outside 0..65535"), (":50051", "write host:port")],
)
def test_listen_address_without_a_valid_port_is_refused(tmp_path, address, message):
    path = server_toml(tmp_path, {"address": address})
    code, line = invoke("server", "--config", str(path), "--insecure")
    assert code == 2 and str(path) in line and "field 'listen.address'" in line and message in line


def test_missing_and_corrupt_tokens_files_stop_the_server_at_start(tmp_path):
    path = server_toml(tmp_path, {"address": "127.0.0.1:0"})
    code, line = invoke("server", "--config", str(path), "--insecure")
    assert code == 2 and str(path) in line and "listen.tokens" in line and "does not exist" in line and "dadfl enroll" in line
    (tmp_path / "tokens.json").write_text('{"sites": {"a": {"sha256": 7}}}')
    code, line = invoke("server", "--config", str(path), "--insecure")
    assert code == 2 and "listen.tokens" in line and "re-enrol it" in line
    (tmp_path / "tokens.json").write_text("{not json")
    code, line = invoke("server", "--config", str(path), "--insecure")
    assert code == 2 and "not a dadfl token file" in line


@pytest.mark.parametrize(
    "section, message",
    [
        ({"strategy": {"name": "rankdad", "options": {"rank": 0}}}, "rank=0 must be at least 1"),
        ({"strategy": {"name": "dad", "options": {"downlnk": "dense"}}}, "dad options: downlnk: Extra inputs are not permitted"),
        ({"strategy": {"name": "rankdad", "options": {"rank": "4"}}}, "rankdad options: rank: Input should be a valid integer"),
        ({"workload": {"spec": "digits-mlp", "options": {"hiden": 3}}}, "has no option 'hiden'"),
        ({"workload": {"spec": "digits-mlp", "options": {"hidden": 16.5}}}, "hidden: Input should be a valid integer"),
        ({"optimizer": {"name": "sgd", "lr": -1.0}}, "field 'optimizer.lr'"),
    ],
)
def test_bad_workload_and_strategy_options_stop_the_server_at_start(tmp_path, section, message):
    write_tokens(tmp_path / "tokens.json", {})
    path = server_toml(tmp_path, {"address": "127.0.0.1:0"}, **section)
    code, line = invoke("server", "--config", str(path), "--insecure")
    assert code == 2 and str(path) in line and message in line


@pytest.mark.network
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"device": "tpu"}, "field 'device'"),
        ({"connect": {"server": "fl.example.org"}}, "field 'connect.server'"),
        ({"allowed_workloads": ["os system"]}, "field 'allowed_workloads'"),
        ({"data": {"source": "file", "path": "missing/site.npz"}}, "data.path missing/site.npz does not exist"),
    ],
)
def test_site_config_mistakes_are_one_line_before_connecting(tmp_path, fields, message):
    token = "s3cret-token-" + "x" * 30
    path = site_toml(tmp_path, f"127.0.0.1:{free_port()}", token=token, **fields)  # nobody listens there
    code, line = invoke("site", "--config", str(path), "--insecure")
    assert code == 2 and str(path) in line and message in line and token not in line


@pytest.mark.network
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_connecting(tmp_path):
    path = site_toml(tmp_path, f"127.0.0.1:{free_port()}", device="cuda")
    code, line = invoke("site", "--config", str(path), "--insecure")
    assert code == 2 and "no CUDA device" in line and str(path) in line


def test_an_invalid_short_token_is_not_echoed(tmp_path):
    path = site_toml(tmp_path, "127.0.0.1:1", token="short-secret")
    code, line = invoke("site", "--config", str(path), "--insecure")
    assert code == 2 and "field 'token'" in line and "short-secret" not in line


# ---------------------------------------------------------------- data checked before joining


def digits_file(path: Path, rows: slice, change=None) -> Path:
    """Real digits pixels as numpy leaves them: float64 inputs, int64 targets."""
    digits = load_digits()
    inputs, targets = digits.data[rows] / 16.0, digits.target[rows].copy()
    if change:
        inputs, targets = change(inputs, targets)
    np.savez(path, inputs=inputs, targets=targets)
    return path


@pytest.mark.network
def test_float64_and_integer_npz_files_are_converted_and_train(tmp_path, caplog):
    """numpy's defaults: site-0 has float64 pixels in [0, 1], site-1 the integer pixel levels
    0..16 digits come as; both have int32 labels."""
    caplog.set_level("INFO")
    server = ServerThread(server_config(tmp_path, training={"steps": 4, "eval_every": 4, "checkpoint_every": 0})).start()
    changes = [lambda x, y: (x, y.astype(np.int32)), lambda x, y: ((x * 16).astype(np.int64), y.astype(np.int32))]
    sites = []
    for index, (rows, change) in enumerate(zip((slice(0, 400), slice(400, 800)), changes)):
        path = digits_file(tmp_path / f"site{index}.npz", rows, change)
        sites.append(SiteThread(site_config(tmp_path, f"site-{index}", server.endpoint, index, 2, data={"source": "file", "path": str(path)})).start())
    summaries = [site.join(SITE_TIMEOUT_S) for site in sites]
    server.join()
    assert [s.steps for s in summaries] == [4, 4]
    conversions = sorted(r.getMessage() for r in caplog.records if r.name == "dadfl.site" and "converted" in r.getMessage())
    assert len(conversions) == 2
    assert "site0.npz: converted inputs torch.float64 -> torch.float32, targets torch.int32 -> torch.int64" in conversions[0]
    assert "site1.npz: converted inputs torch.int64 -> torch.float32, targets torch.int32 -> torch.int64" in conversions[1]


@pytest.mark.network
@pytest.mark.parametrize(
    "name, change, message",
    [
        ("wrong feature count", lambda x, y: (x[:, :30], y), "the model's first layer takes 64 features"),
        ("labels out of range", lambda x, y: (x, np.where(np.arange(len(y)) % 7 == 0, y + 10, y)), "58 of 400 rows hold labels outside 0..9"),
        ("NaN inputs", lambda x, y: (np.where(np.arange(len(x))[:, None] == 3, np.nan, x), y), "1 of 400 rows of inputs hold NaN or Inf"),
        ("text targets", lambda x, y: (x, y.astype(str)), "targets are <U21 values, not numbers"),
    ],
)
def test_bad_data_is_refused_before_joining_with_one_line(tmp_path, caplog, name, change, message):
    caplog.set_level("INFO")
    server = ServerThread(server_config(tmp_path, training={"steps": 2}, federation={"min_sites": 1, "quorum_timeout_s": 10, "linger_s": 0})).start()
    data = digits_file(tmp_path / "bad.npz", slice(0, 400), change)
    token = enroll(tmp_path / "tokens.json", "hospital-a")
    path = site_toml(tmp_path, server.endpoint, token=token, data={"source": "file", "path": str(data)})
    code, line = invoke("site", "--config", str(path), "--insecure")
    assert code == 2 and f"data.path {data}" in line and message in line and str(path) in line
    assert token not in caplog.text + line
    assert not [v for v in data_value_strings(data) if v in caplog.text + line], "a data value was printed"
    assert not any("joined" in r.getMessage() for r in caplog.records if r.name == "dadfl.server")


# ---------------------------------------------------------------- secrets and data values never printed


CRASH_WORKLOAD = """\
from dataclasses import replace

from dadfl.workloads.digits import mlp

CALLS = [0]


def build(hidden: int = 16):
    workload = mlp(hidden=hidden)

    def loss(outputs, targets):
        CALLS[0] += 1
        if CALLS[0] > 3:  # the probe and two steps, then the site crashes mid-run
            raise RuntimeError("the hospital's loss failed")
        return workload.loss(outputs, targets)

    return replace(workload, loss=loss)
"""


def data_value_strings(path: Path, count: int = 40) -> set[str]:
    """How the file's values would look in a traceback or a printed tensor."""
    with np.load(path) as arrays:
        values = [float(v) for v in arrays["inputs"].reshape(-1) if np.isfinite(v) and v not in (0.0, 1.0)][:count]
    return {f"{v:.4f}" for v in values} | {f"{v:.4e}" for v in values} | {repr(v) for v in values}


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "--debug"])
def test_a_site_crash_prints_no_token_and_no_data_value(tmp_path, debug):
    (tmp_path / "crash_wl.py").write_text(CRASH_WORKLOAD)
    config = server_config(
        tmp_path, workload={"spec": "crash_wl:build", "options": {"hidden": 16}},
        # hang guards only: the site is a process, which can take a minute to start on a busy machine
        training={"steps": 50, "eval_every": 50}, federation={"min_sites": 1, "quorum_timeout_s": 300, "phase_timeout_s": 300, "linger_s": 0},
    )
    sys.path.insert(0, str(tmp_path))  # the coordinator in this process builds the same workload
    try:
        server = ServerThread(config).start()
    finally:
        sys.path.remove(str(tmp_path))
    data = digits_file(tmp_path / "site.npz", slice(0, 300))
    token = enroll(tmp_path / "tokens.json", "hospital-a")
    path = site_toml(tmp_path, server.endpoint, token=token, data={"source": "file", "path": str(data)}, allowed_workloads=["crash_wl:build"])
    result = run_site_process(path, *(["--debug"] if debug else []), pythonpath=tmp_path)
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert "RuntimeError: the hospital's loss failed" in line
    assert ("Traceback" in result.stderr) == debug
    assert token not in result.stderr + result.stdout
    leaked = [s for s in data_value_strings(data) if s in result.stderr + result.stdout]
    assert not leaked, f"data values printed: {leaked[:5]}"


OWN_MODEL = """\
from dataclasses import replace

from torch import nn

from dadfl.workloads.digits import mlp


def build(hidden: int = 16):
    return replace(mlp(hidden=hidden), build_model=lambda: nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)))
"""


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("change, message", [
    (("nn.ReLU()", "nn.Tanh()"), r"computes a different function from the coordinator's: .* outputs differ by 0\.[0-9]"),
    (("(64, hidden), nn.ReLU(), nn.Linear(hidden,", "(64, 32), nn.ReLU(), nn.Linear(32,"),
     r"in its layout: this site has parameter 0\.weight of shape \(32, 64\); parameter 0\.bias"),
], ids=["function", "shape"])
def test_a_site_whose_model_file_differs_from_the_coordinators_leaves_saying_how(tmp_path, caplog, change, message):
    """The same module name, another file at the site: another function with the same shapes
    (it trained without a word), or another shape (an unnamed fingerprint mismatch)."""
    module = f"own_model_{tmp_path.name.replace('-', '_')}"  # a name no other test imports in this process
    for folder, text in (("server", OWN_MODEL), ("site", OWN_MODEL.replace(*change))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{module}.py").write_text(text)
    config = server_config(
        tmp_path, workload={"spec": f"{module}:build", "path": [str(tmp_path / "server")]},
        federation={"min_sites": 1, "quorum_timeout_s": 300},  # a hang guard: the site process can take a minute to start
    )
    caplog.set_level("INFO")
    server = ServerThread(config).start()
    token = enroll(tmp_path / "tokens.json", "hospital-a")
    path = site_toml(tmp_path, server.endpoint, token=token, allowed_workloads=[f"{module}:build"], workload_path=[str(tmp_path / "site")])
    result = run_site_process(path)
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert re.search(message, line), line
    left = [r.getMessage() for r in caplog.records if r.name == "dadfl.server" and "hospital-a leaves" in r.getMessage()]
    assert len(left) == 1 and re.search(message, left[0]), left


def test_the_model_probe_from_the_wire_is_checked_and_leaves_the_model_as_it_was():
    from dadfl.trust.run_checks import check_same_model
    from dadfl.model_identity import PROBE_VALUES
    from dadfl.replica import OptimizerConfig, Replica
    from dadfl.strategies import make_strategy

    workload = load_workload("char-gru")
    replica = Replica(workload, make_strategy("dad"), OptimizerConfig(), probe=True)
    before = {name: t.clone() for name, t in replica.model.state_dict().items()}
    assert replica.model.training and len(replica.model_probe) == PROBE_VALUES

    def other_initial_weights():
        model = workload.build_model()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param))
        return model

    again = Replica(replace(workload, build_model=other_initial_weights), make_strategy("dad"), OptimizerConfig(), probe=True)
    assert again.model_probe == replica.model_probe  # the probe does not depend on the weights a site starts from
    config = cpb.RunConfig(layout_fingerprint=replica.layout.fingerprint(), layout_line_hashes=line_hashes(replica.layout.lines()))
    for probe in (replica.model_probe, []):  # the same, or none (a model without floating output): joins
        config.model_probe[:] = probe
        check_same_model(again, config.layout_fingerprint, config.layout_line_hashes, config.model_probe)
    for probe in (replica.model_probe[:-1], [math.nan] * PROBE_VALUES, [v * 1.05 for v in replica.model_probe]):
        config.model_probe[:] = probe
        with pytest.raises(RunRefused, match="computes a different function"):
            check_same_model(again, config.layout_fingerprint, config.layout_line_hashes, config.model_probe)
    assert replica.model.training and all(torch.equal(before[name], t) for name, t in replica.model.state_dict().items())
    with pytest.raises(RunRefused, match="more than 16384 lines, too many to name what differs"):  # a layout that large sends no hashes
        check_same_model(again, "0" * 16, [], replica.model_probe)


class CategoryCodes(torch.nn.Module):
    """A hospital's model reading float columns of category codes, and checking them."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 2)

    def forward(self, x):
        if not torch.equal(x, x.round()):
            raise ValueError("category codes expected")
        return self.out(self.embed(x[:, 0].long()))


class AlwaysDropout(torch.nn.Module):
    """Monte Carlo dropout: noise even in eval mode."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.nn.functional.dropout(torch.relu(self.hidden(x)), 0.5, training=True))


def test_models_that_refuse_the_probes_input_or_draw_noise_probe_alike_every_time():
    """Category codes that the model checks: probed on the example as it is. Dropout in eval
    mode: the probe seeds the random state and restores it (nothing else's draws change)."""
    from dadfl.model_identity import model_probe

    example = torch.tensor([[0.0], [3.0]])
    probe = model_probe(CategoryCodes(), example)
    assert len(probe) == 4 and probe == model_probe(CategoryCodes(), example)
    first, second = AlwaysDropout(), AlwaysDropout()
    state = torch.get_rng_state()
    assert model_probe(first, torch.zeros(4, 8)) == model_probe(second, torch.zeros(4, 8))
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- hostile hellos and garbage at the coordinator


def raw_join(endpoint: str, messages) -> grpc.RpcError | None:
    channel = grpc.insecure_channel(endpoint)
    join = channel.stream_stream(
        "/dadfl.v1.Coordinator/Join",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=cpb.ServerMessage.FromString,
    )
    try:
        for _ in join(messages, timeout=30):
            pass
    except grpc.RpcError as error:
        return error
    finally:
        channel.close()
    return None


@pytest.mark.network
def test_hostile_hellos_and_garbage_get_error_statuses_and_clean_log_lines(tmp_path, caplog):
    caplog.set_level("INFO")
    config = server_config(tmp_path, training={"steps": 2}, federation={"min_sites": 1, "quorum_timeout_s": 30, "linger_s": 0})
    server = ServerThread(config).start()
    forged = raw_join(server.endpoint, iter([cpb.SiteMessage(hello=cpb.Hello(site_id="a\nWARNING forged", token="x", protocol_version=PROTOCOL_VERSION))]))
    huge = raw_join(server.endpoint, iter([cpb.SiteMessage(hello=cpb.Hello(site_id="b" * 65536, token="x", protocol_version=PROTOCOL_VERSION))]))
    for error in (forged, huge):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "site id must be 1-64 letters" in error.details()
        assert "forged" not in error.details() and len(error.details()) < 200
    # A site of the protocol before one round trip per step: refused at once, both versions named.
    older = raw_join(server.endpoint, iter([cpb.SiteMessage(hello=cpb.Hello(site_id="hospital-a", token="x", protocol_version=PROTOCOL_VERSION - 1))]))
    assert older.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"site speaks protocol {PROTOCOL_VERSION - 1}, this server {PROTOCOL_VERSION}" in older.details()
    garbage_first = raw_join(server.endpoint, iter([b"\xff\xfe not a protobuf"]))
    assert garbage_first.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a dadfl message" in garbage_first.details()

    token = enroll(tmp_path / "tokens.json", "hospital-a")
    config_seen = threading.Event()
    layout = []

    def after_handshake():
        yield cpb.SiteMessage(hello=cpb.Hello(site_id="hospital-a", token=token, protocol_version=PROTOCOL_VERSION))
        config_seen.wait(30)
        yield cpb.SiteMessage(ready=cpb.Ready(layout_fingerprint=layout[0]))
        yield b"\xff\xfe not a protobuf"

    channel = grpc.insecure_channel(server.endpoint)
    join = channel.stream_stream(
        "/dadfl.v1.Coordinator/Join", request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=cpb.ServerMessage.FromString,
    )
    with pytest.raises(grpc.RpcError) as after:
        for message in join(after_handshake(), timeout=30):
            if message.WhichOneof("kind") == "config":
                layout.append(message.config.layout_fingerprint)
                config_seen.set()
    channel.close()
    assert after.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a dadfl message" in after.value.details()

    server_lines = [r for r in caplog.records if r.name.startswith(("dadfl", "grpc"))]
    assert not [r for r in server_lines if r.exc_info], "no traceback in the coordinator's log"
    messages = [r.getMessage() for r in server_lines]
    assert all("\n" not in m and len(m) < 1000 for m in messages)
    assert any("site id 'a\\nWARNING forged' is not a valid site id" in m for m in messages)
    assert any("b" * 80 + "'... (65536 characters)" in m for m in messages)
    assert any("sent bytes that are not a dadfl message" in m for m in messages)


class Float64Rows(torch.utils.data.Dataset):
    """A site's own Dataset as numpy users write one: float64 rows, plain int labels."""

    def __init__(self, labels_offset: int = 0):
        digits = load_digits()
        self.inputs, self.targets = digits.data[:100] / 16.0, digits.target[:100] + labels_offset

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.inputs[i]), int(self.targets[i])


def test_a_sites_own_dataset_is_converted_and_probed_like_a_file():
    from dadfl.client.data_checks import check_batches
    from dadfl.workloads import StepBatches, load_workload

    workload = load_workload("digits-mlp", hidden=16)
    model = workload.build_model()
    checked = check_batches(model, workload.loss, StepBatches(Float64Rows(), 16, seed=3), "data.factory x:y", torch.device("cpu"))
    inputs, targets = checked.at(5)
    assert inputs.dtype == torch.float32 and targets.dtype == torch.int64 and inputs.shape == (16, 64)
    with pytest.raises(DataMismatch, match=r"data.factory x:y: 16 of 16 rows hold labels outside 0..9"):
        check_batches(model, workload.loss, StepBatches(Float64Rows(labels_offset=10), 16, seed=3), "data.factory x:y", torch.device("cpu"))


def test_labels_are_checked_in_full_also_when_a_share_is_held_out():
    """A held-out share makes the training data a Subset of the file: every row of it is
    still checked at start, not only step 0's batch."""
    from dadfl.client.config import EvaluationData
    from dadfl.client.data import hold_out
    from dadfl.client.data_checks import check_batches
    from dadfl.workloads import Split, SplitDataset, StepBatches
    from dadfl.workloads.digits import mlp

    workload = mlp(hidden=16)
    digits = load_digits()
    targets = torch.as_tensor(digits.target[:400], dtype=torch.int64)
    targets[399] = 12  # one row, far from step 0's batch
    dataset = SplitDataset(Split(torch.as_tensor(digits.data[:400] / 16, dtype=torch.float32), targets))
    training, _ = hold_out(dataset, EvaluationData(fraction=0.2, seed=0))
    assert 399 in training.indices  # the bad row is in the training share
    batches = StepBatches(training, 16, seed=0)
    with pytest.raises(DataMismatch, match=r"1 of 320 rows hold labels outside 0..9"):
        check_batches(workload.build_model(), workload.loss, batches, "data.path x.npz", torch.device("cpu"))


@pytest.mark.parametrize("problem,message", [("label", r"1 of 400 rows hold labels outside 0..9"),
                                             ("nan", r"1 of 400 rows of inputs hold NaN or Inf")])
def test_a_held_out_file_is_checked_in_full_before_the_site_joins(problem, message):
    """Evaluation data is checked as training data is: a bad row past the first batch stops the
    site at start, in one line without the value, not at its first evaluation."""
    from dadfl.client.data_checks import check_dataset
    from dadfl.workloads import Split, SplitDataset
    from dadfl.workloads.digits import mlp

    workload = mlp(hidden=16)
    digits = load_digits()
    inputs = torch.as_tensor(digits.data[:400] / 16, dtype=torch.float32)
    targets = torch.as_tensor(digits.target[:400], dtype=torch.int64)
    if problem == "label":
        targets[399] = 12
    else:
        inputs[399, 5] = float("nan")
    held_out = SplitDataset(Split(inputs, targets))
    with pytest.raises(DataMismatch, match=message):
        check_dataset(workload.build_model(), workload.loss, held_out, "evaluation.path held-out.csv", torch.device("cpu"))


def test_a_precision_outside_the_sites_limits_is_refused():
    """A site whose hardware lacks bf16 drops it from limits.precisions; [dp] runs in fp32."""
    site = demo_site_config()
    assert check_run_config(run_config(precision="bf16"), site, max_chunk_bytes=4 << 20).precision == "bf16"
    assert check_run_config(run_config(), site, max_chunk_bytes=4 << 20).precision == "fp32"  # empty: fp32
    fp32_only = site.model_copy(update={"limits": site.limits.model_copy(update={"precisions": ["fp32"]})})
    with pytest.raises(RunRefused, match="limits.precisions"):
        check_run_config(run_config(precision="bf16"), fp32_only, max_chunk_bytes=4 << 20)
    dp = json.dumps({"max_grad_norm": 1.0, "max_sample_rate": 0.1, "noise_multiplier": 1.0, "delta": 1e-5,
                     "epsilon": 3.0, "accountant": "rdp"})
    with pytest.raises(RunRefused, match="per-sample clipping runs in fp32"):
        check_run_config(run_config(dp=dp, precision="bf16"), site, max_chunk_bytes=4 << 20)
