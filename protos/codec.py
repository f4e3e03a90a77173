"""``dadfl.protos.codec`` — payload <-> wire messages: raw little-endian tensor bytes, chunked, optional fp16/bf16.

``encode_payload`` turns a :class:`~dadfl.strategies.Payload` into ``PayloadChunk``
messages; :class:`PayloadAssembler` rebuilds it from chunks as they arrive, checking
every declared size before allocating or copying anything. Tensor bytes are copied as
few times as possible (numpy views on the way out, one buffer and ``torch.frombuffer``
views on the way in), so the codec runs at memory speed.

Half-precision codecs (``fp16``, ``bf16``) apply only to floating tensors whose role is
a factor (``A``, ``D``, ``P``, ``Q``); dense gradients, buffers and states always travel
raw. A lossy codec changes what every replica decodes, so the sender of a message must
use :func:`roundtrip` on its own copy to stay bit-identical with the receivers.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Collection, Iterator, Sequence

import numpy as np
import torch

from dadfl.strategies.base import Payload, split_key

from . import tensor_pb2 as pb

CODECS = {"none": pb.RAW, "fp16": pb.FP16, "bf16": pb.BF16}
FACTOR_ROLES = frozenset({"A", "D", "rows", "P", "Q"})
DEFAULT_CHUNK_BYTES = 1 << 20

DTYPES = {
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.int64: pb.INT64,
    torch.int32: pb.INT32,
    torch.int16: pb.INT16,
    torch.int8: pb.INT8,
    torch.uint8: pb.UINT8,
    torch.bool: pb.BOOL,
}
TORCH_DTYPES = {wire: dtype for dtype, wire in DTYPES.items()}
WIRE_DTYPE_OF_CODEC = {pb.FP16: torch.float16, pb.BF16: torch.bfloat16}
# The wire's little-endian dtypes numpy reads in place (bfloat16 it has not; on a big-endian
# machine torch's byte swap below)
LITTLE_ENDIAN_NUMPY = {
    dtype: np.dtype(name) for dtype, name in {
        torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2", torch.int64: "<i8", torch.int32: "<i4",
        torch.int16: "<i2", torch.int8: "i1", torch.uint8: "u1", torch.bool: "?",
    }.items()
} if sys.byteorder == "little" else {}
MAX_DIMS = 8


class WireError(ValueError):
    """A message that cannot be decoded; the text says what was wrong with it."""


# Checks of another party's tensors before a byte is allocated for them, shared by this codec's
# header and the Flower runtime's .npy reader (dadfl/flower.py): the same bound, the same words.


def check_payload_bytes(total: int, max_bytes: int, setting: str) -> None:
    """Refuse a payload of more than ``max_bytes`` tensor bytes; ``setting`` names what raises the limit."""
    if total > max_bytes:
        raise WireError(f"payload of {total} bytes exceeds the limit of {max_bytes} bytes ({setting})")


def checked_dtype(where: str, dtype: torch.dtype | None, shown: str, allowed: Collection[torch.dtype] = DTYPES) -> torch.dtype:
    """``dtype`` when ``allowed`` holds it; None is a dtype no reader knows. ``shown`` is the
    dtype as the sender wrote it (a wire enum value, a numpy name)."""
    if dtype is None or dtype not in allowed:
        unknown = "unknown " if dtype is None else ""
        raise WireError(f"{where}: {unknown}dtype {shown}, expected {' or '.join(sorted(map(str, allowed)))}")
    return dtype


def check_extent(where: str, shape: Sequence[int], itemsize: int, nbytes: int) -> None:
    """A declared shape against the bytes the tensor carries: at most ``MAX_DIMS`` dimensions,
    none negative, exactly ``itemsize`` bytes per element (a header cannot claim a terabyte
    over four bytes)."""
    shape = tuple(shape)
    if len(shape) > MAX_DIMS or any(size < 0 for size in shape):
        raise WireError(f"{where}: invalid shape {shape}: at most {MAX_DIMS} dimensions, none negative")
    needed = math.prod(shape) * itemsize
    if nbytes != needed:
        raise WireError(f"{where}: shape {shape} needs {needed} bytes, it carries {nbytes}")


def codec_id(name: str) -> int:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return CODECS[name]


def wire_codec(key: str, tensor: torch.Tensor, codec: int) -> int:
    """The codec one tensor actually travels with: half precision for floating factors only."""
    if codec == pb.RAW or not tensor.is_floating_point() or split_key(key)[1] not in FACTOR_ROLES:
        return pb.RAW
    return codec


def _wire_array(tensor: torch.Tensor, codec: int) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy array; a view whenever no conversion is needed."""
    tensor = tensor.detach()
    if codec != pb.RAW:
        tensor = tensor.to(WIRE_DTYPE_OF_CODEC[codec])
    elif tensor.dtype not in DTYPES:
        raise WireError(f"dtype {tensor.dtype} cannot travel on the wire; use one of {', '.join(map(str, DTYPES))}")
    tensor = tensor.cpu().contiguous().reshape(-1)
    array = tensor.view(torch.uint8).numpy() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor.numpy()
    if sys.byteorder != "little" and array.itemsize > 1:
        array = array.byteswap()  # the wire is little-endian
    return array.view(np.uint8)


def encode_header(payload: Payload, codec: int = pb.RAW, kind: int = pb.PHASE, **fields) -> tuple[pb.PayloadHeader, list]:
    """Header and per-tensor byte arrays of a payload (no chunking yet).

    ``fields`` fills the header's other fields (``loss_sum``, ``base_fingerprint``, ``attempt``).
    """
    header = pb.PayloadHeader(kind=kind, step=payload.step, phase=payload.phase, num_samples=payload.num_samples, **fields)
    arrays, offset = [], 0
    for key, tensor in payload.tensors.items():
        if tensor.dtype not in DTYPES:
            raise WireError(f"tensor {key!r} has dtype {tensor.dtype}, which has no wire encoding")
        tensor_codec = wire_codec(key, tensor, codec)
        array = _wire_array(tensor, tensor_codec)
        header.tensors.add(
            key=key, shape=tensor.shape, dtype=DTYPES[tensor.dtype], codec=tensor_codec, offset=offset, nbytes=array.nbytes
        )
        arrays.append(array)
        offset += array.nbytes
    header.total_bytes = offset
    return header, arrays


def encode_payload(
    payload: Payload, codec: int = pb.RAW, chunk_bytes: int = DEFAULT_CHUNK_BYTES, kind: int = pb.PHASE, **fields
) -> list[pb.PayloadChunk]:
    """The chunks that carry ``payload``: header in the first, data cut at ``chunk_bytes``."""
    header, pieces = encode_pieces(payload, codec, chunk_bytes, kind, **fields)
    chunks = []
    for piece in pieces:
        chunks.append(pb.PayloadChunk())
        fill_chunk(chunks[-1], header, *piece)
    return chunks


def encode_pieces(
    payload: Payload, codec: int = pb.RAW, chunk_bytes: int = DEFAULT_CHUNK_BYTES, kind: int = pb.PHASE, **fields
) -> tuple[pb.PayloadHeader, Iterator[tuple[int, bytes, bool]]]:
    """The header and, made one at a time, each chunk of ``encode_payload`` as ``(offset, data,
    last)``: a sender that serialises each chunk as it comes never holds the message's bytes
    twice, and one that writes it into the chunk field of the message that carries it
    (``fill_chunk``) copies its bytes once (a chunk built on its own is copied again into a
    message made with it: ``SiteMessage(chunk=...)`` costs about 2 ms per MiB)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    header, arrays = encode_header(payload, codec, kind, **fields)

    def pieces() -> Iterator[tuple[int, bytes, bool]]:
        cut = _cut(arrays, chunk_bytes)
        offset, data = next(cut)
        for following in cut:
            yield offset, data, False
            offset, data = following
        yield offset, data, True

    return header, pieces()


def fill_chunk(chunk: pb.PayloadChunk, header: pb.PayloadHeader, offset: int, data: bytes, last: bool) -> None:
    """Write one piece of ``encode_pieces`` into ``chunk`` (an empty one); the first carries the header."""
    chunk.offset, chunk.data = offset, data
    if last:
        chunk.last = True
    if offset == 0:
        chunk.header.CopyFrom(header)


def _cut(arrays: list[np.ndarray], chunk_bytes: int):
    """``(offset, bytes)`` of each chunk of the arrays' concatenation, copying each byte once."""
    pieces, size, offset = [], 0, 0
    for array in arrays:
        view = memoryview(array)
        while len(view):
            take = min(chunk_bytes - size, len(view))
            pieces.append(view[:take])
            view, size = view[take:], size + take
            if size == chunk_bytes:
                yield offset, b"".join(pieces)
                pieces, offset, size = [], offset + size, 0
    if pieces or offset == 0:
        yield offset, b"".join(pieces)


@dataclass
class Assembled:
    """One received payload and its header (``header.total_bytes``: tensor bytes as sent)."""

    payload: Payload
    header: pb.PayloadHeader


@dataclass
class PayloadAssembler:
    """Rebuilds payloads from chunks, one at a time, refusing anything inconsistent.

    ``feed`` returns the finished payload on the last chunk, else None. Sizes are checked
    against ``max_payload_bytes`` from the header before any buffer is allocated.
    """

    max_payload_bytes: int
    _header: pb.PayloadHeader | None = None
    _buffer: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    _received: int = 0
    _checked: pb.PayloadHeader | None = None  # the last header check_header passed: a site's uploads repeat its tensors

    def feed(self, chunk: pb.PayloadChunk) -> Assembled | None:
        if chunk.HasField("header"):
            if self._header is not None:
                raise WireError("a new payload header arrived before the previous payload's last chunk")
            self._start(chunk.header)
        elif self._header is None:
            raise WireError("payload chunk without a header: the first chunk of a payload must carry its header")
        data = chunk.data  # every access to a bytes field copies it: read it once
        end = chunk.offset + len(data)
        if chunk.offset != self._received or end > len(self._buffer):
            raise WireError(
                f"chunk at byte {chunk.offset} (+{len(data)}) does not continue the payload "
                f"({self._received} of {len(self._buffer)} bytes received): chunks lost, reordered or oversized"
            )
        self._buffer[chunk.offset : end] = np.frombuffer(data, np.uint8)
        self._received = end
        if not chunk.last:
            return None
        if self._received != len(self._buffer):
            raise WireError(f"payload truncated: last chunk came after {self._received} of {len(self._buffer)} bytes")
        header, buffer = self._header, self._buffer
        self._header, self._buffer, self._received = None, np.empty(0, np.uint8), 0
        return Assembled(Payload(header.step, header.phase, header.num_samples, decode_tensors(header, buffer)), header)

    def _start(self, header: pb.PayloadHeader) -> None:
        check_payload_bytes(header.total_bytes, self.max_payload_bytes, "max_payload_bytes in the server config")
        last = self._checked
        if last is None or header.total_bytes != last.total_bytes or header.tensors != last.tensors:  # else it passes as that one did
            check_header(header)
            self._checked = header
        self._header = header
        self._buffer = np.empty(header.total_bytes, np.uint8)  # every byte is overwritten by a chunk


def check_header(header: pb.PayloadHeader) -> None:
    """Every tensor's declared shape, dtype and codec must account exactly for its bytes."""
    expected_offset = 0
    seen = set()
    for meta in header.tensors:
        where = f"tensor {meta.key!r}"
        if meta.key in seen:
            raise WireError(f"{where} appears twice in the payload")
        seen.add(meta.key)
        dtype = checked_dtype(where, TORCH_DTYPES.get(meta.dtype), str(meta.dtype))
        if meta.codec not in (pb.RAW, *WIRE_DTYPE_OF_CODEC):
            raise WireError(f"{where}: unknown codec {meta.codec}")
        if meta.codec != pb.RAW and not dtype.is_floating_point:
            raise WireError(f"{where}: a half-precision codec applies only to floating tensors")
        check_extent(where, meta.shape, (dtype if meta.codec == pb.RAW else WIRE_DTYPE_OF_CODEC[meta.codec]).itemsize, meta.nbytes)
        if meta.offset != expected_offset:
            raise WireError(f"{where}: starts at byte {meta.offset}, expected {expected_offset}")
        expected_offset += meta.nbytes
    if expected_offset != header.total_bytes:
        raise WireError(f"payload declares {header.total_bytes} bytes but its tensors occupy {expected_offset}")


def decode_tensors(header: pb.PayloadHeader, buffer: np.ndarray) -> dict[str, torch.Tensor]:
    """Tensors as views into ``buffer`` (raw) or converted copies (half-precision codecs).
    Through a numpy view where numpy has the dtype: a third of ``torch.frombuffer``'s cost,
    which a coordinator pays per tensor of every site's upload."""
    tensors = {}
    for meta in header.tensors:
        dtype = TORCH_DTYPES[meta.dtype]
        wire_dtype = dtype if meta.codec == pb.RAW else WIRE_DTYPE_OF_CODEC[meta.codec]
        shape = tuple(meta.shape)
        if wire_dtype in LITTLE_ENDIAN_NUMPY:
            tensor = torch.from_numpy(buffer[meta.offset : meta.offset + meta.nbytes].view(LITTLE_ENDIAN_NUMPY[wire_dtype]).reshape(shape))
        elif meta.nbytes == 0:
            tensor = torch.empty(shape, dtype=wire_dtype)
        else:
            flat = torch.frombuffer(buffer, dtype=wire_dtype, count=meta.nbytes // wire_dtype.itemsize, offset=meta.offset)
            if sys.byteorder != "little" and flat.element_size() > 1:
                flat = torch.from_numpy(flat.numpy().byteswap())
            tensor = flat.reshape(shape)
        tensors[meta.key] = tensor if wire_dtype == dtype else tensor.to(dtype)
    return tensors


def decode_chunks(chunks, max_payload_bytes: int = 1 << 40) -> Assembled:
    """Decode a complete list of chunks (tests, benchmarks, the sender's own roundtrip)."""
    assembler = PayloadAssembler(max_payload_bytes)
    for chunk in chunks:
        done = assembler.feed(chunk)
        if done is not None:
            return done
    raise WireError("payload truncated: no chunk marked last")


def roundtrip(payload: Payload, codec: int) -> Payload:
    """What receivers will decode from ``payload`` sent with ``codec`` (identity for raw)."""
    if codec == pb.RAW:
        return payload
    tensors = {}
    for key, tensor in payload.tensors.items():
        tensor_codec = wire_codec(key, tensor, codec)
        tensors[key] = tensor if tensor_codec == pb.RAW else tensor.to(WIRE_DTYPE_OF_CODEC[tensor_codec]).to(tensor.dtype)
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)
