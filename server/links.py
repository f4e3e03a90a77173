"""``dadfl.server.links`` — one connected site as the coordinator's step loop sees it: an inbox and an outbox, both bounded.

The gRPC handler of a site's stream (``Coordinator.Join``) reads the site's messages
into ``inbox`` as events and writes whatever the step loop puts into ``outbox``. Every
event also puts its link into ``arrivals``, a queue shared by all links, so the step
loop takes events in the order they arrive with a single wait (rather than one waiting
task per site). The step loop never touches gRPC objects; it closes a link (with a
status and a reason the site will see) to drop a site. What it sends is serialised once
(:class:`Encoded`): a broadcast is the same bytes in every site's outbox.

What a site can make the coordinator hold is bounded (a site over a bound is dropped
with RESOURCE_EXHAUSTED and the reason):

- inbox: at most ``MAX_QUEUED_EVENTS`` events and ``max_queued_bytes`` of uploads waiting
  for the step loop (an honest site has at most one upload waiting);
- outbox: a site may lag at most one round behind in reading what the server sends: when
  a round starts (a ``step_begin``, or a phase message that lets the next step follow by
  itself), nothing queued before the previous round's start may still be waiting (an
  honest site has read it all before it could answer that round);
- state resends: per step (per ``step_begin``) one block repair then one full state at most,
  and ``sync_per_minute`` requests per minute; a block hash list at most as long as the
  server's own (``protos/repair.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos.codec import Assembled, fill_chunk

MAX_QUEUED_EVENTS = 16
SYNC_WINDOW_S = 60.0


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
    block_hashes: tuple[int, ...] = ()  # empty: the full state


@dataclass(frozen=True)
class Closed:
    reason: str


Event = Upload | Done | SyncRequest | Closed


GRPC_FRAME_BYTES = 5  # length prefix of every gRPC message


@dataclass(frozen=True)
class Encoded:
    """A server message serialised once; the stream writes these bytes as they are."""

    data: bytes
    starts_round: bool  # a step_begin, or a phase message after which the next step may follow by itself

    @classmethod
    def of(cls, message: cpb.ServerMessage) -> "Encoded":
        return cls(message.SerializeToString(), message.WhichOneof("kind") == "step_begin" or message.HasField("next"))

    @classmethod
    def chunks(cls, header, pieces, going_next: cpb.StepNext | None = None) -> list["Encoded"]:
        """The chunk messages of ``codec.encode_pieces``, each piece written into its message (a
        chunk made apart is copied again into a message made with it: about 2 ms per MiB); the
        first carries ``going_next``."""
        encoded = []
        for piece in pieces:
            message = cpb.ServerMessage()
            fill_chunk(message.chunk, header, *piece)
            if going_next is not None and not encoded:
                message.next.CopyFrom(going_next)
            encoded.append(cls.of(message))
        return encoded

    def wire_size(self) -> int:
        return len(self.data) + GRPC_FRAME_BYTES


def serialize_response(message: Encoded | cpb.ServerMessage) -> bytes:
    """The response serialiser of the Join stream: encoded messages go out as they are."""
    return message.data if isinstance(message, Encoded) else message.SerializeToString()


@dataclass(frozen=True)
class Close:
    """Outbox item: end the stream with this gRPC status."""

    code: grpc.StatusCode
    reason: str


FINISH = object()  # outbox item: end the stream normally


class Inbox:
    """A site's events waiting for the step loop (``empty``/``get_nowait`` as an asyncio.Queue)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.events: deque[Event] = deque()
        self.upload_bytes = 0

    def empty(self) -> bool:
        return not self.events

    def get_nowait(self) -> Event:
        event = self.events.popleft()
        if isinstance(event, Upload):
            self.upload_bytes -= event.payload.header.total_bytes
        return event

    def overflow(self, event: Event) -> str | None:
        """Why ``event`` would exceed the bounds, or None."""
        if len(self.events) >= MAX_QUEUED_EVENTS:
            return f"{len(self.events)} messages are already waiting for the step loop (at most {MAX_QUEUED_EVENTS})"
        if isinstance(event, Upload) and self.upload_bytes + event.payload.header.total_bytes > self.max_bytes:
            return (
                f"{self.upload_bytes + event.payload.header.total_bytes} bytes of uploads would wait for the step loop "
                f"(at most {self.max_bytes}, wire.max_payload_bytes)"
            )
        return None

    def put(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Upload):
            self.upload_bytes += event.payload.header.total_bytes


class Outbox:
    """What the server sends a site, tagged with the number of round starts queued before it."""

    def __init__(self):
        self.items: deque[tuple[int, object]] = deque()
        self.ready = asyncio.Event()
        self.steps = 0  # round starts queued so far (Encoded.starts_round)

    def put(self, item) -> None:
        if isinstance(item, Encoded) and item.starts_round:
            self.steps += 1
        self.items.append((self.steps, item))
        self.ready.set()

    def put_first(self, item) -> None:
        """Drop what is still queued and send ``item`` next (a closing status)."""
        self.items.clear()
        self.items.append((self.steps, item))
        self.ready.set()

    def lagging(self) -> bool:
        """Whether something queued before the previous round's start is still waiting."""
        return bool(self.items) and self.items[0][0] < self.steps - 1

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()[1]


@dataclass(eq=False)
class SiteLink:
    site_id: str
    peer: str
    arrivals: asyncio.Queue  # shared by every link: this link, once per event it receives
    max_queued_bytes: int = 1 << 30
    sync_per_minute: int = 60
    token_hash: str = ""  # the enrolment it joined with: a revoked or re-enrolled site is dropped
    inbox: Inbox = field(init=False)
    outbox: Outbox = field(default_factory=Outbox)
    admitted: bool = False  # has received the current state and takes part in steps
    closed: bool = False
    pending_write: asyncio.Timeout | None = None  # a write under way; closing fires it, so a site that does not read is dropped
    wire_up: int = 0  # bytes of every message received / sent in this step, gRPC framing included (count_up)
    wire_down: int = 0
    messages_up: int = 0  # gRPC messages received / sent in this step
    messages_down: int = 0
    stale_step: int | None = None  # its first upload for (this step, attempt 0) went ahead and is dropped
    ahead_up: tuple[int, int] = (0, 0)  # (bytes, messages) of uploads for the next step, which began by itself
    state_steps: frozenset[int] = frozenset()  # steps at whose start the site can restore its strategy half
    sync_step: int = -1  # outbox.steps when the state was last resent
    sync_full: bool = False  # whether that resend was the full state
    repair_bytes: int = 0  # bytes of repairs and full states sent in this step because the weights differed
    full_states: int = 0  # full states among them
    sync_times: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.inbox = Inbox(self.max_queued_bytes)

    def count_up(self, nbytes: int, next_step: bool, done_bytes: int = 0) -> None:
        """A message received: this step's traffic, or the next step's when it is that step's
        upload. A next step's first chunk carries this step's done (``previous_done``): the done's
        ``done_bytes`` are this step's, the rest of the message (and its framing) the next step's."""
        if next_step:
            self.wire_up += done_bytes
            self.ahead_up = (self.ahead_up[0] + nbytes - done_bytes, self.ahead_up[1] + 1)
        else:
            self.wire_up += nbytes
            self.messages_up += 1

    def next_step_counts(self) -> None:
        """The step was committed: count from zero, with what already arrived for the next one."""
        (self.wire_up, self.messages_up), self.ahead_up = self.ahead_up, (0, 0)
        self.wire_down = self.messages_down = 0
        self.repair_bytes = self.full_states = 0

    def deliver(self, event: Event) -> None:
        if not isinstance(event, Closed) and (reason := self.inbox.overflow(event)):
            self.close(grpc.StatusCode.RESOURCE_EXHAUSTED, f"site {self.site_id} sent too much ahead of the server: {reason}")
            return
        self.inbox.put(event)
        self.arrivals.put_nowait(self)

    def send(self, *messages: Encoded | cpb.ServerMessage) -> None:
        if self.closed:
            return
        for message in messages:
            self.outbox.put(message if isinstance(message, Encoded) else Encoded.of(message))
        if self.outbox.lagging():
            self.close(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"site {self.site_id} is more than one step behind in reading what the server sends",
            )

    def sync_refusal(self, full: bool) -> str | None:
        """Why a state resend asked for now (``full``: the full state, else a block repair) is
        refused (None: resend it); records the resend."""
        if self.sync_step == self.outbox.steps and (self.sync_full or not full):
            return f"site {self.site_id} asked for the state again within one step (a block repair, then the full state, per step)"
        now = time.monotonic()
        while self.sync_times and now - self.sync_times[0] > SYNC_WINDOW_S:
            self.sync_times.popleft()
        if len(self.sync_times) >= self.sync_per_minute:
            return f"site {self.site_id} asked for the state more than {self.sync_per_minute} times in a minute (federation.sync_per_minute)"
        self.sync_step, self.sync_full = self.outbox.steps, full
        self.sync_times.append(now)
        return None

    def finish(self) -> None:
        """End the stream normally once everything queued is sent."""
        self.outbox.put(FINISH)

    def close(self, code: grpc.StatusCode, reason: str) -> None:
        """Drop the site: its stream ends with ``code`` and ``reason``; the step loop sees Closed."""
        if not self.closed:
            self.closed = True
            self.outbox.put_first(Close(code, reason))
            if self.pending_write is not None:
                self.pending_write.reschedule(0)  # a deadline in the past: the write stops now
            self.deliver(Closed(reason))

    def gone(self, reason: str) -> None:
        """The stream ended from the site's side."""
        if not self.closed:
            self.closed = True
            self.deliver(Closed(reason))
