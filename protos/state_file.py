"""``dadfl.protos.state_file`` — tensors in a file, written and read in chunks: checkpoints and saved strategy states.

Layout (little-endian, as the wire)::

    magic (8 bytes) | u32 n | n bytes of meta (the caller's, e.g. JSON) |
    u32 m | m bytes of PayloadHeader (each tensor's key, dtype, shape, offset, nbytes) |
    every tensor's raw bytes, in header order | XXH3-128 digest of all that precedes it

The header is the wire codec's (``protos/codec.py``), checked by its ``check_header``, so a
file describes its tensors as a payload does. Both directions move at most ``chunk_bytes``
of one tensor at a time: the writer hands the file views of the tensors' own memory (a
CUDA tensor is copied to the host one chunk at a time); the reader fills tensors the caller
provides (a model's own parameters, an optimizer's state) with ``readinto``. A 100M-parameter
model with Adam's moments (1.2 GB) is thus saved and restored with no second copy in memory,
where ``torch.save``/``torch.load`` of a state dict hold one more whole copy while they
work. A torn or altered file fails ``verify`` (the digest) before a byte of it is loaded.

Tune ``chunk_bytes`` (1 MiB) for the file system: larger pieces cost memory, not speed.
"""

from __future__ import annotations

import struct
import sys
from typing import BinaryIO, Callable

import numpy as np
import torch
import xxhash

from dadfl.strategies import Payload

from . import tensor_pb2 as pb
from .codec import DTYPES, TORCH_DTYPES, WireError, check_header

MAGIC = b"dadflst1"  # this layout, version 1
TORCH_ZIP = b"PK\x03\x04"  # how torch.save's files start: the state files before this layout
LENGTH = struct.Struct("<I")
DIGEST_BYTES = 16
CHUNK_BYTES = 1 << 20
MAX_HEAD_BYTES = 1 << 26  # meta and header of any state we write are far smaller


def state_header(payload: Payload) -> pb.PayloadHeader:
    """The wire header of ``payload``'s tensors, each raw (no data is read)."""
    header = pb.PayloadHeader(kind=pb.STATE, step=payload.step, phase=payload.phase, num_samples=payload.num_samples)
    offset = 0
    for key, tensor in payload.tensors.items():
        if tensor.dtype not in DTYPES:
            raise WireError(f"tensor {key!r} has dtype {tensor.dtype}, which a state file cannot hold")
        nbytes = tensor.numel() * tensor.element_size()
        header.tensors.add(key=key, shape=tensor.shape, dtype=DTYPES[tensor.dtype], codec=pb.RAW, offset=offset, nbytes=nbytes)
        offset += nbytes
    header.total_bytes = offset
    return header


def tensor_pieces(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES):
    """The tensor's little-endian bytes in pieces of at most ``chunk_bytes`` (whole elements):
    views of its memory on the CPU, host copies of one piece each from another device."""
    flat = tensor.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()  # one tensor's copy, never the state's
    flat = flat.reshape(-1)
    itemsize = flat.element_size()
    step = max(1, chunk_bytes // itemsize)
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step].cpu().view(torch.uint8).numpy()
        if sys.byteorder != "little" and itemsize > 1:
            piece = piece.view(f"u{itemsize}").byteswap().view(np.uint8)
        yield piece


def write_state(file: BinaryIO, payload: Payload, meta: bytes = b"", magic: bytes = MAGIC,
                chunk_bytes: int = CHUNK_BYTES, on_piece: Callable[[int], None] | None = None) -> None:
    """Write ``payload``'s tensors (and ``meta``) to ``file`` in the module's layout;
    ``on_piece`` sees the size of every piece handed to the file (tests: nothing bigger
    than a chunk is ever built)."""
    header = state_header(payload).SerializeToString()
    digest = xxhash.xxh3_128()

    def put(data) -> None:
        view = memoryview(data).cast("B")
        digest.update(view)
        if on_piece is not None:
            on_piece(len(view))
        while view:
            view = view[file.write(view) :]

    for part in (magic, LENGTH.pack(len(meta)), meta, LENGTH.pack(len(header)), header):
        put(part)
    for tensor in payload.tensors.values():
        for piece in tensor_pieces(tensor, chunk_bytes):
            put(piece)
    file.write(digest.digest())


def _read_exactly(file: BinaryIO, nbytes: int, digest) -> bytes:
    data = file.read(nbytes)
    if len(data) != nbytes:
        raise ValueError("it ends early")
    digest.update(data)
    return data


def read_head(file: BinaryIO, magic: bytes = MAGIC) -> tuple[bytes, pb.PayloadHeader, "xxhash.xxh3_128"]:
    """Meta and checked header from the start of ``file``, and the digest of what was read."""
    digest = xxhash.xxh3_128()
    start = _read_exactly(file, len(magic), digest)
    if start.startswith(TORCH_ZIP):
        raise ValueError("it was written by an earlier dadfl with torch.save; finish that run with the version that started it")
    if start != magic:
        raise ValueError("it is not a state file of this format")
    parts = []
    for _ in range(2):
        (length,) = LENGTH.unpack(_read_exactly(file, LENGTH.size, digest))
        if length > MAX_HEAD_BYTES:
            raise ValueError(f"it declares a {length}-byte header")
        parts.append(_read_exactly(file, length, digest))
    header = pb.PayloadHeader.FromString(parts[1])
    check_header(header)
    if any(meta.codec != pb.RAW for meta in header.tensors):
        raise ValueError("it holds converted tensors")
    return parts[0], header, digest


def verify(file: BinaryIO, magic: bytes = MAGIC, chunk_bytes: int = CHUNK_BYTES) -> tuple[bytes, pb.PayloadHeader]:
    """Read the whole file once (one chunk held at a time) and check its digest and length;
    its meta and header. ``file`` is left at its start."""
    meta, header, digest = read_head(file, magic)
    remaining = header.total_bytes
    while remaining:
        remaining -= len(_read_exactly(file, min(chunk_bytes, remaining), digest))
    if file.read(DIGEST_BYTES + 1) != digest.digest():
        raise ValueError("its digest does not match its contents")
    file.seek(0)
    return meta, header


def fill(file: BinaryIO, target: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
         magic: bytes = MAGIC, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Read every tensor of a ``verify``'d file into ``target(key, shape, dtype)``, a tensor of
    that shape and dtype the caller owns (a parameter to overwrite, a fresh buffer), a chunk at
    a time: CPU tensors straight into their memory, others through one host chunk."""
    _, header, _ = read_head(file, magic)
    for meta in header.tensors:
        dtype, shape = TORCH_DTYPES[meta.dtype], tuple(meta.shape)
        tensor = target(meta.key, shape, dtype)
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {meta.key!r} {shape} {dtype} does not fit its target {tuple(tensor.shape)} {tensor.dtype}")
        _read_into(file, tensor, chunk_bytes)


def _read_into(file: BinaryIO, tensor: torch.Tensor, chunk_bytes: int) -> None:
    flat = tensor.detach().view(-1)  # a contiguous target: state tensors are
    itemsize = flat.element_size()
    step = max(1, chunk_bytes // itemsize)
    host = None if flat.device.type == "cpu" else torch.empty(min(step, flat.numel()), dtype=flat.dtype)
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        into = piece if host is None else host[: len(piece)]
        array = into.view(torch.uint8).numpy()
        if file.readinto(memoryview(array)) != array.nbytes:
            raise ValueError("it ends early")
        if sys.byteorder != "little" and itemsize > 1:
            array.view(f"u{itemsize}").byteswap(inplace=True)
        if host is not None:
            piece.copy_(into)
