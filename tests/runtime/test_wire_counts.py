"""Wire metrics on real gRPC: a step's bytes up per site are what the site sent for that step."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from dadfl.client.site import Session
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.server.links import GRPC_FRAME_BYTES
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process


def test_a_steps_wire_bytes_up_are_its_upload_and_its_done_even_when_the_done_rides_the_next_upload(tmp_path, monkeypatch):
    """Steps go on by themselves, so the done of step t travels in step t + 1's first chunk
    (``previous_done``): its bytes count towards t, the rest of that message towards t + 1."""
    sent = defaultdict(list)  # site id -> every message it wrote, in order
    take = Session.take_outgoing

    def recorded(session):
        outgoing = take(session)
        sent[session.site.config.site_id] += outgoing
        return outgoing

    monkeypatch.setattr(Session, "take_outgoing", recorded)
    steps = 4
    config = server_config(tmp_path, training={"steps": steps, "batch_size": 16, "eval_every": 2, "checkpoint_every": 0})
    server = ServerThread(config).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, 2)).start() for i in range(2)]
    for site in sites:
        site.join(60)
    server.join(60)

    expected = defaultdict(lambda: defaultdict(int))  # step -> site id -> bytes
    carried = 0
    for site_id, messages in sent.items():
        upload_step = None
        for message in messages:
            kind = message.WhichOneof("kind")
            if kind in ("hello", "ready"):  # the handshake, before any step
                continue
            assert kind in ("chunk", "step_done"), kind  # a clean run: no resync, no departure
            size = message.ByteSize() + GRPC_FRAME_BYTES
            if message.HasField("previous_done"):
                done = cpb.SiteMessage(previous_done=message.previous_done).ByteSize()
                expected[message.previous_done.step][site_id] += done
                size -= done
                carried += 1
            if kind == "step_done":
                expected[message.step_done.step][site_id] += size
            else:
                if message.chunk.HasField("header"):
                    upload_step = message.chunk.header.step
                expected[upload_step][site_id] += size
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert carried == 2 * (steps - 1), "every step but the last sent its done with the next upload"
    assert [r["step"] for r in records] == list(range(steps))
    for record in records:
        assert record["wire_bytes_up_by_site"] == expected[record["step"]], record["step"]
        assert record["wire_bytes_up"] == sum(expected[record["step"]].values())
