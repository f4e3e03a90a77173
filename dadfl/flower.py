"""The strategies as a Flower (``flwr`` 1.41 and 1.42) ServerApp/ClientApp pair, for sites that run Flower.

A thin runtime: the strategy code does all the math, exactly as in the in-process
simulation (``strategies.step.exchange`` is the loop mirrored here). One training step:

1. the ServerApp sends every node a ``train.step`` message: the step number, the run
   settings (workload, strategy, optimizer, batch size, seed), the node's partition index
   (its position in the sorted list of node ids), and the fingerprint of the weights the
   node must hold;
2. the node (ClientApp) runs forward/backward on its batch of that step and replies with
   its phase-0 payload; the server aggregates the payloads in node order (reproducible
   sums) and sends the message back as ``train.phase``; the node replies with the next
   phase's payload (PowerSGD has two phases) or, after the last phase, applies the
   decoded update and replies with its weights fingerprint;
3. the server applies the same messages to its own replica and checks every node's
   fingerprint against its own.

Payload tensors travel in Flower's own records: an ``ArrayRecord`` keyed by payload key
(``"<name>:<role>"``, one numpy array each) and a ``ConfigRecord`` header with step,
phase and num_samples. Bytes in the metrics are the exact payload bytes, as everywhere
else (``dadfl.metrics``); Flower's npy framing is not counted.

**Node state.** Flower runs the ClientApp wherever it likes: in a simulation each message
goes to any Ray actor, in a deployment every message starts a fresh ``flwr-clientapp``
process. So a node keeps its replica in ``context.state``, which Flower keeps on the node
for the run and hands to each invocation (it is never sent to the server): weights and
optimizer state as an ``ArrayRecord``, the server messages of the step under way, and the
strategy's site half pickled (PowerSGD error feedback and warm start, rank-dAD warm
start). A half that cannot be pickled (a user strategy's, say) is rebuilt from the
strategy at each message, which restarts any state it kept.

**Resync.** A node whose state is missing (a new or restarted SuperNode) or whose weights
differ from the server's answers ``need_state`` (or ``lost`` in the middle of a step).
The server then restarts the step: every node gets the server's full state (weights and
optimizer state) and rebuilds its site half, and the server rebuilds its server half, so
all participants describe the same federation. Exactness is unaffected; strategy state
(PowerSGD error memory and warm start, rank-dAD error memories and warm start) restarts from scratch, as in
the gRPC runtime. Nodes that fail or do not answer stop the run with an error: this
integration has no dropout tolerance (the gRPC runtime, ``dadfl server``, has).

**Trust.** A node's reply is hostile until checked, as an upload is in the gRPC runtime.
The ServerApp first reads it without decoding any tensor (:func:`read_reply`): only the
header and tensor records; the header fields of its status with their types; tensor keys
the strategy's upload rules name for the phase, with their dtypes; at most
``max_payload_bytes`` of tensor data; and each ``.npy`` header must account exactly for
the bytes that follow before one copy is made (``np.load`` would allocate whatever a
header claims). Then the gRPC coordinator's own checks run: the protocol header
(``dadfl/trust/protocol.py``: step, attempt, phase, base weights, sample count, loss), the
strategy's rules and the influence bound, and the aggregated message as every node will
decode it (``dadfl/trust/screening.py``). The bounds (:class:`ServerBounds`) are the gRPC server
config's fields of the same names, set in the run config (``max-influence-ratio``,
``max-update-norm``, ``clip-ratio``, ``agreement``, ``max-payload-bytes``) or at their
defaults: ``max_influence_ratio`` 100, no ``max_update_norm``, bounded influence on
(``clip_ratio`` 2, ``agreement``: the same clipping and weights as the gRPC coordinator,
``docs/robustness.md``), ``max_payload_bytes`` 1 GiB.
Without dropout tolerance, a refused node stops the run with a :class:`FlowerRunError`
naming the node and the reason; non-finite values the model produced (most nodes' uploads,
or the weights after an update) stop it naming no node (``screening.model_fault``). What Flower itself holds before the ServerApp sees a
reply (the message as the SuperLink received it) is Flower's to bound.

A node holds the server to its own rules in turn, as a gRPC site does its coordinator
(``flower_policy.py``): the run settings in a step message pass the gRPC site's checks
(``dadfl/trust/run_checks.py``: the workload allowed by name before any import, bounded options,
batch size, steps and model size within the node's limits, the [dp] floor) under a policy
from the node config, before anything is imported or built; the server's messages and full
state are read as replies are (:func:`read_records`, :func:`read_fields`,
:func:`read_tensors`): known records and typed header fields only, the full state's keys
those of this model and its optimizer, at most ``limits.max_payload_bytes`` of tensors,
every ``.npy`` header checked against its bytes. A node that refuses replies ``refused``
with one line saying why; the ServerApp stops the run with it, naming the node.

Flower's deployment engine polls every 3 s, so each round trip (1 + number of phases
per step) costs seconds; use Flower to join existing federations and the gRPC runtime
for speed. Entry points: :func:`make_flower_apps`, :func:`simulate_flower` and
:func:`run_flower_simulation` (``flwr.simulation.run_simulation`` with N supernodes;
``dadfl sim --mode flower``), and the module-level ``server_app`` / ``client_app`` for
``flwr run`` (settings from the run config).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
import torch

# Flower reads this once, on first import: no usage reports from sites unless a user opts in
# by setting it to 1 (in a deployment, the SuperLink's and SuperNodes' own environment decides).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from dadfl.trust.run_checks import RunRefused, check_same_model
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import DTYPES, Assembled, WireError, check_extent, check_payload_bytes, checked_dtype
from dadfl.protos.state import MODEL_PREFIX, OPTIM_PREFIX, load_state, state_payload
from dadfl.sanitize import REASON_CHARS, one_line, printable
from dadfl.federation import FederationConfig, WireConfig
from dadfl.trust.screening import WEIGHTS_NOT_FINITE, Screening, model_fault, model_fault_reason, nonfinite_reason, weights_finite
from dadfl.trust.protocol import PayloadError, check_protocol
from dadfl.strategies import Payload, make_strategy, weights_fingerprint
from dadfl.workloads import Split, StepBatches, Workload, load_workload, partition, site_batches

from .config import load_config, validate_config
from .flower_policy import MAX_SETTINGS_CHARS, NodePolicy, cached_workload, check_settings, node_workload
from .metrics import MetricsWriter, is_eval_step, run_summary, write_summary
from .model_identity import MAX_IDENTITY_CHARS, identity_text, read_identity_text
from .replica import Replica, resolve_device
from .simulation import Progress, SimulationConfig, StrategySpec, run_directory

log = logging.getLogger("dadfl.flower")

STEP_MESSAGE = "train.step"  # begins a step (optionally carrying the server's full state)
PHASE_MESSAGE = "train.phase"  # one aggregated server message of the step

HEADER = "dadfl.header"  # ConfigRecord: step, phase, num_samples and per-kind fields
TENSORS = "dadfl.tensors"  # ArrayRecord: payload tensors by "<name>:<role>"
STATE = "dadfl.state"  # ArrayRecord in a step message: the server's weights and optimizer state

# Replies
PAYLOAD = "payload"  # TENSORS holds the next phase's payload
DONE = "done"  # the node applied the update; the header holds its fingerprint
NEED_STATE = "need_state"  # the node's weights are missing or differ from the server's
LOST = "lost"  # the node lost the step under way (state gone mid-step)
REFUSED = "refused"  # the node does not run what the server's message asks (the header says why)

# Node-local records in context.state (never leave the node)
NODE_INFO = "dadfl.node"
NODE_WEIGHTS = "dadfl.node.weights"
NODE_MESSAGE = "dadfl.node.message.{}"  # the server messages of the step under way, by phase

NODE_WAIT_S = 300.0  # how long the ServerApp waits for enough SuperNodes to connect
REPLY_TIMEOUT_S = 600.0  # a fresh flwr-clientapp process imports torch and loads the workload
MAX_ATTEMPTS_PER_STEP = 3

# The ServerApp's bounds on replies: ``dadfl server``'s [federation] and [wire] fields of these names.
BOUND_FIELDS = {
    "max_influence_ratio": FederationConfig, "max_update_norm": FederationConfig, "clip_ratio": FederationConfig,
    "agreement": FederationConfig, "max_payload_bytes": WireConfig,
}
# Keys a Flower run config may set besides the SimulationConfig fields (dashes or underscores).
RUN_CONFIG_EXTRAS = ("config", "strategy", "out", *BOUND_FIELDS)


# ----------------------------------------------------------------------------- records


def record_from_tensors(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """Payload tensors as Flower arrays (numpy ``.npy`` bytes: dtype, shape, exact values)."""
    arrays = {}
    for key, tensor in tensors.items():
        try:
            arrays[key] = Array(tensor.detach().cpu().numpy())
        except TypeError as exc:  # bfloat16 has no numpy dtype
            raise TypeError(
                f"tensor {key!r} has dtype {tensor.dtype}, which Flower's numpy arrays cannot hold; "
                "train in float32/float16 to use the Flower runtime"
            ) from exc
    return ArrayRecord(arrays)


def tensors_from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Tensors of a record this node wrote itself (``context.state``); bytes from the other side
    are read bounded (:func:`read_tensors`)."""
    # np.load from bytes gives read-only arrays; torch wants writable memory.
    return {key: torch.from_numpy(np.array(array.numpy(), copy=True)) for key, array in record.items()}


# ----------------------------------------------------------------------------- reading the other side

MAX_FIELD_CHARS = 64  # a weights fingerprint (32 hex digits) with room to spare
FIELD_CHARS = {"settings": MAX_SETTINGS_CHARS, "reason": REASON_CHARS, "model": MAX_IDENTITY_CHARS}  # text fields longer than MAX_FIELD_CHARS
MAX_COUNT = 2**31 - 1  # steps, phases, attempts and samples fit the wire header's fields

# The header fields of each reply status, by type (besides "status"); nothing else may be there.
REPLY_FIELDS: dict[str, dict[str, type]] = {
    PAYLOAD: {"step": int, "phase": int, "num_samples": int, "attempt": int, "base_fingerprint": str, "loss_sum": float},
    DONE: {"step": int, "fingerprint": str},
    NEED_STATE: {"fingerprint": str},
    LOST: {"step": int, "phase": int},
    REFUSED: {"reason": str},
}
# The header fields of the server's messages.
STEP_FIELDS = {
    "step": int, "attempt": int, "phase": int, "num_samples": int, "settings": str, "partition_index": int, "fingerprint": str, "layout": str,
    "model": str,  # model_identity.identity_text (step 0 and with a full state; else empty)
}
PHASE_FIELDS = {"step": int, "phase": int, "num_samples": int, "attempt": int}
NUMPY_DTYPES = {np.dtype(torch.empty(0, dtype=d).numpy().dtype): d for d in DTYPES if d != torch.bfloat16}
ANY_DTYPE = frozenset(NUMPY_DTYPES.values())
FLOAT_DTYPES = frozenset(d for d in ANY_DTYPE if d.is_floating_point)
NODE_PAYLOAD_LIMIT = "limits.max_payload_bytes in the node config"


class Refused(ValueError):
    """A message from the other side that this side does not accept; the text says what was
    wrong, never its values."""


@dataclass(frozen=True)
class Reply:
    """A node's checked reply: its status, header fields and (status ``payload``) its upload."""

    status: str
    fields: dict[str, Any]
    payload: Payload | None = None

    def upload(self) -> Assembled:
        """The upload with the header the gRPC protocol checks read (``validate.check_protocol``)."""
        header = pb.PayloadHeader(
            kind=pb.PHASE, step=self.fields["step"], phase=self.fields["phase"], num_samples=self.fields["num_samples"],
            attempt=self.fields["attempt"], base_fingerprint=self.fields["base_fingerprint"], loss_sum=self.fields["loss_sum"],
        )
        return Assembled(self.payload, header)


def read_reply(content: RecordDict, upload_dtypes: Callable[[], dict[str, set[torch.dtype]] | None], max_bytes: int) -> Reply:
    """A node's reply, every record and field checked before any tensor is decoded.

    Only the header and (for a payload) the tensor record may be there; the header holds
    the fields of its status with their types; tensors are keys ``upload_dtypes()`` names
    (None: the phase takes no upload) with one of its dtypes, ``max_bytes`` in all, each
    ``.npy`` header accounting exactly for its bytes.
    """
    header, arrays = read_records(content, TENSORS)
    status = header.get("status")
    if not isinstance(status, str) or status not in REPLY_FIELDS:
        shown = printable(status) if isinstance(status, str) else f"of type {type(status).__name__}"
        raise Refused(f"unknown status {shown}; expected one of {', '.join(REPLY_FIELDS)}")
    fields = read_fields(header, {"status": str, **REPLY_FIELDS[status]}, f" in a {status!r} reply")
    del fields["status"]
    if status != PAYLOAD:
        if arrays is not None:
            raise Refused(f"a {status!r} reply carries tensors")
        return Reply(status, fields)
    allowed = upload_dtypes()
    if allowed is None:
        raise Refused(f"phase {fields['phase']} takes no upload")
    tensors = read_tensors(arrays, allowed.get, max_bytes, "the gRPC runtime's max_payload_bytes")
    return Reply(status, fields, Payload(fields["step"], fields["phase"], fields["num_samples"], tensors))


def read_records(content: RecordDict, tensors: str) -> tuple[ConfigRecord, ArrayRecord | None]:
    """The ``HEADER`` config record and the array record ``tensors`` (None when absent); any
    other record, or one of these of another kind, is refused."""
    expected = {HEADER} | ({tensors} & set(content.array_records))
    extra = sorted(set(content) - expected)
    if extra:
        raise Refused(f"unexpected record {printable(extra[0])}")
    header = content.config_records.get(HEADER)
    if header is None:
        raise Refused(f"no {HEADER!r} config record")
    return header, content.array_records.get(tensors)


def read_fields(header: ConfigRecord, wanted: dict[str, type], where: str = "") -> dict[str, Any]:
    """Exactly the ``wanted`` header fields, each of its type and within its bound."""
    unknown = sorted(set(header) - set(wanted))
    if unknown:
        raise Refused(f"unexpected header field {printable(unknown[0])}{where}")
    return {name: _field(header, name, kind) for name, kind in wanted.items()}


def read_tensors(
    arrays: ArrayRecord | None, dtypes_of: Callable[[str], set[torch.dtype] | None], max_bytes: int, limit: str
) -> dict[str, torch.Tensor]:
    """The record's tensors: keys ``dtypes_of`` knows (None: not expected), with one of its
    dtypes, at most ``max_bytes`` in all (``limit`` names that setting), each decoded bounded
    with the gRPC codec's checks (``protos/codec.py``)."""
    arrays = arrays if arrays is not None else {}
    for key in arrays:
        if dtypes_of(key) is None:
            raise Refused(f"unexpected tensor {printable(key)}")
    total = sum(len(array.data) if isinstance(array.data, bytes) else 0 for array in arrays.values())
    try:
        check_payload_bytes(total, max_bytes, limit)
        return {key: _decode_array(key, array, dtypes_of(key)) for key, array in arrays.items()}
    except WireError as exc:
        raise Refused(str(exc)) from None


def _field(header: ConfigRecord, name: str, kind: type) -> Any:
    value = header.get(name)
    if kind is int and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    if kind is float and isinstance(value, float):
        return value
    chars = FIELD_CHARS.get(name, MAX_FIELD_CHARS)
    if kind is str and isinstance(value, str) and len(value) <= chars:
        return value
    bound = {int: f"an integer in 0..{MAX_COUNT}", float: "a floating-point number", str: f"text of at most {chars} characters"}[kind]
    raise Refused(f"header field {name!r} is {'missing' if value is None else 'not ' + bound}")


def _decode_array(key: str, array: Array, dtypes: set[torch.dtype]) -> torch.Tensor:
    """One tensor from its ``.npy`` bytes: the header read and checked first (a known dtype
    among ``dtypes``, a shape the bytes that follow fill exactly: ``codec.check_extent``), then
    one copy into writable memory. Never ``np.load``: it allocates what a header claims."""
    where = f"tensor {key!r}"
    if array.stype != "numpy.ndarray" or not isinstance(array.data, bytes):
        raise Refused(f"{where}: not a numpy array")
    stream = io.BytesIO(array.data)
    try:
        version = np.lib.format.read_magic(stream)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"npy format version {version}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read(stream)
    except (ValueError, TypeError, SyntaxError) as exc:  # numpy's reasons for a malformed header
        raise Refused(f"{where}: not a valid .npy array ({one_line(str(exc), 80)})") from None
    wanted = checked_dtype(where, NUMPY_DTYPES.get(dtype), one_line(str(dtype), 40), dtypes)
    data = memoryview(array.data)[stream.tell():]
    check_extent(where, shape, dtype.itemsize, len(data))
    flat = torch.frombuffer(bytearray(data), dtype=wanted) if len(data) else torch.empty(0, dtype=wanted)
    if fortran_order:  # as np.load reads it: the reversed shape, transposed
        return flat.reshape(shape[::-1]).permute(*reversed(range(len(shape))))
    return flat.reshape(shape)


def payload_content(payload: Payload, **header: Any) -> RecordDict:
    fields = {"step": payload.step, "phase": payload.phase, "num_samples": payload.num_samples, **header}
    return RecordDict({HEADER: ConfigRecord(fields), TENSORS: record_from_tensors(payload.tensors)})


# ----------------------------------------------------------------------------- run settings


@dataclass(frozen=True)
class RunSettings:
    """What the server tells every node: the simulation settings and the one strategy."""

    config: SimulationConfig
    spec: StrategySpec

    def __post_init__(self) -> None:
        if self.config.dp is not None:  # never train without the noise the config asks for
            raise ValueError("[dp] is not supported by the Flower integration yet; use dadfl sim or dadfl server/site")

    def to_json(self) -> str:
        return json.dumps({"config": self.config.model_dump(mode="json"), "strategy": self.spec.model_dump(mode="json")})


@dataclass(frozen=True)
class ServerBounds:
    """What the ServerApp accepts from a reply: ``dadfl server``'s [federation] and [wire]
    fields of the same names, with their defaults and limits (``server/config.py``)."""

    max_influence_ratio: float = FederationConfig().max_influence_ratio
    max_update_norm: float | None = FederationConfig().max_update_norm
    max_payload_bytes: int = WireConfig().max_payload_bytes
    clip_ratio: float = FederationConfig().clip_ratio
    agreement: bool = FederationConfig().agreement

    @classmethod
    def from_values(cls, values: dict[str, Any], source: str) -> "ServerBounds":
        """The bounds ``values`` set (the rest default), checked as the gRPC server's config is."""
        checked = {}
        for model in (FederationConfig, WireConfig):
            fields = {key: values[key] for key, owner in BOUND_FIELDS.items() if owner is model and key in values}
            checked.update(validate_config(fields, model, source=source).model_dump(include=set(fields)))
        return cls(**checked)


def settings_from_run_config(run_config: dict[str, Any]) -> tuple[RunSettings, Path, ServerBounds]:
    """Settings for ``flwr run`` from the Flower run config; returns them, the metrics folder
    and the bounds on replies.

    ``config`` names a simulation TOML (``configs/simulation.toml``), ``strategy`` is one
    strategy spec (``"powersgd:rank=4"``, default ``"dad"``), ``out`` the folder for run
    directories (default ``runs``); any scalar SimulationConfig field (``workload``,
    ``sites``, ``steps``, ``batch-size``, ``seed`` ...) overrides the file.
    ``max-influence-ratio``, ``max-update-norm`` and ``max-payload-bytes`` set the
    :class:`ServerBounds` (absent: ``dadfl server``'s defaults).
    """
    values = {key.replace("-", "_"): value for key, value in run_config.items()}
    unknown = sorted(set(values) - set(RUN_CONFIG_EXTRAS) - set(SimulationConfig.model_fields))
    if unknown:
        raise ValueError(
            f"Flower run config has unknown key(s) {', '.join(map(repr, unknown))}; dadfl reads "
            f"{', '.join(RUN_CONFIG_EXTRAS)} and the fields of SimulationConfig (see configs/simulation.toml)"
        )
    bounds = ServerBounds.from_values({key: values.pop(key) for key in BOUND_FIELDS if key in values}, "Flower run config")
    path = values.pop("config", None)
    base = load_config(path, SimulationConfig).model_dump() if path else SimulationConfig().model_dump()
    spec = StrategySpec.parse(str(values.pop("strategy", "dad")))
    out = Path(str(values.pop("out", "runs")))
    base.update(values)
    base["strategies"] = [spec.model_dump()]
    config = validate_config(base, SimulationConfig, source=f"Flower run config{f' ({path})' if path else ''}")
    return RunSettings(config, spec), out, bounds


def workload_for(config: SimulationConfig) -> Workload:
    """The ServerApp's workload, from its own config (a node builds its own: :func:`node_workload`)."""
    key = ("server", config.workload, json.dumps(config.workload_options, sort_keys=True))
    return cached_workload(key, lambda: load_workload(config.workload, **config.workload_options))


# ----------------------------------------------------------------------------- node (ClientApp)


# Minibatches by (run, node, partition index, data file). Only a shortcut: a step's batch
# depends on (seed, step) alone, so a process that lacks them rebuilds them.
_batch_streams: dict[tuple[int, int, int, str], StepBatches] = {}


def _read_data_file(path: Path) -> Split:
    from dadfl.data_files import read_data_file  # the gRPC site's reader: same file formats

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


# ----------------------------------------------------------------------------- server (ServerApp)


class FlowerRunError(RuntimeError):
    """A node failed, did not answer, or its state could not be repaired; the message says which."""


@dataclass
class StepResult:
    messages: list[Payload]
    samples: int
    loss_sum: float
    bytes_up: int
    bytes_down: int
    phase_seconds: list[float]
    fingerprints: dict[int, str]  # by node id, after the step
    update: dict[str, torch.Tensor]  # decoded from the messages as the nodes decode them, checked


class FlowerCoordinator:
    """The ServerApp's loop: the coordinator replica, the server half, one step at a time."""

    def __init__(self, settings: RunSettings, grid: Grid, metrics: MetricsWriter, progress: Progress | None = None,
                 bounds: ServerBounds = ServerBounds()):
        self.settings, self.grid, self.metrics, self.progress, self.bounds = settings, grid, metrics, progress, bounds
        self.config, self.spec = settings.config, settings.spec
        self.settings_json = settings.to_json()
        torch.set_num_threads(self.config.threads)
        self.strategy = make_strategy(self.spec.name, **self.spec.options)
        device = resolve_device(self.config.device)
        self.replica = Replica(workload_for(self.config), self.strategy, self.config.optimizer, device, probe=True,
                               precision=self.config.precision)
        # Sent only where nodes build their replica afresh (step 0, a full state): JSON of 0.6 KB
        # (digits MLP) to 6.6 KB (char transformer), too much for every step.
        self.model_identity = identity_text(self.replica.layout.lines(), self.replica.model_probe)
        self.server_half = self.strategy.server(self.replica.layout, self.replica.model)
        self.screening = Screening(
            self.replica, bounds.max_influence_ratio, bounds.max_update_norm, clip_ratio=bounds.clip_ratio, agreement=bounds.agreement,
        )
        self.fingerprint = weights_fingerprint(self.replica.model)
        self.nodes: list[int] = []

    def wait_for_nodes(self) -> list[int]:
        """The first ``sites`` node ids in sorted order; a node's position is its partition index."""
        deadline = time.monotonic() + NODE_WAIT_S
        while len(connected := sorted(self.grid.get_node_ids())) < self.config.sites:
            if time.monotonic() > deadline:
                raise FlowerRunError(
                    f"only {len(connected)} of the {self.config.sites} SuperNodes this run needs (sites) connected "
                    f"within {NODE_WAIT_S:g} s; start more SuperNodes or lower sites"
                )
            time.sleep(0.5)
        return connected[: self.config.sites]

    def run(self) -> dict[str, Any]:
        """Train for ``config.steps`` steps; write one record per step; return a summary."""
        self.nodes = self.wait_for_nodes()
        log.info("dadfl over Flower: %s on nodes %s", self.spec.display, self.nodes)
        records: list[dict[str, Any]] = []
        for step in range(self.config.steps):
            started = time.perf_counter()
            result, attempt = None, 0
            while result is None:
                if attempt == MAX_ATTEMPTS_PER_STEP:
                    raise FlowerRunError(f"step {step}: nodes kept losing their state after {attempt} attempts")
                result = self.run_step(step, attempt)
                attempt += 1
            self.fingerprint = self.replica.apply_update(result.update)
            if not weights_finite(self.replica.model):
                raise FlowerRunError(f"step {step}: {WEIGHTS_NOT_FINITE}")
            elapsed = time.perf_counter() - started
            mismatched = [str(node) for node, fp in result.fingerprints.items() if fp != self.fingerprint]
            if mismatched:
                log.warning("step %d: nodes %s ended with other weights; they resync next step", step, ", ".join(mismatched))
            record = {
                "strategy": self.spec.display,
                "step": step,
                "sites": len(self.nodes),
                "samples": result.samples,
                "train_loss": result.loss_sum / result.samples,
                "bytes_up": result.bytes_up,
                "bytes_down": result.bytes_down,
                "seconds": elapsed,
                "fingerprint": self.fingerprint,
                "phase_seconds": result.phase_seconds,
                "site_ids": [str(node) for node in self.nodes],
                "attempt": attempt - 1,
                "fingerprint_mismatches": mismatched,
                **self.screening.weights_record(step, [str(node) for node in self.nodes]),
                **self.strategy.describe(self.replica.layout, result.messages),
            }
            if is_eval_step(step, self.config.eval_every, self.config.steps):
                record.update({f"test_{k}": v for k, v in self.replica.evaluate().items()})
            self.metrics.write(record)
            records.append(record)
            if self.progress:
                self.progress(step)
        return run_summary(records, self.spec.display, self.replica.workload.metric_name)

    def run_step(self, step: int, attempt: int) -> StepResult | None:
        """All phases of one step, as ``exchange`` runs them; None when a node lost its state.

        The server has then applied nothing; the restart (a later ``attempt``) sends every
        node the full state, which also undoes what nodes that finished the step had applied.
        """
        resync = attempt > 0
        if resync:
            self.server_half = self.strategy.server(self.replica.layout, self.replica.model)
        phase_started = time.perf_counter()
        replies = self.round(step, attempt, 0, STEP_MESSAGE, self.step_content(step, attempt, resync))
        if self.needs_restart(step, replies, state_sent=resync):
            return None
        messages: list[Payload] = []
        payloads = self.uploads(step, attempt, 0, replies, messages)
        samples = sum(p.num_samples for p in payloads)
        loss_sum = sum(reply.fields["loss_sum"] for reply in replies)
        phase_seconds, bytes_up, bytes_down = [], 0, 0
        while True:
            bytes_up += sum(p.nbytes() for p in payloads)
            message, sent, update = self.aggregate(step, payloads, messages)
            messages.append(sent)  # what every node decodes
            bytes_down += message.nbytes() * len(self.nodes)
            content = payload_content(sent, attempt=attempt)  # the bytes every node decodes, as the update was taken from them
            replies = self.round(step, attempt, message.phase + 1, PHASE_MESSAGE, lambda _: content)
            phase_seconds.append(time.perf_counter() - phase_started)
            phase_started = time.perf_counter()
            if self.needs_restart(step, replies, state_sent=False):
                return None
            statuses = {reply.status for reply in replies}
            if statuses == {DONE}:
                fingerprints = {node: reply.fields["fingerprint"] for node, reply in zip(self.nodes, replies)}
                return StepResult(messages, samples, loss_sum, bytes_up, bytes_down, phase_seconds, fingerprints, update)
            if statuses != {PAYLOAD}:
                raise FlowerRunError(f"step {step}: nodes disagree on the number of phases ({sorted(statuses)})")
            payloads = self.uploads(step, attempt, message.phase + 1, replies, messages)

    def uploads(self, step: int, attempt: int, phase: int, replies: Sequence[Reply], messages: list[Payload]) -> list[Payload]:
        """The phase's payloads, each past the protocol checks (``validate.check_protocol``),
        then all past the strategy's rules and the influence bound (``screening.py``)."""
        max_samples = self.screening.max_samples(self.config.batch_size, step)
        for node, reply in zip(self.nodes, replies):
            if reply.status != PAYLOAD:
                self.refuse(node, step, phase, f"it replied {reply.status!r} where its phase {phase} payload was due")
            try:
                check_protocol(reply.upload(), step, attempt, phase, self.fingerprint, max_samples)
            except PayloadError as exc:
                self.refuse(node, step, phase, str(exc))
        payloads = [reply.payload.to(self.replica.device) for reply in replies]
        nonfinite = {i: reason for i, reply in enumerate(replies) if (reason := nonfinite_reason(reply.fields["loss_sum"], payloads[i]))}
        if model_fault(len(nonfinite), len(replies)):
            raise FlowerRunError(model_fault_reason(step, phase, list(nonfinite.values()), len(replies), weights_finite(self.replica.model)))
        refused = {**nonfinite, **self.screening.refusals(step, phase, payloads, messages)}
        for index, reason in sorted(refused.items()):
            self.refuse(self.nodes[index], step, phase, reason)
        return payloads

    def aggregate(self, step: int, payloads: list[Payload], messages: list[Payload]) -> tuple[Payload, Payload, dict]:
        """The phase's message, as nodes receive it and the update it decodes to after this
        phase (``Screening.message``); a message that would fail at a node stops the run,
        naming the nodes whose uploads break it."""
        phase, start = payloads[0].phase, self.server_half.state_dict()
        try:
            return self.screening.message(self.server_half, payloads, messages)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        breaking = self.screening.breaking(start, payloads, messages)
        if not breaking or len(breaking) == len(payloads):
            raise FlowerRunError(f"step {step} phase {phase}: the {self.strategy.name} server half failed: {one_line(failure)}")
        self.refuse([self.nodes[index] for index in breaking], step, phase, f"the upload breaks the aggregated message ({one_line(failure)})")

    def refuse(self, nodes: int | list[int], step: int, phase: int, reason: str) -> NoReturn:
        """Stop the run for a node's bad reply: over Flower every node must answer every step.
        ``reason`` is the checks' own text (names a node sent are quoted by them)."""
        nodes = [nodes] if isinstance(nodes, int) else nodes
        who = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(map(str, nodes))}"
        raise FlowerRunError(f"step {step} phase {phase}: {who} refused: {reason}")

    def step_content(self, step: int, attempt: int, with_state: bool) -> Callable[[int], RecordDict]:
        """The ``train.step`` content for the node at each position. With the full state (a
        resync) every node rebuilds its replica and site half: strategy state restarts. The
        model identity goes where a node builds its replica afresh: step 0 and a full state."""
        state = record_from_tensors(state_payload(self.replica, step).tensors) if with_state else None
        layout = self.replica.layout.fingerprint()
        model = self.model_identity if with_state or step == 0 else ""

        def content(position: int) -> RecordDict:
            header = ConfigRecord(
                {
                    "step": step,
                    "attempt": attempt,
                    "phase": 0,
                    "num_samples": 0,
                    "settings": self.settings_json,
                    "partition_index": position,
                    "fingerprint": self.fingerprint,
                    "layout": layout,
                    "model": model,
                }
            )
            records: dict[str, Any] = {HEADER: header}
            if state is not None:
                records[STATE] = state
            return RecordDict(records)

        return content

    def needs_restart(self, step: int, replies: Sequence[Reply], state_sent: bool) -> bool:
        """Whether a node lost its state (the step restarts); an error if the state it was
        just sent did not fix it."""
        lost = [(node, reply.status) for node, reply in zip(self.nodes, replies) if reply.status in (NEED_STATE, LOST)]
        if not lost:
            return False
        if state_sent:
            raise FlowerRunError(
                f"step {step}: nodes {', '.join(str(n) for n, _ in lost)} still differ after loading the server's state; "
                "sites must compute on the same kind of device as the server for replicas to stay bit-identical"
            )
        log.warning("step %d: %s; sending every node the full state", step, ", ".join(f"node {n} {s}" for n, s in lost))
        return True

    def round(
        self, step: int, attempt: int, phase: int, message_type: str, content_for: Callable[[int], RecordDict]
    ) -> list[Reply]:
        """Send each node (by position) its message, wait for every reply; the replies, read
        and bounded (:func:`read_reply`), in node order. ``phase``: of the uploads they carry."""
        outgoing = [
            Message(content_for(position), node, message_type, group_id=str(step))
            for position, node in enumerate(self.nodes)
        ]
        replies = {reply.metadata.src_node_id: reply for reply in self.grid.send_and_receive(outgoing, timeout=REPLY_TIMEOUT_S)}
        missing = [node for node in self.nodes if node not in replies]
        if missing:
            raise FlowerRunError(
                f"step {step} phase {phase}: no reply from node(s) {', '.join(map(str, missing))} within {REPLY_TIMEOUT_S:g} s; "
                "every node must answer every step over Flower (the gRPC runtime tolerates dropouts)"
            )
        for node in self.nodes:
            if replies[node].has_error():
                raise FlowerRunError(f"step {step} phase {phase}: node {node} failed: {one_line(str(replies[node].error.reason))}")
        upload_dtypes = functools.cache(lambda: self.screening.upload_dtypes(step, phase))
        checked = []
        for node in self.nodes:
            try:
                reply = read_reply(replies[node].content, upload_dtypes, self.bounds.max_payload_bytes)
            except Refused as exc:
                self.refuse(node, step, phase, str(exc))
            if reply.status == REFUSED:
                reason = one_line(reply.fields["reason"])
                raise FlowerRunError(f"step {step} phase {phase}: node {node} refuses the server's message: {reason}")
            checked.append(reply)
        return checked


@dataclass
class FlowerApps:
    """A ServerApp/ClientApp pair for one strategy; ``summary`` is set when the run ends."""

    server_app: ServerApp
    client_app: ClientApp
    summary: dict[str, Any] | None = None


def make_flower_apps(
    config: SimulationConfig, spec: StrategySpec, metrics: MetricsWriter, progress: Progress | None = None
) -> FlowerApps:
    """Apps that train ``spec`` with ``config`` and write one record per step to ``metrics``."""
    make_strategy(spec.name, **spec.options)  # unknown names or options fail here, not in a node
    settings = RunSettings(config, spec)
    apps = FlowerApps(ServerApp(), make_client_app())

    @apps.server_app.main()
    def main(grid: Grid, context: Context) -> None:
        apps.summary = FlowerCoordinator(settings, grid, metrics, progress).run()

    return apps


def make_server_app() -> ServerApp:
    """The ServerApp for ``flwr run``: settings from the run config (:func:`settings_from_run_config`);
    writes ``config.json``, ``metrics.jsonl``, ``summary.json`` and plots to a new run directory."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from .report import write_plots  # matplotlib: only the ServerApp needs it

        settings, out, bounds = settings_from_run_config(dict(context.run_config))
        run_dir = run_directory(out, f"flower-{context.run_id}")
        (run_dir / "config.json").write_text(json.dumps(settings.config.model_dump(mode="json"), indent=2))
        with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
            summary = FlowerCoordinator(settings, grid, metrics, bounds=bounds).run()
        write_summary(run_dir / "summary.json", [summary])
        write_plots(run_dir)
        log.info("dadfl over Flower: %s -> %s", summary, run_dir)

    return app


server_app = make_server_app()
client_app = make_client_app()


def simulate_flower(
    config: SimulationConfig,
    spec: StrategySpec,
    metrics: MetricsWriter,
    progress: Progress | None = None,
    actors: int | None = None,
) -> dict[str, Any]:
    """Train ``spec`` with Flower's simulation engine (Ray) and ``config.sites`` supernodes.

    The counterpart of :func:`dadfl.simulation.simulate`: the same records into ``metrics``,
    the same summary. ``actors`` Ray workers run the ClientApp (default: one per site, at
    most one per CPU core).
    """
    from flwr.simulation import run_simulation

    actors = actors or max(1, min(config.sites, os.cpu_count() or 1))
    # Ray hides GPUs from actors that request none; replicas must compute on one kind of device.
    gpu_share = 1.0 / actors if resolve_device(config.device).type == "cuda" else 0.0
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": gpu_share},
        "init_args": {"num_cpus": actors, "num_gpus": 1 if gpu_share else 0},
    }
    apps = make_flower_apps(config, spec, metrics, progress)
    run_simulation(apps.server_app, apps.client_app, num_supernodes=config.sites, backend_config=backend_config)
    if apps.summary is None:
        raise FlowerRunError("the Flower simulation ended before the ServerApp finished; see the log above")
    return apps.summary


def run_flower_simulation(
    config: SimulationConfig,
    spec: StrategySpec,
    run_dir: str | Path,
    progress: Progress | None = None,
    actors: int | None = None,
) -> dict[str, Any]:
    """:func:`simulate_flower` appending its records to ``run_dir/metrics.jsonl``."""
    with MetricsWriter(Path(run_dir) / "metrics.jsonl") as metrics:
        return simulate_flower(config, spec, metrics, progress, actors)
