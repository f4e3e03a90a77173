"""A Flower node holds the ServerApp to its own rules, as a gRPC site holds its coordinator: the
server's settings pass the site's checks (``client/run_checks.py``) before anything is imported or
built, and the server's messages are read bounded before any tensor is decoded. A refusal is a
``refused`` reply, which stops the run with one line naming the node and the reason.

The real ClientApp answers real Flower messages in this process (``DirectGrid``); a grid that
alters what the server sends to node ``HOSTILE`` plays the hostile server. Honest runs stay
bit-identical to the in-process simulation: test_flower.py asserts that with these checks in place."""

from __future__ import annotations

import copy
import io
import json
import re
import sys

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower integration needs flwr: pip install -e '.[flower]'")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message  # noqa: E402

from dadfl import flower  # noqa: E402
from dadfl.config import ConfigError  # noqa: E402
from dadfl.flower.policy import MAX_SETTINGS_CHARS, NodePolicy  # noqa: E402
from dadfl.sanitize import REASON_CHARS  # noqa: E402
from dadfl.simulation import StrategySpec  # noqa: E402
from dadfl.workloads import BUILTIN  # noqa: E402
from tests.flower.test_flower import DirectGrid, run_direct, small_config, task_identity  # noqa: E402,F401
from tests.flower.test_flower_trust import HOSTILE, HostileGrid  # noqa: E402

PROBE_MODULE = "flower_probe_workload"


class ServerTamperGrid(DirectGrid):
    """The direct grid, with the server's ``message_type`` message of ``step`` to node ``HOSTILE``
    altered by ``tamper`` (on a copy: the server sends every node the same records)."""

    def __init__(self, tamper=None, message_type: str = flower.STEP_MESSAGE, step: int = 0, node_configs=None):
        super().__init__(3, node_configs=node_configs)
        self.tamper, self.message_type, self.step = tamper, message_type, step

    def send_and_receive(self, messages, *, timeout=None):
        sent = []
        for message in messages:
            meta = message.metadata
            if self.tamper and (meta.message_type, int(meta.group_id), meta.dst_node_id) == (self.message_type, self.step, HOSTILE):
                message = Message(copy.deepcopy(message.content), meta.dst_node_id, meta.message_type, group_id=meta.group_id)
                self.tamper(message.content)
            sent.append(message)
        return super().send_and_receive(sent, timeout=timeout)


def header(content) -> ConfigRecord:
    return content.config_records[flower.HEADER]


def edit_settings(edit):
    """A tamper that rewrites the run settings in a step message with ``edit(config)``."""

    def tamper(content):
        settings = json.loads(header(content)["settings"])
        edit(settings["config"])
        header(content)["settings"] = json.dumps(settings)

    return tamper


def run_refused(tmp_path, grid, step: int = 0, phase: int = 0) -> str:
    spec = StrategySpec(name="dad")
    with pytest.raises(flower.FlowerRunError) as raised:
        run_direct(tmp_path, small_config(spec, sites=3), spec, grid)
    text = str(raised.value)
    assert text.startswith(f"step {step} phase {phase}: node {HOSTILE} refuses the server's message: "), text
    assert "\n" not in text and len(text) < 600, text
    return text


@pytest.fixture
def probe_workload(tmp_path):
    """A workload module under tmp_path that leaves a file behind when it is imported."""
    code, marker = tmp_path / "code", tmp_path / "imported"
    code.mkdir()
    (code / f"{PROBE_MODULE}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n\n"
        "from dadfl.workloads.digits import mlp as digits_mlp\n\n\n"
        "def mlp(hidden: int = 16):\n    return digits_mlp(hidden=hidden)\n"
    )
    yield code, marker
    sys.modules.pop(PROBE_MODULE, None)


def test_a_workload_the_node_does_not_allow_is_refused_before_it_is_imported(tmp_path, task_identity, probe_workload):
    code, marker = probe_workload
    to_probe = edit_settings(lambda config: config.update(workload=f"{PROBE_MODULE}:mlp"))
    grid = ServerTamperGrid(to_probe, node_configs={HOSTILE: {"workload_path": str(code)}})
    text = run_refused(tmp_path / "refused", grid)
    assert f"asks for workload '{PROBE_MODULE}:mlp', which this site does not allow" in text, text
    assert "allowed_workloads" in text, text  # the fix: the node-config key to set
    assert not marker.exists() and PROBE_MODULE not in sys.modules

    # The same server message to a node that allows the module imports it: the probe works.
    allowing = {HOSTILE: {"workload_path": str(code), "allowed_workloads": f"digits-mlp,{PROBE_MODULE}."}}
    spec = StrategySpec(name="dad")
    run_direct(tmp_path / "allowed", small_config(spec, sites=3), spec, ServerTamperGrid(to_probe, node_configs=allowing))
    assert marker.exists()


def deeper_options(config):
    config["workload_options"] = {"hidden": 16, "a": {"b": {"c": {"d": {"e": 1}}}}}


def longer_options(config):
    config["workload_options"] = {"hidden": 16, "pad": "x" * 70_000}


def longer_settings(content):
    header(content)["settings"] = " " * (MAX_SETTINGS_CHARS + 1)


def not_json(content):
    header(content)["settings"] = "{"


def with_dp(config):
    config["dp"] = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}


LIMITS = [
    ({"limits.max_batch_size": 8}, None, r"batch_size = 16, outside 1\.\.8; raise limits\.max_batch_size in the site config"),
    ({"limits.max_steps": 2}, None, r"steps = 3, outside 1\.\.2; raise limits\.max_steps"),
    ({"limits.max_parameters": 1000}, None, r"has [0-9,]+ parameters, above limits\.max_parameters = 1,000"),
    ({"privacy.require_dp": True}, None, r"has no differential privacy \(\[dp\]\), and privacy\.require_dp = true"),
    ({}, edit_settings(deeper_options), r"workload_options nests deeper than 4 levels"),
    ({}, edit_settings(longer_options), r"workload_options is 70\d\d\d characters; at most 65536 are accepted"),
    ({}, longer_settings, rf"header field 'settings' is not text of at most {MAX_SETTINGS_CHARS} characters"),
    ({}, not_json, r"the server's run settings are not valid JSON"),
    ({}, edit_settings(with_dp), r"differential privacy \(\[dp\]\), which the Flower integration does not run"),
]


@pytest.mark.parametrize(
    "node_config, tamper, reason", LIMITS, ids=["batch", "steps", "parameters", "require_dp", "depth", "size", "settings", "json", "dp"]
)
def test_settings_beyond_the_nodes_limits_are_refused(tmp_path, task_identity, node_config, tamper, reason):
    text = run_refused(tmp_path, ServerTamperGrid(tamper, node_configs={HOSTILE: node_config}))
    assert re.search(reason, text), text


def lying_npy(content):
    """An .npy header that claims a terabyte-sized array over four bytes of data."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": (1 << 38,)})
    arrays = content.array_records[flower.TENSORS]
    arrays[next(iter(arrays))] = Array(dtype="float32", shape=(1 << 38,), stype="numpy.ndarray", data=buffer.getvalue() + bytes(4))


def stray_record(content):
    content.config_records["extra"] = ConfigRecord({"x": 1})


def text_partition_index(content):
    header(content)["partition_index"] = "0"


def far_partition_index(content):
    header(content)["partition_index"] = 5


def far_partition_index_and_a_state(content):
    """Refused for its partition, before the state (here malformed too) is decoded."""
    far_partition_index(content)
    state_with_a_stray_tensor(content)


def extra_header_field(content):
    header(content)["evil"] = 1


def state_with_a_stray_tensor(content):
    content[flower.STATE] = ArrayRecord({"evil": Array(np.zeros(3, np.float32))})


def state_of_another_shape(content):
    content[flower.STATE] = ArrayRecord({"model/0.weight": Array(np.zeros(3, np.float32))})


MESSAGES = [
    (lying_npy, flower.PHASE_MESSAGE, 1, {}, r"tensor '.*': shape \(274877906944,\) needs 1099511627776 bytes, it carries 4"),
    (stray_record, flower.STEP_MESSAGE, 1, {}, r"unexpected record 'extra'"),
    (text_partition_index, flower.STEP_MESSAGE, 1, {}, r"header field 'partition_index' is not an integer"),
    (far_partition_index, flower.STEP_MESSAGE, 1, {}, r"partition_index 5 for a run of 3 sites"),
    (far_partition_index_and_a_state, flower.STEP_MESSAGE, 1, {}, r"partition_index 5 for a run of 3 sites"),
    (extra_header_field, flower.PHASE_MESSAGE, 1, {}, r"unexpected header field 'evil'"),
    (state_with_a_stray_tensor, flower.STEP_MESSAGE, 1, {}, r"unexpected tensor 'evil'"),
    (state_of_another_shape, flower.STEP_MESSAGE, 1, {}, r"state tensor '0\.weight' \(3,\) does not fit this model"),
    (None, flower.PHASE_MESSAGE, 0, {"limits.max_payload_bytes": 1024},
     r"payload of \d+ bytes exceeds the limit of 1024 bytes \(limits\.max_payload_bytes in the node config\)"),
]


@pytest.mark.parametrize(
    "tamper, message_type, step, node_config, reason", MESSAGES,
    ids=["lying_npy", "stray_record", "text_field", "partition", "partition_before_state", "extra_field", "state_tensor", "state_shape", "byte_cap"],
)
def test_a_malformed_server_message_is_refused_before_it_is_decoded(tmp_path, task_identity, tamper, message_type, step, node_config, reason):
    grid = ServerTamperGrid(tamper, message_type, step, node_configs={HOSTILE: node_config})
    phase = 1 if message_type == flower.PHASE_MESSAGE else 0
    text = run_refused(tmp_path, grid, step, phase)
    assert re.search(reason, text), text


def refusal(reason: str):
    def attack(content):
        for name in list(content):
            del content[name]
        content[flower.HEADER] = ConfigRecord({"status": flower.REFUSED, "reason": reason})

    return attack


def test_a_nodes_refusal_reaches_the_server_as_one_bounded_line(tmp_path, task_identity):
    spec = StrategySpec(name="dad")
    with pytest.raises(flower.FlowerRunError) as raised:
        run_direct(tmp_path / "forged", small_config(spec, sites=3), spec, HostileGrid(refusal("no\nstep 9: forged line\x1b[2J")))
    text = str(raised.value)
    assert text.startswith(f"step 1 phase 0: node {HOSTILE} refuses the server's message: no\\nstep 9"), text
    assert "\n" not in text and "\x1b" not in text, text
    # The bound is the one every runtime logs another party's reason with (sanitize.REASON_CHARS).
    with pytest.raises(flower.FlowerRunError, match=rf"node {HOSTILE} refuses the server's message: x{{{REASON_CHARS}}}$"):
        run_direct(tmp_path / "at_bound", small_config(spec, sites=3), spec, HostileGrid(refusal("x" * REASON_CHARS)))
    with pytest.raises(flower.FlowerRunError, match=rf"node {HOSTILE} refused: header field 'reason' is not text of at most {REASON_CHARS} "):
        run_direct(tmp_path / "long", small_config(spec, sites=3), spec, HostileGrid(refusal("x" * (REASON_CHARS + 1))))


def test_the_node_policy_comes_from_the_node_config_with_the_site_configs_names():
    """Read from what a SuperNode's ``--node-config`` gives (Flower's own parser), beside the
    node's own settings (``data-path``) and the keys Flower's simulation engine sets."""
    from flwr.common.config import parse_config_args

    node_config = parse_config_args(
        ["allowed_workloads='digits-mlp, hospital_wl.' workload_path='/opt/a:/opt/b' limits.max_batch_size=64 "
         "privacy.require_dp=true data-path='/data/site.npz' partition-id=0 num-partitions=3"]
    )
    policy = NodePolicy.from_node_config(node_config)
    assert policy.allowed_workloads == ["digits-mlp", "hospital_wl."]
    assert [str(path) for path in policy.workload_path] == ["/opt/a", "/opt/b"]
    assert (policy.limits.max_batch_size, policy.limits.max_steps, policy.privacy.require_dp) == (64, 10_000_000, True)
    assert NodePolicy.from_node_config({}).allowed_workloads == list(BUILTIN)
    assert NodePolicy.from_node_config({"limits.precisions": "fp32, fp16"}).limits.precisions == ["fp32", "fp16"]
    with pytest.raises(ConfigError, match=r"node config: field 'allowed_workloads'.*neither a built-in workload"):
        NodePolicy.from_node_config({"allowed_workloads": "os"})


@pytest.mark.parametrize("key", ["limits.max_batchsize", "allowed_workload", "limit.max_steps", "limits", "privacy.require-dp"])
def test_a_node_config_key_the_node_does_not_read_is_refused_with_the_known_keys(tmp_path, task_identity, key):
    """A misspelled limit that was ignored would leave the site believing it holds a bound it
    does not: the node fails with one line naming the key and the keys it knows."""
    with pytest.raises(ConfigError) as raised:
        NodePolicy.from_node_config({"limits.max_batch_size": 8, key: 8})
    text = str(raised.value)
    assert text.startswith(f"node config: unknown key(s) {key!r}; "), text
    assert "limits.max_batch_size" in text and "allowed_workloads" in text and "partition-id" in text and "\n" not in text, text

    # Through a run: the node fails on its first message, before it reads the server's settings
    # (the direct grid raises what Flower reports as the node's error).
    spec = StrategySpec(name="dad")
    grid = DirectGrid(3, node_configs={HOSTILE: {"limits.max_batch_size": 64, key: 8}})
    with pytest.raises(ConfigError, match=rf"^node config: unknown key\(s\) '{re.escape(key)}'"):
        run_direct(tmp_path, small_config(spec, sites=3), spec, grid)
