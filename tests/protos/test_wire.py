"""The wire codec: exact roundtrips, half-precision factors, byte accounting, refusals."""

from __future__ import annotations

import pytest
import torch

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import PayloadAssembler, WireError, codec_id, decode_chunks, encode_payload, roundtrip
from dadfl.strategies import Payload


def sample_payload() -> Payload:
    g = torch.Generator().manual_seed(0)
    return Payload(
        step=7,
        phase=1,
        num_samples=33,
        tensors={
            "0.weight:grad": torch.randn(16, 64, generator=g),
            "0:A": torch.randn(1, 33, 64, generator=g),
            "0:D": torch.randn(1, 33, 16, generator=g),
            "2:P": torch.randn(2, 8, 3, generator=g, dtype=torch.float64),
            "bn.running_mean:buffer": torch.randn(16, generator=g),
            "bn.num_batches_tracked:buffer": torch.tensor(5),
            "mask:buffer": torch.tensor([True, False, True]),
            "empty:A": torch.empty(1, 0, 4),
            "scalar:grad": torch.tensor(1.5),
            "half:grad": torch.randn(3, generator=g).half(),
            "bf:grad": torch.randn(3, generator=g).bfloat16(),
            "idx:buffer": torch.arange(4, dtype=torch.int32),
        },
    )


def wire(chunks):
    """What the receiver parses: every chunk serialised and parsed again."""
    return [pb.PayloadChunk.FromString(chunk.SerializeToString()) for chunk in chunks]


@pytest.mark.parametrize("chunk_bytes", [1, 100, 4096, 1 << 20])
def test_raw_roundtrip_is_bit_exact_for_every_dtype_and_chunking(chunk_bytes):
    payload = sample_payload()
    chunks = encode_payload(payload, chunk_bytes=chunk_bytes, loss_sum=2.5, base_fingerprint="abc", attempt=2)
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert [c.HasField("header") for c in chunks] == [True] + [False] * (len(chunks) - 1)
    got = decode_chunks(wire(chunks))
    assert (got.payload.step, got.payload.phase, got.payload.num_samples) == (7, 1, 33)
    assert (got.header.loss_sum, got.header.base_fingerprint, got.header.attempt) == (2.5, "abc", 2)
    assert list(got.payload.tensors) == list(payload.tensors)
    for key, tensor in payload.tensors.items():
        out = got.payload.tensors[key]
        assert out.dtype == tensor.dtype and out.shape == tensor.shape, key
        assert torch.equal(out.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key
    assert got.header.total_bytes == payload.nbytes()


def test_bytes_are_little_endian_raw_values():
    chunks = encode_payload(Payload(0, 0, 1, {"x:grad": torch.tensor([1.0, -2.0])}))
    assert chunks[0].data == bytes.fromhex("0000803f000000c0")
    assert list(chunks[0].header.tensors[0].shape) == [2]


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_codec_applies_to_factors_only_and_is_counted(name, dtype):
    payload = sample_payload()
    codec = codec_id(name)
    got = decode_chunks(wire(encode_payload(payload, codec=codec)))
    factors = ("0:A", "0:D", "2:P", "empty:A")
    for key, tensor in payload.tensors.items():
        out = got.payload.tensors[key]
        assert out.dtype == tensor.dtype, key
        if key in factors:
            assert torch.equal(out, tensor.to(dtype).to(tensor.dtype)), key
        else:
            assert torch.equal(out, tensor), key
    saved = sum(payload.tensors[k].numel() * (payload.tensors[k].element_size() - 2) for k in factors)
    assert got.header.total_bytes == payload.nbytes() - saved
    # what the sender applies to its own replica equals what receivers decode
    expected = roundtrip(payload, codec)
    assert all(torch.equal(expected.tensors[k], got.payload.tensors[k]) for k in payload.tensors)


def test_unknown_codec_name_is_refused():
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        codec_id("fp8")


def test_oversized_payload_is_refused_before_allocating():
    chunks = encode_payload(Payload(0, 0, 1, {"x:grad": torch.zeros(1000)}), chunk_bytes=1024)
    with pytest.raises(WireError, match="exceeds the limit of 100 bytes"):
        PayloadAssembler(100).feed(chunks[0])


def test_truncated_payload_is_refused():
    chunks = wire(encode_payload(Payload(0, 0, 1, {"x:grad": torch.zeros(1000)}), chunk_bytes=1000))
    with pytest.raises(WireError, match="no chunk marked last"):
        decode_chunks(chunks[:-1])
    chunks[-1].data = chunks[-1].data[:-4]
    with pytest.raises(WireError, match="truncated"):
        decode_chunks(chunks)


def test_lost_or_reordered_chunks_are_refused():
    chunks = wire(encode_payload(Payload(0, 0, 1, {"x:grad": torch.zeros(1000)}), chunk_bytes=1000))
    with pytest.raises(WireError, match="does not continue the payload"):
        decode_chunks([chunks[0], chunks[2], chunks[1], chunks[3]])
    with pytest.raises(WireError, match="without a header"):
        decode_chunks(chunks[1:])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m: setattr(m, "nbytes", m.nbytes + 4), "needs 4000 bytes, it carries 4004"),
        (lambda m: m.shape.append(2), "needs 8000 bytes"),
        (lambda m: setattr(m, "dtype", 99), "unknown dtype 99"),
        (lambda m: setattr(m, "codec", 7), "unknown codec 7"),
        (lambda m: m.shape.__setitem__(0, -1000), "invalid shape"),
        (lambda m: setattr(m, "offset", 8), "starts at byte 8"),
    ],
)
def test_inconsistent_headers_are_refused_with_the_reason(corrupt, message):
    chunks = wire(encode_payload(Payload(0, 0, 1, {"x:grad": torch.zeros(1000)})))
    after_good = PayloadAssembler(1 << 20)  # it passed this tensor list unchanged before: the change is checked
    assert after_good.feed(wire(encode_payload(Payload(0, 0, 1, {"x:grad": torch.ones(1000)})))[0]) is not None
    corrupt(chunks[0].header.tensors[0])
    with pytest.raises(WireError, match=message):
        decode_chunks(chunks)
    with pytest.raises(WireError, match=message):
        after_good.feed(chunks[0])


def test_duplicate_tensor_keys_are_refused():
    chunks = wire(encode_payload(Payload(0, 0, 1, {"x:grad": torch.zeros(2)})))
    meta = chunks[0].header.tensors.add()
    meta.CopyFrom(chunks[0].header.tensors[0])
    with pytest.raises(WireError, match="appears twice"):
        decode_chunks(chunks)


def test_half_codec_on_integer_tensor_is_refused():
    chunks = wire(encode_payload(Payload(0, 0, 1, {"x:buffer": torch.zeros(2, dtype=torch.int16)})))
    chunks[0].header.tensors[0].codec = pb.FP16
    with pytest.raises(WireError, match="only to floating tensors"):
        decode_chunks(chunks)


def test_assembler_keeps_working_after_a_payload():
    assembler = PayloadAssembler(1 << 20)
    for step in range(3):
        done = None
        for chunk in wire(encode_payload(Payload(step, 0, 1, {"x:grad": torch.full((300,), float(step))}), chunk_bytes=500)):
            done = assembler.feed(chunk)
        assert done.payload.step == step and torch.equal(done.payload.tensors["x:grad"], torch.full((300,), float(step)))


def test_chunks_written_into_their_messages_are_the_bytes_of_chunks_made_apart():
    """Site and coordinator write each chunk into the message that carries it (``encode_pieces``,
    ``fill_chunk``): the same bytes on the wire as a chunk built apart and copied in."""
    from dadfl.protos import coordinator_pb2 as cpb
    from dadfl.protos.codec import encode_pieces, fill_chunk
    from dadfl.server.links import Encoded

    payload, going_next = sample_payload(), cpb.StepNext(checkpoint_step=4)
    apart = encode_payload(payload, chunk_bytes=1000, kind=pb.PHASE, attempt=2, loss_sum=1.5)
    assert len(apart) > 2
    expected = [cpb.ServerMessage(chunk=c, next=going_next if i == 0 else None).SerializeToString() for i, c in enumerate(apart)]
    header, pieces = encode_pieces(payload, chunk_bytes=1000, kind=pb.PHASE, attempt=2, loss_sum=1.5)
    assert [e.data for e in Encoded.chunks(header, pieces, going_next)] == expected
    header, pieces = encode_pieces(payload, chunk_bytes=1000, kind=pb.PHASE, attempt=2, loss_sum=1.5)
    site = []
    for piece in pieces:
        message = cpb.SiteMessage()
        fill_chunk(message.chunk, header, *piece)
        site.append(message.SerializeToString())
    assert site == [cpb.SiteMessage(chunk=c).SerializeToString() for c in apart]
