"""One connected site as the coordinator's step loop sees it: an inbox and an outbox.

The gRPC handler of a site's stream (``Coordinator.Join``) reads the site's messages
into ``inbox`` as events and writes whatever the step loop puts into ``outbox``. Every
event also puts its link into ``arrivals``, a queue shared by all links, so the step
loop takes events in the order they arrive with a single wait (rather than one waiting
task per site). The step loop never touches gRPC objects; it closes a link (with a
status and a reason the site will see) to drop a site.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos.codec import Assembled


@dataclass(frozen=True)
class Upload:
    payload: Assembled


@dataclass(frozen=True)
class Done:
    step: int
    attempt: int
    fingerprint: str
    eval: object = None  # the site's EvalReport (unchecked), when it sent one


@dataclass(frozen=True)
class SyncRequest:
    step: int
    fingerprint: str


@dataclass(frozen=True)
class Closed:
    reason: str


Event = Upload | Done | SyncRequest | Closed


@dataclass(frozen=True)
class Close:
    """Outbox item: end the stream with this gRPC status."""

    code: grpc.StatusCode
    reason: str


FINISH = object()  # outbox item: end the stream normally


@dataclass(eq=False)
class SiteLink:
    site_id: str
    peer: str
    arrivals: asyncio.Queue  # shared by every link: this link, once per event it receives
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted: bool = False  # has received the current state and takes part in steps
    closed: bool = False
    wire_up: int = 0  # bytes of every message received / sent, gRPC framing included
    wire_down: int = 0
    state_steps: frozenset[int] = frozenset()  # steps at whose start the site can restore its strategy half

    def deliver(self, event: Event) -> None:
        self.inbox.put_nowait(event)
        self.arrivals.put_nowait(self)

    def send(self, *messages: cpb.ServerMessage) -> None:
        for message in messages:
            self.outbox.put_nowait(message)

    def close(self, code: grpc.StatusCode, reason: str) -> None:
        """Drop the site: its stream ends with ``code`` and ``reason``; the step loop sees Closed."""
        if not self.closed:
            self.closed = True
            self.outbox.put_nowait(Close(code, reason))
            self.deliver(Closed(reason))

    def gone(self, reason: str) -> None:
        """The stream ended from the site's side."""
        if not self.closed:
            self.closed = True
            self.deliver(Closed(reason))
