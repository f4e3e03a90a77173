"""``dadfl.server.streams`` — a site's gRPC stream once the handshake has admitted it: reading, writing, ending.

One bidirectional stream per site (``Join``). A reader task turns the site's messages into
events on its :class:`~dadfl.server.links.SiteLink`: an assembled upload (chunks
reassembled within ``wire.max_payload_bytes``), a ``step_done`` (alone, or riding in the
first chunk of the site's next upload as ``previous_done``), a sync request. The handler
writes what the step loop queued in the link's outbox, in order, until ``FINISH`` or a
``Close``; a message before admission, an unknown kind or bytes that are not a dadfl
message end the stream, and a revoked token is checked once per payload. Every byte each
way is counted on the link for the step's metrics.

A stream ends with a ``closing`` message saying why, then the status
(:meth:`SiteStreams._end_stream`). A site whose weights differ from the server's gets the
blocks of the state that differ, or the full state (:meth:`SiteStreams._resync`); the full
state is encoded once per model version and shared by sync requests and newcomers
while it waits to be written.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import NoReturn

import grpc
from grpc._cython.cygrpc import ExecuteBatchError  # what grpc.aio raises when a batch on a call fails; not re-exported
from google.protobuf.message import DecodeError

from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import PayloadAssembler, WireError, encode_pieces
from dadfl.protos.repair import block_hashes, repair_payload
from dadfl.protos.state import state_payload
from dadfl.sanitize import REASON_CHARS, one_line

from .links import FINISH, GRPC_FRAME_BYTES, Close, Done, Encoded, SiteLink, SyncRequest, Upload

log = logging.getLogger("dadfl.server")

CLOSE_GRACE_S = 1.0  # a closing stream waits this long for the site to read why (SiteStreams._end_stream)
MAX_HANDSHAKES = 64  # streams between hello and admission at once; more wait (RESOURCE_EXHAUSTED, the site retries)


def wire_size(message) -> int:
    return message.ByteSize() + GRPC_FRAME_BYTES


def done_bytes(message: cpb.SiteMessage) -> int:
    """The bytes of the ``previous_done`` a message carries (its field, tag and length included), 0 without one."""
    if not message.HasField("previous_done"):
        return 0
    size = message.previous_done.ByteSize()  # the field's own: no copy into a message of its own
    return 1 + max(1, (size.bit_length() + 6) // 7) + size  # field 6's tag is one byte, its length a varint


def done_event(done: cpb.StepDone) -> Done:
    return Done(done.step, done.attempt, done.fingerprint, done.eval if done.HasField("eval") else None)


class SiteEndedCall(Exception):
    """The site ended its call before the stream's status went out (gRPC's handler then
    finishes the aborted call without a traceback)."""


class SiteStreams:
    """The stream part of :class:`~dadfl.server.coordinator.Coordinator`, which holds the
    state these methods use (config, links, the replica and its encoded state)."""

    async def Join(self, request_iterator, context):
        try:
            await self._join(context)
        except (asyncio.CancelledError, SiteEndedCall):  # nothing left to tell the site: gRPC ends the call
            log.info("a site stream was cancelled: the site ended its call or the server is stopping")

    async def _join(self, context) -> None:
        if self.handshakes >= MAX_HANDSHAKES:
            # Not counted, so no grace period spent reading what it sends: the status at once
            # (the site retries whatever status it sees).
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_HANDSHAKES} sites are joining at once; retry shortly")
        self.handshakes += 1
        try:
            link = await self._handshake(context)
        finally:
            self.handshakes -= 1
            self.changed.set()  # the linger after the last step waits for handshakes under way
        if link is None:
            return
        reader = asyncio.create_task(self._read_site(link, context))
        try:
            while True:
                item = await link.outbox.get()
                if item is FINISH:
                    return
                if isinstance(item, Close):
                    reason = one_line(item.reason)  # reasons may quote what the site sent
                    log.warning("closing site %s: %s", link.site_id, reason)
                    await self._end_stream(context, item.code, reason, reader)
                if not await self._write(link, context, item):
                    continue  # closed while the write waited: the Close is next in the outbox
        finally:
            reader.cancel()
            link.gone("stream ended")
            if self.links.get(link.site_id) is link:
                del self.links[link.site_id]
                self.changed.set()
            log.info("site %s disconnected", link.site_id)

    @staticmethod
    async def _end_stream(context, code: grpc.StatusCode, reason: str, reader: asyncio.Task | None = None) -> NoReturn:
        """End a stream with ``code`` and ``reason``: first a ``closing`` message saying so, then
        the status once the site has ended its side (at most ``CLOSE_GRACE_S``). A grpc.aio
        client whose write fails after the status arrived reports INTERNAL instead of the
        status; a site that read ``closing`` writes nothing more. ``reader``: the task that
        reads the stream, which stops after the next message once its link is closed."""
        deadline = time.monotonic() + CLOSE_GRACE_S
        closing = cpb.ServerMessage(closing=cpb.Closing(code=code.value[0], reason=reason))
        try:
            async with asyncio.timeout(CLOSE_GRACE_S):
                await context.write(closing)
            if reader is not None:
                await asyncio.wait({reader}, timeout=max(deadline - time.monotonic(), 0))
            if reader is None or reader.done():
                await SiteStreams._until_site_ends(context, deadline)
        except (Exception, asyncio.CancelledError):  # the site left, sent garbage or did not read: the status ends it
            pass
        try:
            await context.abort(code, reason)
        except ExecuteBatchError as exc:  # the site ended its call before the status went out
            raise SiteEndedCall from exc

    @staticmethod
    async def _until_site_ends(context, deadline: float) -> None:
        """Read (and drop) what the site sends until it ends its side of the stream or ``deadline``."""
        while (remaining := deadline - time.monotonic()) > 0:
            async with asyncio.timeout(remaining):
                if await context.read() is grpc.aio.EOF:
                    return

    @staticmethod
    async def _write(link: SiteLink, context, message: Encoded) -> bool:
        """Write one message; False when the link was closed while the write waited for a
        site that does not read (``SiteLink.close`` fires the timeout at once)."""
        if link.closed:
            return False
        try:
            async with asyncio.timeout(None) as link.pending_write:
                await context.write(message)
        except TimeoutError:
            return False
        finally:
            link.pending_write = None
        return True

    async def _read_site(self, link: SiteLink, context) -> None:
        assembler = PayloadAssembler(self.config.wire.max_payload_bytes)
        ahead = False  # the payload being received belongs to a later step than the one under way
        try:
            while not link.closed:
                message = await context.read()
                if message is grpc.aio.EOF:
                    link.gone("the site closed its stream")
                    break
                kind = message.WhichOneof("kind")
                if kind == "chunk" and message.chunk.HasField("header"):
                    ahead = message.chunk.header.step > self.step  # an upload that began the next step by itself
                link.count_up(wire_size(message), ahead and kind == "chunk", done_bytes(message))
                if kind == "leaving":  # a departure, not a refusal: dropped at once, not quarantined
                    log.warning("site %s leaves the run: %s", link.site_id, one_line(message.leaving.reason, REASON_CHARS))
                    link.gone("it left the run")
                    break
                if not link.admitted:
                    link.close(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"site {link.site_id} sent a {kind or 'empty'} message before it was admitted "
                        "(a site sends nothing between ready and its first step_begin)",
                    )
                    break
                if kind != "chunk" or message.chunk.HasField("header"):  # once per payload, not per chunk
                    if revoked := await self.enrolment.revocation(link.site_id, link.token_hash):
                        link.close(grpc.StatusCode.PERMISSION_DENIED, revoked)
                        break
                if message.HasField("previous_done"):  # a site that began the next step by itself
                    if kind != "chunk":
                        link.close(grpc.StatusCode.INVALID_ARGUMENT, f"site {link.site_id} sent previous_done with a {kind or 'empty'} message (only with a chunk)")
                        break
                    link.deliver(done_event(message.previous_done))
                    if link.closed:
                        break
                if kind == "chunk":
                    try:
                        assembled = assembler.feed(message.chunk)
                    except WireError as exc:
                        self._refuse(link, f"bad payload from site {link.site_id}: {exc}")
                        break
                    if assembled is not None:
                        link.deliver(Upload(assembled))
                        del assembled  # the step loop's now: not held here until the next payload is complete
                elif kind == "step_done":
                    link.deliver(done_event(message.step_done))
                elif kind == "sync_request":
                    request = message.sync_request
                    if refusal := link.sync_refusal(full=not request.block_hashes):
                        link.close(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
                        break
                    link.deliver(SyncRequest(request.step, request.fingerprint, tuple(request.block_hashes)))
                else:
                    link.close(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind or 'empty'} message after the handshake")
                    break
        except asyncio.CancelledError:
            raise
        except DecodeError:
            link.close(grpc.StatusCode.INVALID_ARGUMENT, f"site {link.site_id} sent bytes that are not a dadfl message")
        except Exception as exc:  # the connection broke under the read
            link.gone(f"connection lost: {exc}")
        finally:
            link.finish()

    def _send(self, link: SiteLink, *messages: Encoded) -> None:
        link.wire_down += sum(m.wire_size() for m in messages)
        link.messages_down += len(messages)
        link.send(*messages)

    def _state_messages(self) -> list[Encoded]:
        """The full state (weights, optimizer), encoded once per model version: sync requests
        and newcomers of one step share it while some outbox still holds it. The cache keeps
        weak references only, so the state's bytes (1.1 GB for the 100M setting with Adam) are
        freed once written to every site that asked, not held through the step."""
        version = (self.step, self.fingerprint)
        cached = self._state_encoded
        messages = [ref() for ref in cached[1]] if cached is not None and cached[0] == version else [None]
        if any(message is None for message in messages):  # not encoded for this version, or partly written and freed
            header, pieces = encode_pieces(  # serialised a chunk at a time: the state's bytes are held once
                state_payload(self.replica, self.step), chunk_bytes=self.config.wire.chunk_bytes, kind=pb.STATE,
                base_fingerprint=self.fingerprint,
            )
            messages = Encoded.chunks(header, pieces)
            self._state_encoded = (version, [weakref.ref(message) for message in messages])
        return messages

    def _resync(self, link: SiteLink, request: SyncRequest) -> None:
        """Send a site whose weights differ the blocks of the state that differ
        (``protos/repair.py``), or the full state when it asks for it or its block list does
        not line up with the server's; count the bytes as the site's repair bytes."""
        version = (self.step, self.fingerprint)
        if self._block_hashes is None or self._block_hashes[0] != version:
            self._block_hashes = (version, block_hashes(self.replica))
        own = self._block_hashes[1]
        repair = repair_payload(self.replica, self.step, list(request.block_hashes), own) if request.block_hashes else None
        if repair is None:
            if request.block_hashes:
                log.warning("site %s sent %d block hashes, the server's state has %d", link.site_id, len(request.block_hashes), len(own))
            messages = self._state_messages()
            link.full_states += 1
        else:
            messages = Encoded.chunks(*encode_pieces(repair, chunk_bytes=self.config.wire.chunk_bytes, kind=pb.REPAIR, base_fingerprint=self.fingerprint))
        nbytes = sum(m.wire_size() for m in messages)
        link.repair_bytes += nbytes
        what = "the full state" if repair is None else f"{len(repair.tensors)} of {len(own)} state blocks"
        log.warning("site %s has weights %s, sending %s (%d bytes)", link.site_id, one_line(request.fingerprint, 12), what, nbytes)
        self._send(link, *messages)
