"""Latency for emulated links: a user-space TCP relay that delays every byte it forwards.

    python -m bench.delay_relay --listen 127.0.0.1:50070 --target 10.213.0.1:50061 \\
        --delay-ms 20 [--jitter-ms 2] [--seed 0]

``netem`` is not available on these machines, so ``tc`` can shape bandwidth (``tbf``) but
adds no latency. This relay supplies the latency: it accepts connections on ``listen``,
opens one to ``target`` for each, and forwards both directions, holding every chunk it
reads for the one-way delay before writing it on. A site that connects through it sees a
round trip of ``2 · delay`` more than the link's own; bandwidth stays with ``tbf`` on the
veth links the relay's outbound traffic crosses.

Per direction, a chunk read at time t is released at

    release = max(t + delay + jitter_draw, previous release)

with ``jitter_draw`` uniform in [-jitter, +jitter] from a seeded generator (one per
connection and direction). Taking the max keeps the byte stream in order, as TCP would:
jitter spreads the release times, it never reorders bytes. The relay never releases a
chunk before ``t + delay - jitter``; the added delay is therefore a lower bound, and how far
above it the relay runs (event-loop wake-ups, copying) is what ``bench/links.py`` measures
and reports as the emulator's accuracy.

Memory is bounded: a direction stops reading once ``max_buffered`` bytes wait for release,
so a fast sender meets TCP back-pressure instead of filling the relay.

What it does not model: the relay's own TCP connections see the short physical round
trip, so congestion-window growth after idle (slow start over a long RTT) is faster than on
a real wide-area path. For the federations measured here (one persistent gRPC stream per
site) that makes the emulated link an optimistic one for large payloads; the accuracy
figures in the report say how close each emulated link came to its configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

CHUNK = 64 * 1024


@dataclass(frozen=True)
class Delay:
    """One-way delay and jitter, in seconds, and the relay's buffer bound per direction."""

    one_way_s: float
    jitter_s: float = 0.0
    max_buffered: int = 8 * 1024 * 1024

    def __post_init__(self):
        if not 0 <= self.jitter_s <= self.one_way_s:
            raise ValueError(f"jitter must be between 0 and the delay; got delay {self.one_way_s} s, "
                             f"jitter {self.jitter_s} s")
        if self.max_buffered < CHUNK:
            raise ValueError(f"max_buffered must be at least one chunk ({CHUNK} bytes)")


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay,
                   rng: random.Random) -> None:
    """Copy ``reader`` to ``writer``, each chunk released ``delay`` after it was read, in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    buffered = 0
    room = asyncio.Event()
    room.set()

    async def release() -> None:
        nonlocal buffered
        while True:
            due, chunk = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:  # end of stream, after everything before it
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()
            buffered -= len(chunk)
            if buffered < delay.max_buffered:
                room.set()

    async def read() -> None:
        nonlocal buffered
        last_due = 0.0
        while True:
            await room.wait()
            chunk = await reader.read(CHUNK)
            jitter = rng.uniform(-delay.jitter_s, delay.jitter_s) if delay.jitter_s else 0.0
            last_due = max(time.monotonic() + delay.one_way_s + jitter, last_due)
            queue.put_nowait((last_due, chunk))
            if not chunk:
                return
            buffered += len(chunk)
            if buffered >= delay.max_buffered:
                room.clear()

    # Both halves finish at end of stream; if either fails (a peer reset), the other stops too.
    tasks = [asyncio.create_task(read()), asyncio.create_task(release())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def serve(listen_host: str, listen_port: int, target_host: str, target_port: int, delay: Delay,
                seed: int = 0) -> asyncio.AbstractServer:
    """Start the relay; connection i's two directions draw jitter from seeds (seed, i, 0/1)."""
    connections = 0

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        index = connections
        connections += 1
        try:
            target_reader, target_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_writer.close()
            return
        up = random.Random(f"{seed}:{index}:up")
        down = random.Random(f"{seed}:{index}:down")
        directions = [asyncio.create_task(_forward(client_reader, target_writer, delay, up)),
                      asyncio.create_task(_forward(target_reader, client_writer, delay, down))]
        try:
            # Either end going away closes both, as a cut link would.
            await asyncio.wait(directions, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in directions:
                task.cancel()
            for writer in (client_writer, target_writer):
                writer.close()

    return await asyncio.start_server(handle, listen_host, listen_port)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.delay_relay", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT the relay accepts on")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT it forwards to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter around the delay")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    delay = Delay(args.delay_ms / 1000, args.jitter_ms / 1000)

    async def run() -> None:
        server = await serve(*args.listen, *args.target, delay, args.seed)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
