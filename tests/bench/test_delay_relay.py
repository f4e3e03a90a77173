"""The latency relay used by the link benchmark: bytes intact and in order, never early, bounded."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from bench.delay_relay import CHUNK, Delay, serve


async def _echo_server() -> asyncio.AbstractServer:
    async def echo(reader, writer):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _through_relay(delay: Delay, payload: bytes, seed: int = 0) -> tuple[bytes, float]:
    """Send ``payload`` through relay -> echo -> relay; what came back and the first small round trip."""
    echo = await _echo_server()
    echo_port = echo.sockets[0].getsockname()[1]
    relay = await serve("127.0.0.1", 0, "127.0.0.1", echo_port, delay, seed)
    relay_port = relay.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        start = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        assert await reader.readexactly(4) == b"ping"
        round_trip = time.monotonic() - start

        async def send():
            writer.write(payload)
            await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        received = await asyncio.wait_for(reader.read(-1), timeout=60)
        await sender
        writer.close()
        return received, round_trip
    finally:
        relay.close()
        echo.close()


@pytest.mark.network
def test_bytes_arrive_intact_in_order_and_never_early():
    delay = Delay(one_way_s=0.03, jitter_s=0.01)
    payload = os.urandom(3 * 1024 * 1024 + 17)  # many chunks, each with its own jitter draw
    received, round_trip = asyncio.run(_through_relay(delay, payload))
    assert received == payload
    assert round_trip >= 2 * (delay.one_way_s - delay.jitter_s)


@pytest.mark.network
def test_a_small_buffer_bound_still_carries_everything():
    delay = Delay(one_way_s=0.002, max_buffered=CHUNK)  # the reader pauses after every chunk
    payload = os.urandom(1024 * 1024)
    received, _ = asyncio.run(_through_relay(delay, payload))
    assert received == payload


@pytest.mark.network
def test_an_unreachable_target_closes_the_client_connection():
    async def scenario():
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        relay = await serve("127.0.0.1", 0, "127.0.0.1", dead_port, Delay(0.01))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.sockets[0].getsockname()[1])
            data = await asyncio.wait_for(reader.read(), timeout=10)
            writer.close()
            return data
        finally:
            relay.close()

    assert asyncio.run(scenario()) == b""


@pytest.mark.parametrize("one_way, jitter", [(0.01, 0.02), (-0.01, 0.0)])
def test_impossible_delays_are_refused(one_way, jitter):
    with pytest.raises(ValueError, match="jitter must be between 0 and the delay"):
        Delay(one_way, jitter)
