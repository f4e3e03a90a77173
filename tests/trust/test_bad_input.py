"""Bad input gets a clear error naming what was wrong; the server keeps running, loses nothing.

One coordinator runs a federation with a good site; an attacker site (enrolled, so it
gets past the door) joins again and again, each time sending one kind of bad input.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from typer.testing import CliRunner

import dadfl.client.site as site_module
from dadfl.cli import app
from dadfl.metrics import read_metrics
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import encode_payload
from dadfl.strategies import Payload
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config, write_toml

ATTACKER = "attacker"


def replace_grad(payload: Payload, change) -> Payload:
    tensors = dict(payload.tensors)
    key = next(k for k in tensors if k.endswith(":grad"))
    tensors[key] = change(tensors[key])
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)


def with_nan(t):
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def with_inf(t):
    t = t.clone()
    t.view(-1)[0] = float("inf")
    return t


PAYLOAD_ATTACKS = {
    "wrong shape": (lambda p: replace_grad(p, lambda t: t.reshape(-1)[:-1]), "expected (16, 64)"),
    "wrong dtype": (lambda p: replace_grad(p, lambda t: t.double()), "dtype torch.float64, expected torch.float32"),
    "NaN": (lambda p: replace_grad(p, with_nan), "contains NaN or Inf"),
    "Inf": (lambda p: replace_grad(p, with_inf), "contains NaN or Inf"),
    "unknown tensor": (lambda p: Payload(p.step, p.phase, p.num_samples, {**p.tensors, "9.weight:grad": torch.zeros(2)}), "unexpected tensor '9.weight:grad'"),
    "unknown role": (lambda p: Payload(p.step, p.phase, p.num_samples, {**p.tensors, "0:Z": torch.zeros(2)}), "unexpected tensor '0:Z'"),
    "wrong step": (lambda p: Payload(p.step + 5, p.phase, p.num_samples, p.tensors), "while the server runs step"),
    "wrong phase": (lambda p: Payload(p.step, 3, p.num_samples, p.tensors), "payload for phase 3"),
    "too many samples": (lambda p: Payload(p.step, p.phase, 10_000, p.tensors), "num_samples=10000 is outside 1..16"),
}


def stale_version(chunks):
    chunks[0].header.base_fingerprint = "0" * 64
    return chunks


def truncated(chunks):
    return chunks[:1] + chunks[:1]  # a new header before the first payload's last chunk


def oversized(chunks):
    chunks[0].header.total_bytes = 1 << 40
    return chunks


def corrupt_header(chunks):
    chunks[0].header.tensors[0].nbytes += 8
    return chunks


CHUNK_ATTACKS = {
    "stale model version": (stale_version, "the site's weights are stale"),
    "truncated payload": (truncated, "before the previous payload's last chunk"),
    "oversized payload": (oversized, "exceeds the limit"),
    "inconsistent header": (corrupt_header, "bytes, it carries"),
}


class AttackerSession(site_module.Session):
    """Sends the current attack instead of an honest upload (the attacker site only)."""

    attack = None  # (payload change, chunk change)

    def upload(self, payload, loss_sum=0.0):
        if self.site.config.site_id != ATTACKER:
            return super().upload(payload, loss_sum)
        change_payload, change_chunks = AttackerSession.attack
        payload = change_payload(payload)
        chunks = encode_payload(payload, chunk_bytes=1024, kind=pb.PHASE, attempt=self.step.attempt, base_fingerprint=self.step.fingerprint)
        for chunk in change_chunks(chunks):
            self.send(chunk=chunk)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    config = server_config(
        tmp,
        training={"steps": 400, "eval_every": 400, "checkpoint_every": 0},
        federation={"min_sites": 1, "initial_sites": 2, "linger_s": 1, "quarantine_after": 1000},
    )
    server = ServerThread(config).start()
    patch = pytest.MonkeyPatch()
    patch.setattr(site_module, "Session", AttackerSession)
    good = SiteThread(site_config(tmp, "good", server.endpoint, 0, 2)).start()
    attacker = site_module.Site(site_config(tmp, ATTACKER, server.endpoint, 1, 2))
    yield server, good, attacker, tmp
    patch.undo()


def attack(attacker, change_payload=lambda p: p, change_chunks=lambda c: c) -> grpc.RpcError:
    AttackerSession.attack = (change_payload, change_chunks)
    with pytest.raises(grpc.RpcError) as caught:
        asyncio.run(attacker.join(insecure=True))
    return caught.value


@pytest.mark.network
@pytest.mark.parametrize("name", list(PAYLOAD_ATTACKS))
def test_bad_payload_is_refused_with_the_reason(federation, name):
    _, _, attacker, _ = federation
    change, message = PAYLOAD_ATTACKS[name]
    error = attack(attacker, change_payload=change)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "site attacker" in error.details() and message in error.details()


@pytest.mark.network
@pytest.mark.parametrize("name", list(CHUNK_ATTACKS))
def test_bad_chunks_are_refused_with_the_reason(federation, name):
    _, _, attacker, _ = federation
    change, message = CHUNK_ATTACKS[name]
    error = attack(attacker, change_chunks=change)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


def raw_join(endpoint, messages, serializer=None):
    """Send raw messages on a Join stream; return the status the server ends it with."""
    channel = grpc.insecure_channel(endpoint)
    try:
        join = channel.stream_stream(
            "/dadfl.v1.Coordinator/Join",
            request_serializer=serializer or cpb.SiteMessage.SerializeToString,
            response_deserializer=cpb.ServerMessage.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            for _ in join(iter(messages), timeout=30):
                pass
        return caught.value
    finally:
        channel.close()


@pytest.mark.network
def test_stream_that_does_not_start_with_hello_is_refused(federation):
    server = federation[0]
    error = raw_join(server.endpoint, [cpb.SiteMessage(step_done=cpb.StepDone(step=1))])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected a hello message, got step_done" in error.details()


@pytest.mark.network
def test_garbage_bytes_are_refused(federation):
    server = federation[0]
    error = raw_join(server.endpoint, [b"\xff\xfe not a protobuf"], serializer=lambda raw: raw)
    assert error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)


@pytest.mark.network
def test_message_larger_than_the_limit_is_refused(federation):
    server = federation[0]
    huge = cpb.SiteMessage(chunk=pb.PayloadChunk(data=bytes(6 << 20)))
    error = raw_join(server.endpoint, [huge])
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.network
def test_wrong_layout_fingerprint_is_refused(federation, monkeypatch):
    _, _, attacker, _ = federation

    class WrongLayout(AttackerSession):
        def handle(self, message):
            if message.WhichOneof("kind") == "config":
                self.site.prepare(message.config)
                self.send(ready=cpb.Ready(layout_fingerprint="0123456789abcdef"))
                return False
            return super().handle(message)

    monkeypatch.setattr(site_module, "Session", WrongLayout)
    with pytest.raises(grpc.RpcError) as caught:
        asyncio.run(attacker.join(insecure=True))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "built model layout 0123456789abcdef" in caught.value.details()


@pytest.mark.network
def test_the_run_finishes_and_no_bad_input_reached_the_model(federation):
    server, good, attacker, tmp = federation
    summary = good.join(120)
    server.join()
    records = list(read_metrics(tmp / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(400))
    assert all(r["site_ids"] == ["good"] for r in records[1:]), "only the good site's uploads are aggregated"
    assert summary.fingerprint == records[-1]["fingerprint"]
    assert all(r["train_loss"] == r["train_loss"] for r in records)  # no NaN crept in


def test_config_with_a_wrong_field_names_file_field_and_fix(tmp_path):
    bad = write_toml(tmp_path / "server.toml", {"training": {"stepz": 3}, "federation": {"min_sites": 0}})
    result = CliRunner().invoke(app, ["server", "--config", str(bad), "--insecure"])
    assert result.exit_code == 2
    assert str(bad) in result.output and "field 'training.stepz'" in result.output and "remove it or check its spelling" in result.output
    assert "field 'federation.min_sites'" in result.output
    site = write_toml(tmp_path / "site.toml", {"site_id": "a", "token": "x" * 20, "connect": {"server": "h:1"}, "data": {"source": "partition", "site_index": 3, "num_sites": 2}})
    result = CliRunner().invoke(app, ["site", "--config", str(site)])
    assert result.exit_code == 2 and "site_index 3 must be below num_sites 2" in result.output
