"""A payload of more than 100 MB crosses the real coordinator over gRPC, in chunks."""

from __future__ import annotations

import pytest

from dadfl.metrics import read_metrics
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process

HUNDRED_MB = 100_000_000
CHUNK_BYTES = (4 << 20) - 65536  # the largest chunk a server config allows


def test_a_payload_over_100_mb_crosses_the_coordinator_in_chunks(tmp_path):
    # One dSGD step on a 5120 x 5120 Linear layer: each site uploads a 105 MB gradient
    # and receives the 105 MB mean; one site keeps the test fast, the server's replica is the second.
    config = server_config(
        tmp_path,
        workload={"spec": "tests.helpers.workloads:big_linear", "options": {}},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.0},
        training={"steps": 1, "batch_size": 8, "eval_every": 1, "checkpoint_every": 0},
        federation={"min_sites": 1},
        wire={"chunk_bytes": CHUNK_BYTES},
    )
    server = ServerThread(config).start()
    site = SiteThread(site_config(tmp_path, "site-0", server.endpoint, 0, 1)).start()
    summary = site.join(timeout=300)
    server.join(timeout=300)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["bytes_up"] > HUNDRED_MB and record["bytes_down"] > HUNDRED_MB
    assert record["wire_bytes_up"] > record["bytes_up"], "the wire count includes the chunks' framing"
    assert record["wire_bytes_down"] > HUNDRED_MB
    assert summary.steps == 1 and summary.fingerprint == record["fingerprint"]
    assert record["fingerprint_mismatches"] == []
