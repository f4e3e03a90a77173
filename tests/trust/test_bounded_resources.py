"""What a site can make the coordinator hold is bounded: nothing before admission, bounded
inbox and outbox, state resends rate-limited. Real coordinator, real gRPC on loopback."""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

import dadfl.client.site as site_module
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos.channel import PROTOCOL_VERSION, channel_options
from dadfl.server.coordinator import RunStopped
from dadfl.server.links import MAX_QUEUED_EVENTS, Done, SiteLink
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config

ROOT = Path(__file__).resolve().parents[2]
FLOODER = "flooder"
FLOOD_MIB = 96


@pytest.mark.network
def test_preadmission_flood_is_refused_and_coordinator_memory_stays_flat():
    """An enrolled site sends 96 MiB (``FLOOD_MIB``) of chunks after ready, before it is admitted (the
    coordinator in its own process, its RSS read from /proc, after a control site's one-chunk
    refusal so that only the flood's own cost is measured)."""
    result = subprocess.run([sys.executable, "-m", "bench.bench_resources", "--only", "preadmission", "--flood-mib", str(FLOOD_MIB)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    assert figures["control_status"].startswith("INVALID_ARGUMENT: site control sent a chunk message before it was admitted")
    assert figures["status"].startswith("INVALID_ARGUMENT: site flooder sent a chunk message before it was admitted")
    # Holding the flood would cost ≥ 96 MiB; gRPC's buffers and the allocator's arenas have
    # reached 24.9 MiB on a loaded 2-core machine (the coordinator reads 1 MiB chunks).
    bound = FLOOD_MIB / 3
    assert figures["growth_after_mib"] < bound and figures["rss_peak_mib"] - figures["rss_before_mib"] < bound, figures


class SyncFlooder(site_module.Session):
    """At step 3, asks for the state 2,000 times (the flooder site only)."""

    def on_step_begin(self, begin):
        if self.site.config.site_id == FLOODER and begin.step == 3 and self.site.summary.connections == 1:
            for _ in range(2000):
                self.send(sync_request=cpb.SyncRequest(step=begin.step, fingerprint="0" * 64))
        super().on_step_begin(begin)


@pytest.mark.network
def test_sync_flood_gets_one_resend_then_resource_exhausted(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(site_module, "Session", SyncFlooder)
    config = server_config(tmp_path, training={"steps": 60, "eval_every": 60, "checkpoint_every": 0},
                           federation={"min_sites": 1, "initial_sites": 2, "linger_s": 5})
    server = ServerThread(config).start()
    honest = SiteThread(site_config(tmp_path, "honest", server.endpoint, 0, 2)).start()
    flooder = SiteThread(site_config(tmp_path, FLOODER, server.endpoint, 1, 2)).start()
    # The flood comes as the flooder begins step 3 by itself, before its done of step 2: that
    # step aborts without it and the honest site applies it once more.
    assert honest.join(60).steps in (60, 61)
    summary = flooder.join(60)
    server.join(30)
    assert caplog.text.count("flooder has weights") == 1, "one state resend for the whole flood"
    assert "asked for the state again within one step (a block repair, then the full state, per step)" in caplog.text
    assert summary.connections == 2 and summary.finished, "the flooder reconnected and heard the end"


def test_inbox_and_outbox_bounds_drop_the_site():
    import asyncio

    async def scenario():
        arrivals = asyncio.Queue()
        flood = SiteLink("a", "peer", arrivals)
        for step in range(MAX_QUEUED_EVENTS + 1):
            flood.deliver(Done(step, 0, ""))
        assert flood.closed and "messages are already waiting" in (await flood.outbox.get()).reason
        lagging = SiteLink("b", "peer", arrivals)
        begin = cpb.ServerMessage(step_begin=cpb.StepBegin(step=0))
        lagging.send(begin, begin)
        assert not lagging.closed, "one step behind is allowed"
        lagging.send(begin)
        assert lagging.closed and "more than one step behind" in (await lagging.outbox.get()).reason

    asyncio.run(scenario())


@pytest.mark.network
def test_site_that_stops_reading_is_dropped_while_a_write_waits(tmp_path, caplog):
    """A 67 MB state cannot fit in the transport's buffers: the write to a site that never
    reads waits until the phase timeout drops the site, which must end its stream."""
    caplog.set_level(logging.INFO)
    config = server_config(tmp_path, workload={"spec": "digits-mlp", "options": {"hidden": 4096}},
                           federation={"min_sites": 1, "phase_timeout_s": 2, "quorum_timeout_s": 3})
    server = ServerThread(config).start()
    token = site_config(tmp_path, "stuck", server.endpoint, 0, 1).token
    outgoing: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(server.endpoint, options=channel_options(4 << 20))
    try:
        responses = cpb_grpc.CoordinatorStub(channel).Join(iter(outgoing.get, None))
        outgoing.put(cpb.SiteMessage(hello=cpb.Hello(site_id="stuck", token=token, protocol_version=PROTOCOL_VERSION)))
        fingerprint = next(responses).config.layout_fingerprint
        outgoing.put(cpb.SiteMessage(ready=cpb.Ready(layout_fingerprint=fingerprint)))
        deadline = time.monotonic() + 30
        while "site stuck disconnected" not in caplog.text:
            assert time.monotonic() < deadline, "the stream of a site that does not read was never ended"
            time.sleep(0.1)
        assert "sent nothing for step 0 phase 0" in caplog.text
        with pytest.raises(RunStopped):
            server.join(30)
    finally:
        outgoing.put(None)
        channel.close()
