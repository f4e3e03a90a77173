"""``dadfl.flower.node`` — the ClientApp every Flower node (SuperNode) runs.

One training step as a node sees it: a ``train.step`` message (the step, the run settings, the
node's partition index, the fingerprint of the weights it must hold) starts it; the node runs
forward/backward on its batch of that step and replies with its phase-0 payload; each
``train.phase`` message (the aggregated server message) is answered with the next phase's
payload or, after the last phase, by applying the decoded update and replying its fingerprint.

**Node state.** Flower runs the ClientApp wherever it likes (any Ray actor in a simulation, a
fresh ``flwr-clientapp`` process per message in a deployment), so a node keeps its replica in
``context.state``, which Flower keeps on the node for the run and never sends: weights and
optimizer state, the server messages of the step under way, and the strategy's site half
pickled. A half that cannot be pickled (a user strategy's, say) is rebuilt from the strategy at
each message, which restarts any state it kept. A node whose state is missing or whose weights
differ from the server's answers ``need_state`` (``lost`` mid-step).

**Trust.** A node holds the server to its own rules, as a gRPC site does its coordinator: the
run settings pass the site's checks under the node's policy (``dadfl.flower.policy``,
``dadfl.trust.run_checks``) before anything is imported or built; the server's messages and full
state are read bounded (``dadfl.flower.records``). A node that refuses replies ``refused`` with
one line saying why.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from dadfl.data_files import read_data_file
from dadfl.model_identity import read_identity_text
from dadfl.protos.state import MODEL_PREFIX, OPTIM_PREFIX, load_state, state_payload
from dadfl.replica import Replica, resolve_device
from dadfl.sanitize import REASON_CHARS, one_line, printable
from dadfl.simulation import SimulationConfig
from dadfl.strategies import Payload, weights_fingerprint
from dadfl.trust.run_checks import RunRefused, check_same_model
from dadfl.workloads import Split, StepBatches, Workload, partition, site_batches

from .policy import NodePolicy, check_settings, node_workload
from .records import ANY_DTYPE, DONE, FLOAT_DTYPES, HEADER, LOST, NEED_STATE, NODE_PAYLOAD_LIMIT, PAYLOAD, PHASE_FIELDS, REFUSED, Refused, STATE, STEP_FIELDS, TENSORS, payload_content, read_fields, read_records, read_tensors, record_from_tensors, tensors_from_record
from .settings import RunSettings

log = logging.getLogger("dadfl.flower")


# Node-local records in context.state (never leave the node)
NODE_INFO = "dadfl.node"
NODE_WEIGHTS = "dadfl.node.weights"
NODE_MESSAGE = "dadfl.node.message.{}"  # the server messages of the step under way, by phase

# Minibatches by (run, node, partition index, data file). Only a shortcut: a step's batch
# depends on (seed, step) alone, so a process that lacks them rebuilds them.
_batch_streams: dict[tuple[int, int, int, str], StepBatches] = {}


def _read_data_file(path: Path) -> Split:
    """The node's data file, in the formats a gRPC site reads (``dadfl.data_files``)."""
    if not path.is_file():
        raise ValueError(f"node config data-path={str(path)!r}: no such file on this SuperNode")
    try:
        return read_data_file(path)
    except ValueError as exc:
        raise ValueError(f"node config data-path: {exc}") from exc


def site_data(
    config: SimulationConfig, workload: Workload, node_config: dict, partition_index: int
) -> tuple[Split, torch.Tensor]:
    """The node's training samples: its own file (node config ``data-path``) or its partition."""
    if "data-path" in node_config:
        split = _read_data_file(Path(str(node_config["data-path"])))
        return split, torch.arange(len(split))
    train = workload.training_data()
    indices = partition(config.sites, len(train), config.partition, labels=workload.labels, alpha=config.alpha, seed=config.seed)
    return train, indices[partition_index]


def batch_stream(context: Context, config: SimulationConfig, workload: Workload, partition_index: int) -> StepBatches:
    """The node's minibatches by step: the batches the in-process simulation draws for the
    site, whichever process asks (a restarted step gets the same batches)."""
    key = (context.run_id, context.node_id, partition_index, str(context.node_config.get("data-path", "")))
    for stale in [k for k in _batch_streams if k[0] != context.run_id]:
        del _batch_streams[stale]  # a long-lived worker serves run after run
    if key not in _batch_streams:
        split, index = site_data(config, workload, context.node_config, partition_index)
        _batch_streams[key] = site_batches(split, index, config.batch_size, seed=config.seed + partition_index)
    return _batch_streams[key]


@dataclass
class NodeReplica:
    """One node's replica between messages, and the server messages of the step under way."""

    settings_json: str  # as the server sent it: compared to spot another run's state
    layout: str  # the server's layout fingerprint that came with the settings
    settings: RunSettings
    replica: Replica
    step: int = -1  # the step under way; -1 between steps
    attempt: int = 0  # the server's try of that step
    base: str = ""  # the fingerprint of the weights the step began from
    messages: list[Payload] = field(default_factory=list)

    @classmethod
    def build(cls, settings_json: str, layout: str, context: Context, policy: NodePolicy, probe: bool = True) -> "NodeReplica":
        """A fresh replica: seeded initial weights, as the server's at step 0. Nothing is imported
        or built unless the node's policy allows the settings (:func:`check_settings`).
        ``probe``: compute the model probe, for the check against the server's model."""
        run = check_settings(settings_json, policy, context.run_id, layout)
        node_config = context.node_config
        # The server's thread count, at most this machine's cores, unless the node sets its own.
        torch.set_num_threads(int(node_config.get("threads", min(run.config.threads, os.cpu_count() or 1))))
        try:  # the node's own device, else the server's, which this node may not have
            device = resolve_device(str(node_config.get("device", run.config.device)))
        except ValueError as exc:
            raise RunRefused(f"{exc} (set device in this node's --node-config)") from None
        if run.config.precision not in policy.limits.precisions:
            raise RunRefused(f"the server asks for precision {run.config.precision}; this node trains at "
                             f"{', '.join(policy.limits.precisions)} (limits.precisions in its policy)")
        replica = Replica(node_workload(run.checked, policy), run.checked.strategy, run.checked.optimizer, device, probe=probe,
                          precision=run.config.precision)
        return cls(settings_json, layout, RunSettings(run.config, run.spec), replica)

    def state_dtypes(self) -> Callable[[str], set[torch.dtype] | None]:
        """The dtypes each key of the server's full state may have (None: not a key of it): this
        model's parameters and buffers exactly; optimizer state (``optim/<index>/<name>``, whose
        names the optimizer only knows once it has stepped) for indices of its parameters."""
        model = {MODEL_PREFIX + name: {tensor.dtype} for name, tensor in self.replica.model.state_dict().items()}
        parameters = sum(len(group["params"]) for group in self.replica.optimizer.param_groups)

        def dtypes(key: str) -> set[torch.dtype] | None:
            if key in model:
                return model[key]
            index, _, name = key.removeprefix(OPTIM_PREFIX).partition("/")
            if key.startswith(OPTIM_PREFIX) and re.fullmatch(r"[0-9]{1,9}", index) and int(index) < parameters and name.isidentifier():
                return FLOAT_DTYPES
            return None

        return dtypes

    def save(self, context: Context, weights: bool) -> None:
        """Write this node into ``context.state``; ``weights`` only when they changed."""
        if weights:
            context.state[NODE_WEIGHTS] = record_from_tensors(state_payload(self.replica, self.step).tensors)
        for key in [k for k in context.state.array_records if k.startswith(NODE_MESSAGE.format(""))]:
            del context.state[key]
        for phase, message in enumerate(self.messages):
            context.state[NODE_MESSAGE.format(phase)] = record_from_tensors(message.tensors)
        context.state[NODE_INFO] = ConfigRecord(
            {
                "settings": self.settings_json,
                "layout": self.layout,
                "step": self.step,
                "attempt": self.attempt,
                "base": self.base,
                "message_num_samples": [m.num_samples for m in self.messages],
                "half": _pickled_half(self.replica.half),
            }
        )

    @classmethod
    def restore(cls, context: Context, policy: NodePolicy) -> "NodeReplica | None":
        """The node as the last message left it, or None when ``context.state`` has none."""
        if NODE_INFO not in context.state.config_records or NODE_WEIGHTS not in context.state.array_records:
            return None
        info = context.state.config_records[NODE_INFO]
        node = cls.build(str(info["settings"]), str(info["layout"]), context, policy, probe=False)  # checked when first built
        load_state(node.replica, Payload(0, 0, 0, tensors_from_record(context.state.array_records[NODE_WEIGHTS])))
        half = bytes(info["half"])
        if half:
            # Node-local bytes this node wrote itself (context.state never comes from the network).
            node.replica.half = pickle.loads(half)
        node.step, node.attempt, node.base = int(info["step"]), int(info["attempt"]), str(info["base"])
        records = context.state.array_records
        node.messages = [
            Payload(node.step, phase, int(num_samples), tensors_from_record(records[NODE_MESSAGE.format(phase)]))
            for phase, num_samples in enumerate(info["message_num_samples"])
        ]
        return node


def _pickled_half(half: Any) -> bytes:
    try:
        return pickle.dumps(half, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        return b""  # rebuilt from the strategy at the next message (module docstring)


def _upload_reply(message: Message, node: NodeReplica, payload: Payload, loss_sum: float = 0.0) -> Message:
    """A payload reply, its header as the server checks it (``REPLY_FIELDS``)."""
    return _reply(message, PAYLOAD, payload, loss_sum=loss_sum, attempt=node.attempt, base_fingerprint=node.base)


def _reply(message: Message, status: str, payload: Payload | None = None, **header: Any) -> Message:
    if payload is None:
        content = RecordDict({HEADER: ConfigRecord({"status": status, **header})})
    else:
        content = payload_content(payload, status=status, **header)
    return Message(content, reply_to=message)


def refusing(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """``handler``, replying ``refused`` with one line saying why when the server's message is
    malformed or asks for what the node's policy does not allow (nothing refused is built)."""

    @functools.wraps(handler)
    def handle(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except (RunRefused, Refused) as exc:
            reason = one_line(str(exc))[:REASON_CHARS]
        log.warning("node %s refuses the server's %s message: %s", context.node_id, message.metadata.message_type, reason)
        return _reply(message, REFUSED, reason=reason)

    return handle


@refusing
def handle_step(message: Message, context: Context) -> Message:
    """``train.step``: check the settings (with the node's policy) and the weights (or load the
    server's full state), run forward/backward on this step's batch, reply with the phase-0 payload."""
    header, state = read_records(message.content, STATE)
    fields = read_fields(header, STEP_FIELDS)
    step, settings_json = fields["step"], fields["settings"]
    policy = NodePolicy.from_node_config(context.node_config)
    node = NodeReplica.restore(context, policy) if state is None else None
    if node is None or node.settings_json != settings_json:
        # Nothing kept, state of other settings, or a resync: a fresh replica and site half.
        node = NodeReplica.build(settings_json, fields["layout"], context, policy)
    partition_index, sites = fields["partition_index"], node.settings.config.sites
    if partition_index >= sites:  # refused before any state is decoded
        raise RunRefused(f"the server sent partition_index {partition_index} for a run of {sites} sites")
    if state is not None:
        tensors = read_tensors(state, node.state_dtypes(), policy.limits.max_payload_bytes, NODE_PAYLOAD_LIMIT)
        try:
            load_state(node.replica, Payload(step, 0, 0, tensors))
        except ValueError as exc:
            raise Refused(f"the server's full state: {exc}") from None
    if node.replica.model_probe is None:  # restored: its model was checked against this layout when built
        if fields["layout"] != node.layout:
            raise Refused(f"the server's layout {printable(fields['layout'])} changed within one run's settings (was {node.layout})")
    elif not fields["model"]:  # built afresh (its state is lost) from a message that cannot check it: ask for the state
        return _reply(message, NEED_STATE, fingerprint=weights_fingerprint(node.replica.model))
    else:  # built by this message: check it is the server's model
        try:
            line_hashes, probe = read_identity_text(fields["model"])
        except ValueError as exc:
            raise Refused(f"header field 'model': {exc}") from None
        check_same_model(node.replica, fields["layout"], line_hashes, probe)
    fingerprint = weights_fingerprint(node.replica.model)
    if fingerprint != fields["fingerprint"]:
        return _reply(message, NEED_STATE, fingerprint=fingerprint)
    stream = batch_stream(context, node.settings.config, node.replica.workload, partition_index)
    local = node.replica.work(stream.at, step)
    payload = node.replica.half.begin(local, step)
    node.step, node.attempt, node.base, node.messages = step, fields["attempt"], fingerprint, []
    node.save(context, weights=True)  # forward passes move normalisation statistics
    return _upload_reply(message, node, payload, float(local.loss_sum))


@refusing
def handle_phase(message: Message, context: Context) -> Message:
    """``train.phase``: take the server's message; reply with the next payload, or apply the
    step's messages and reply with the weights fingerprint."""
    header, arrays = read_records(message.content, TENSORS)
    fields = read_fields(header, PHASE_FIELDS)
    step, phase = fields["step"], fields["phase"]
    policy = NodePolicy.from_node_config(context.node_config)
    node = NodeReplica.restore(context, policy)
    if node is None or (node.step, node.attempt, len(node.messages)) != (step, fields["attempt"], phase):
        return _reply(message, LOST, step=step, phase=phase)
    # The strategy does not name a message's tensors ahead of it: any known dtype, within the node's cap.
    tensors = read_tensors(arrays, lambda key: ANY_DTYPE, policy.limits.max_payload_bytes, NODE_PAYLOAD_LIMIT)
    server_message = Payload(step, phase, fields["num_samples"], tensors).to(node.replica.device)
    node.messages.append(server_message)
    reply = node.replica.half.receive(server_message)
    if reply is not None:
        node.save(context, weights=False)
        return _upload_reply(message, node, reply)
    fingerprint = node.replica.apply(node.messages)
    node.step, node.messages = -1, []
    node.save(context, weights=True)
    return _reply(message, DONE, step=step, fingerprint=fingerprint)


def make_client_app() -> ClientApp:
    """The ClientApp every node runs; it takes all settings from the server's messages."""
    app = ClientApp()
    app.train("step")(handle_step)
    app.train("phase")(handle_phase)
    return app


client_app = make_client_app()
