"""``dadfl.flower.records`` — what crosses Flower between the ServerApp and a node, and how
either side reads what the other sent.

Payload tensors travel in Flower's own records: an ``ArrayRecord`` keyed by payload key
(``"<name>:<role>"``, one numpy array each) and a ``ConfigRecord`` header with step, phase,
num_samples and the fields of the message's kind (``STEP_FIELDS``, ``PHASE_FIELDS``,
``REPLY_FIELDS``). Bytes in the metrics are the exact payload bytes, as everywhere else
(``dadfl.metrics``); Flower's npy framing is not counted.

Everything from the other side is hostile until read: known records and typed header fields
only, tensor keys and dtypes the reader allows, at most ``max_bytes`` of tensor data, and each
``.npy`` header accounting exactly for the bytes that follow before one copy is made
(``np.load`` would allocate whatever a header claims). A failure is a :class:`Refused` whose
text says what was wrong, never a value.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from dadfl.model_identity import MAX_IDENTITY_CHARS
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import DTYPES, Assembled, WireError, check_extent, check_payload_bytes, checked_dtype
from dadfl.sanitize import REASON_CHARS, one_line, printable
from dadfl.strategies import Payload

from .policy import MAX_SETTINGS_CHARS

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
        """The upload with the header the gRPC protocol checks read (``dadfl.trust.protocol.check_protocol``)."""
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
