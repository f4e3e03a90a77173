"""``dadfl.server.admission`` — admission: a new stream's handshake, from its hello to its link in the step loop.

A site's stream opens with ``hello`` (protocol version, site id, token), checked in this
order: the protocol version, the site id's form (before it reaches a log line or a
message), the message's size, the token against the enrolment (and the client
certificate when ``listen.require_client_cert``), the quarantine list. The site then gets
the run config (:meth:`Admission.run_config`), builds its replica and answers ``ready``
with its model layout's fingerprint and the steps whose strategy state it can restore;
a layout that differs from the server's ends the stream. Nothing is buffered for a site
before it is admitted: the handshake reads exactly two messages, each bounded in size
(``MAX_HANDSHAKE_MESSAGE_BYTES``) and time (``HELLO_TIMEOUT_S``, ``HANDSHAKE_TIMEOUT_S``).
A site that joins a finished run gets the final state and ``finished``.

Joins, refusals and quarantines go to ``run_dir/audit.jsonl`` (``dadfl/audit.py``); any
peer can cause a refused join, so at most ``MAX_REFUSALS_AUDITED_PER_MINUTE`` are recorded
a minute and the rest counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import grpc
from google.protobuf.message import DecodeError

from dadfl.model_identity import line_hashes
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos.channel import PROTOCOL_VERSION
from dadfl.sanitize import REASON_CHARS, one_line, printable

from .certs import check_client_certificate
from .enrol import SITE_ID_PATTERN, SITE_ID_RULE, EnrolmentError, token_hash, verify
from .links import SiteLink

log = logging.getLogger("dadfl.server")

HELLO_TIMEOUT_S = 10.0  # a site says hello as soon as its stream opens
HANDSHAKE_TIMEOUT_S = 120.0  # a site builds its replica between config and ready
MAX_HANDSHAKE_MESSAGE_BYTES = 1024  # hello (site id, token) and ready (a fingerprint) are small
MAX_REFUSALS_AUDITED_PER_MINUTE = 60  # any peer can cause a refused join: the audit trail records this many, then counts
MAX_STATE_STEPS = 8  # a site keeps three saved strategy states; more in its ready message are ignored


class Admission:
    """The handshake part of :class:`~dadfl.server.coordinator.Coordinator`, which holds the
    state these methods use (config, enrolment, quarantine, links, audit log)."""

    def run_config(self) -> cpb.RunConfig:
        c = self.config
        return cpb.RunConfig(
            run_id=self.run_id,
            workload=c.workload.spec,
            workload_options=json.dumps(c.workload.options),
            strategy=c.strategy.name,
            strategy_options=json.dumps(c.strategy.options),
            optimizer=json.dumps(c.optimizer.model_dump()),
            batch_size=c.training.batch_size,
            steps=c.training.steps,
            codec=c.wire.codec,
            layout_fingerprint=self.layout.fingerprint(),
            model_probe=self.replica.model_probe,
            layout_line_hashes=line_hashes(self.layout.lines()),
            chunk_bytes=c.wire.chunk_bytes,
            max_payload_bytes=c.wire.max_payload_bytes,
            eval_every=c.training.eval_every,
            dp=self.privacy.site_config() if self.privacy else "",
            precision=c.training.precision,
        )

    async def _handshake(self, context) -> SiteLink | None:
        """Hello, token (and certificate) check, config, layout check; None when the run is over.

        Nothing is buffered for a site before it is admitted: the handshake reads exactly
        two messages (hello, ready), each bounded in size and time; after it, anything the
        site sends before the server admitted it (state, then step_begin) ends its stream.
        """
        first = await self._read_one(context, "hello", HELLO_TIMEOUT_S)
        hello = first.hello
        if hello.protocol_version != PROTOCOL_VERSION:
            await self._end_stream(
                context, grpc.StatusCode.FAILED_PRECONDITION,
                f"site speaks protocol {hello.protocol_version}, this server {PROTOCOL_VERSION}: run the same dadfl version",
            )
        if not re.fullmatch(SITE_ID_PATTERN, hello.site_id):  # checked before the id reaches a log line or a message
            log.warning("refused a hello from %s: site id %s is not a valid site id", context.peer(), printable(hello.site_id))
            await self._end_stream(context, grpc.StatusCode.INVALID_ARGUMENT, f"the site id must be {SITE_ID_RULE}")
        if first.ByteSize() > MAX_HANDSHAKE_MESSAGE_BYTES:
            await self._end_stream(
                context, grpc.StatusCode.INVALID_ARGUMENT,
                f"hello message of {first.ByteSize()} bytes; at most {MAX_HANDSHAKE_MESSAGE_BYTES} (a token `dadfl enroll` issues has 43 characters)",
            )
        try:
            enrolled = await self.enrolment.for_join()  # both checks see the same reading
            verify(enrolled, hello.site_id, hello.token)
            check_client_certificate(context, enrolled, hello.site_id, self.config.listen.require_client_cert)
        except EnrolmentError as exc:
            log.warning("refused %s from %s: %s", hello.site_id, context.peer(), exc)
            self._audit_refusal(site=hello.site_id, peer=context.peer(), reason=str(exc))
            await self._end_stream(context, grpc.StatusCode.UNAUTHENTICATED if exc.unknown else grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:  # the tokens file was damaged after the server started
            log.error("cannot check the token of site %s: %s", hello.site_id, exc)
            await self._end_stream(context, grpc.StatusCode.UNAVAILABLE, "the server cannot read its tokens file; its operator must fix it")
        try:
            quarantined = self.quarantine.refusal(hello.site_id)
        except ValueError as exc:  # the operator's file is unreadable: admit no one until it is fixed
            log.error("%s", exc)
            quarantined = f"the coordinator cannot read its quarantine list: {exc}"
        if quarantined:
            log.warning("refused %s: quarantined", hello.site_id)
            self._audit_refusal(site=hello.site_id, peer=context.peer(), reason="quarantined")
            await self._end_stream(context, grpc.StatusCode.PERMISSION_DENIED, quarantined)
        await context.write(cpb.ServerMessage(config=self.run_config()))
        # Even when the run is over: the site writes its ready, which must not meet a closed stream.
        ready = (await self._read_one(context, "ready", HANDSHAKE_TIMEOUT_S, hello.site_id)).ready
        if ready.layout_fingerprint != self.layout.fingerprint():
            await self._end_stream(
                context, grpc.StatusCode.FAILED_PRECONDITION,
                f"site {hello.site_id} built model layout {one_line(ready.layout_fingerprint, 64)} but the server has "
                f"{self.layout.fingerprint()}: site and server must run the same dadfl, torch and workload code",
            )
        if self.finished:  # a late site still gets the final model
            await self._tell_finished(context, hello.site_id)
            return None
        link = SiteLink(
            hello.site_id, context.peer(), self.arrivals, max_queued_bytes=self.config.wire.max_payload_bytes,
            sync_per_minute=self.config.federation.sync_per_minute, token_hash=token_hash(hello.token),
        )
        link.state_steps = frozenset(list(ready.strategy_state_steps)[:MAX_STATE_STEPS])
        previous = self.links.get(link.site_id)
        if previous is not None:
            previous.close(grpc.StatusCode.ABORTED, f"site {link.site_id} connected again; this older stream is replaced")
        self.links[link.site_id] = link
        self.changed.set()
        log.info("site %s joined from %s", link.site_id, link.peer)
        self.audit("join", site=link.site_id, peer=link.peer, step=self.step)
        return link

    async def _tell_finished(self, context, site_id: str) -> None:
        """A site that joins a finished run gets the final state and ``finished``, then the stream ends.

        The site counts as told once ``finished`` is handed to the stream, as at the end of the
        run: a site cancels its call as soon as it reads it, and gRPC then cancels this handler,
        which may not have resumed from the write yet."""
        for message in self._state_messages():
            await context.write(message)
        self.told_finished.add(site_id)
        self.changed.set()
        await context.write(cpb.ServerMessage(finished=cpb.Finished(reason=f"run {self.run_id} has finished")))

    async def _read_one(self, context, expected: str, timeout: float, site_id: str | None = None) -> cpb.SiteMessage:
        who = f"site {site_id}" if site_id else f"a stream from {context.peer()}"
        try:
            async with asyncio.timeout(timeout):
                message = await context.read()
        except TimeoutError:
            await self._end_stream(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"no {expected} message within {timeout:.0f} s")
        except DecodeError:
            log.warning("%s sent bytes that are not a dadfl message instead of its %s; refused", who, expected)
            await self._end_stream(context, grpc.StatusCode.INVALID_ARGUMENT, f"expected a {expected} message, got bytes that are not a dadfl message")
        if message is grpc.aio.EOF or message.WhichOneof("kind") != expected:
            got = "end of stream" if message is grpc.aio.EOF else message.WhichOneof("kind") or "an empty message"
            if site_id and message is grpc.aio.EOF:
                log.warning("site %s closed its stream instead of sending %s (it refused the run config or its data: see its log)", site_id, expected)
            elif site_id and got == "leaving":  # after its token check: an unknown peer's words are not logged
                log.warning("site %s leaves instead of sending %s: %s", site_id, expected, one_line(message.leaving.reason, REASON_CHARS))
            await self._end_stream(context, grpc.StatusCode.INVALID_ARGUMENT, f"expected a {expected} message, got {got}")
        if expected != "hello" and message.ByteSize() > MAX_HANDSHAKE_MESSAGE_BYTES:  # a hello: after its site id check
            await self._end_stream(
                context, grpc.StatusCode.INVALID_ARGUMENT,
                f"{expected} message of {message.ByteSize()} bytes; at most {MAX_HANDSHAKE_MESSAGE_BYTES}",
            )
        return message

    def audit(self, event: str, **fields) -> None:
        self.audit_log.append(event, run_id=self.run_id, **fields)

    def _audit_refusal(self, **fields) -> None:
        """A refused join, recorded up to MAX_REFUSALS_AUDITED_PER_MINUTE a minute; the rest counted
        in the next one recorded."""
        started, recorded, skipped = self.refusals_audited
        now = time.monotonic()
        if now - started >= 60:
            started, recorded = now, 0
        if recorded >= MAX_REFUSALS_AUDITED_PER_MINUTE:
            self.refusals_audited = (started, recorded, skipped + 1)
            return
        self.audit("refused", **fields, **({"refusals_not_recorded_before": skipped} if skipped else {}))
        self.refusals_audited = (started, recorded + 1, 0)
