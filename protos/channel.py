"""``dadfl.protos.channel`` — gRPC channel and server options shared by the coordinator and the sites."""

from __future__ import annotations

# 2: one round trip per step (StepNext / SiteMessage.previous_done); 3: the run config carries
# the model probe and layout line hashes a site checks before joining; 4: PowerSGD's dense
# tensors travel with Q_s in phase 1. A site and a server of different versions are refused at
# the hello with FAILED_PRECONDITION, naming both.
PROTOCOL_VERSION = 4


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """Message limits sized to one payload chunk plus its header; keepalive to spot dead peers."""
    limit = chunk_bytes + (1 << 20)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: a server that hears
        # pings closer than this while it sends nothing counts strikes and, after two, ends the
        # connection (GOAWAY "too_many_pings"). Its default, 5 minutes, would end a site's
        # stream during any step that keeps the coordinator silent for a minute (a 100M model).
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
