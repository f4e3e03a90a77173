"""The coordinator: enrolment checks, the step loop over connected sites, checkpoints, metrics.

One gRPC bidirectional stream per site (``Join``); the step loop (:meth:`Coordinator.run`)
drives the strategy's server half over the sites that are connected, in site-id order:

1. wait for a quorum (``min_sites``; ``initial_sites`` before the first step), send the
   current state (weights + optimizer state) to sites that joined since the last step;
2. ``step_begin`` to every participant that did not begin the step by itself (below),
   then per phase: collect every participant's upload in the order they arrive
   (``phase_timeout_s``), check each as it comes (protocol, including the weights
   fingerprint it was computed from), then all together with the strategy's rules and
   the influence bound; aggregate, decode the message as every site will, serialise it
   once and send the same bytes to all;
3. once every participant has reported ``step_done`` (it has applied the update and
   saved its strategy state) the step is committed: the server applies the same update,
   logs metrics, evaluates and checkpoints on schedule.
   On evaluation steps each site's ``step_done`` carries its evaluation of the updated
   model on its own held-out data (checked and combined in ``evaluation.py``); a
   coordinator-side test set (the workload's ``test`` split) is optional.

One round trip per step (per phase for multi-phase strategies): every phase message of
step t but the last step's carries ``next`` (the checkpoint step the sites should keep).
A site that applies step t then begins step t + 1 at once (attempt 0, from its own
weights) and sends the ``step_done`` of t inside the first message of that upload. So
the ``step_done`` round of t and phase 0 of t + 1 are the same messages; the server
commits t when every done is in and takes the uploads already queued as step t + 1 for
the participants of t (``going_on``). A newcomer gets a ``step_begin``; so do, still at
attempt 0, every site when the strategy state resets and a site whose weights differed
after t (what they sent ahead began from the wrong halves or weights): the first upload
of that step from such a site is dropped, it computes the step again (``stale_step``).
Uploads that went ahead for a step that then aborted are dropped too (``_answer``). The
last step's done is sent on its own.

At the end the run folder gets ``summary.json`` and the plots ``dadfl sim`` writes.
The operator's stop (:meth:`Coordinator.request_stop`: SIGTERM, Ctrl-C, ``dadfl stop``)
is taken where the loop waits for a quorum, i.e. once the step under way has committed or
aborted: the committed steps are checkpointed and every site is told why its stream ends.
Joins, refusals, quarantines and the run's start, end or stop go to ``run_dir/audit.jsonl``
(``dadfl/audit.py``).

Dropouts: a site lost during phase 0 is left out and the step completes with the rest
(the server half divides by the samples that arrived) if the quorum holds. A site lost
after phase 0 of a multi-phase strategy, or a lost quorum, aborts the step: no replica
has applied anything yet, so the step simply restarts (next ``attempt``) once a quorum
is connected again. A site lost after the last phase but before its ``step_done`` also
aborts the step: sites that already applied it (and began the next step by themselves)
get ``step_abort`` and an explicit ``step_begin``; their weights differ from the step's
start, so they fetch the server's state again, and they restore their strategy state at
the step's start (a site keeps it until the next message proves the step committed).
With one round trip, a site lost between two steps is lost before its done: the step
before aborts rather than the next one going on without it. A site that reconnects
receives the current state before its next step. A site that stops taking part (its
privacy budget refuses an upload, it fails) says so: it sends the done it owes, then
``leaving`` with its reason, which is logged on one bounded line; it is lost at once
rather than at ``phase_timeout_s``, and a departure is not a refusal.

Refusals (README "Trust"): a site whose upload fails a check, whose contribution is out
of bounds, or whose upload alone breaks the aggregated message is dropped like a lost
site; aborts it causes do not count towards ``MAX_ATTEMPTS_PER_STEP``, and after
``quarantine_after`` refusals it is quarantined (``quarantine.py``). A non-finite value
the model produced is nobody's refusal: when most uploads of a phase are non-finite
(``screening.model_fault``), or the weights would be after the update, the step is refused
as a whole, nothing is committed, no site is refused, and the run stops with one line
(``ModelNotFinite``): retrying the same step on the same weights would give the same.

Strategy state across steps (PowerSGD error feedback and warm start, rank-dAD warm
start and memories) lives in the strategy's halves and is restored, never silently lost:
the server checkpoints its half's state with the step; every site saves its half's state
after each step and says in ``ready`` which steps it can restore; ``step_begin`` names
the step (and the checkpoint step, the oldest one the server may replay from), and a
site whose half is elsewhere restores its saved state at that step. An aborted attempt
restores every half to the step's start. So a coordinator killed and restarted from its
checkpoint, or a site killed and rejoining, ends with exactly the model of an
uninterrupted run (with the same participants). Only when some participant cannot
restore the step's state (a site that missed steps, joined mid-run or lost its state
dir) does every replica rebuild its halves (``reset_strategy_state``, logged once):
the state of every participant must describe the same federation. That costs one step
without warm start or error feedback; exactness is unaffected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from dadfl.audit import FILE as AUDIT_FILE
from dadfl.audit import AuditLog
from dadfl.metrics import MetricsWriter, is_eval_step, read_metrics, run_summary, write_summary
from dadfl.model_identity import line_hashes
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.channel import PROTOCOL_VERSION
from dadfl.protos.codec import PayloadAssembler, WireError, codec_id, encode_chunks, encode_payload
from dadfl.protos.repair import block_hashes, repair_payload
from dadfl.protos.state import state_payload
from dadfl.sanitize import REASON_CHARS, one_line, printable
from dadfl.strategies import weights_fingerprint

from . import checkpoint
from .config import ServerConfig
from .certs import check_client_certificate
from .enrol import SITE_ID_PATTERN, SITE_ID_RULE, Enrolment, EnrolmentError, token_hash, verify
from .evaluation import EvalRejected, SiteEval, check_report, combine
from .links import FINISH, GRPC_FRAME_BYTES, Close, Closed, Done, Encoded, SiteLink, SyncRequest, Upload
from .preflight import build_replica
from .privacy import ServerPrivacy, split_state
from .progress import OperatorView
from .quarantine import Quarantine
from .screening import WEIGHTS_NOT_FINITE, Screening, model_fault, model_fault_reason, nonfinite_reason, weights_finite
from .validate import PayloadError, check_protocol

log = logging.getLogger("dadfl.server")

CLOSE_GRACE_S = 1.0  # a closing stream waits this long for the site to read why (Coordinator._end_stream)
HELLO_TIMEOUT_S = 10.0  # a site says hello as soon as its stream opens
HANDSHAKE_TIMEOUT_S = 120.0  # a site builds its replica between config and ready
MAX_HANDSHAKES = 64  # streams between hello and admission at once; more wait (RESOURCE_EXHAUSTED, the site retries)
MAX_HANDSHAKE_MESSAGE_BYTES = 1024  # hello (site id, token) and ready (a fingerprint) are small
MAX_ATTEMPTS_PER_STEP = 5
MAX_REFUSALS_AUDITED_PER_MINUTE = 60  # any peer can cause a refused join: the audit trail records this many, then counts
MAX_STATE_STEPS = 8  # a site keeps three saved strategy states; more in its ready message are ignored
INLINE_BYTES = 1 << 20  # smaller work runs on the event loop: a hop to a worker thread costs more
SKIP = object()  # an event that does not answer the current round


class RunStopped(RuntimeError):
    """The run cannot go on (no quorum in time, a step failing again and again)."""


class ModelNotFinite(RunStopped):
    """The model produced non-finite values (its weights, or most sites' uploads computed on
    it): the step was refused as a whole and no site was blamed."""


class StoppedByOperator(Exception):
    """The operator stopped the run (SIGTERM, Ctrl-C, ``dadfl stop``): the step under way
    finished or aborted, the committed steps are checkpointed, the sites were told."""


class StopRequested(Exception):
    """Raised where the step loop waits, once the operator asked to stop."""


def wire_size(message) -> int:
    return message.ByteSize() + GRPC_FRAME_BYTES


def done_bytes(message: cpb.SiteMessage) -> int:
    """The bytes of the ``previous_done`` a message carries (its field, tag and length included), 0 without one."""
    return cpb.SiteMessage(previous_done=message.previous_done).ByteSize() if message.HasField("previous_done") else 0


def done_event(done: cpb.StepDone) -> Done:
    return Done(done.step, done.attempt, done.fingerprint, done.eval if done.HasField("eval") else None)


def strategy_label(name: str, options: dict, label: str = "") -> str:
    """The strategy's name in metrics, as the in-process simulation writes it."""
    if label:
        return label
    suffix = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{name}({suffix})" if suffix else name


@dataclass
class StepResult:
    participants: list[SiteLink]
    messages: list
    samples: int
    loss_sum: float
    bytes_up: int
    bytes_down: int
    phase_seconds: list[float]
    site_fingerprints: dict[str, str]
    fingerprint: str  # the server's weights after applying the step
    site_evals: dict  # site id -> its EvalReport (unchecked), on evaluation steps
    said_next: bool  # the step's last message carried `next`: every participant began the next step


class Coordinator(cpb_grpc.CoordinatorServicer):
    def __init__(self, config: ServerConfig):
        self.config = config
        self.replica = build_replica(config)
        workload, self.strategy = self.replica.workload, self.replica.strategy
        self.eval_metrics = ("loss", workload.metric_name)
        self.label = strategy_label(config.strategy.name, config.strategy.options, config.strategy.label)
        self.layout = self.replica.layout
        self.codec = codec_id(config.wire.codec)
        federation = config.federation
        # Under [dp] the robust weights are off: they depend on every site's data, so one record
        # could move a whole site's weight and the noise is calibrated on per-sample clipping only.
        private = config.dp is not None
        self.screening = Screening(
            self.replica, federation.max_influence_ratio, federation.max_update_norm, self.codec,
            None if private else federation.clip_ratio, federation.agreement and not private,
        )
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.quarantine = Quarantine(self.run_dir, config.federation.quarantine_after)
        self.audit_log = AuditLog(self.run_dir / AUDIT_FILE)  # joins, refusals, quarantines, the operator's stop
        self.refusals_audited = (0.0, 0, 0)  # (minute started, refusals recorded in it, refusals not recorded)
        self.step_refusals: set[str] = set()  # sites refused during the step under way
        self.identity = {
            "workload": [config.workload.spec, config.workload.options],
            "strategy": [config.strategy.name, config.strategy.options],
            "optimizer": config.optimizer.model_dump(),
            # only when set: checkpoints written before precision existed stay resumable
            **({"precision": config.training.precision} if config.training.precision != "fp32" else {}),
        }
        self.privacy = None  # [dp]: the noisy dense downlink replaces the strategy's message (privacy.py)
        if config.dp is not None:
            self.identity["dp"] = config.dp.model_dump()
            self.privacy = ServerPrivacy(
                config.dp, config.training.batch_size, config.training.steps, self.replica.model, workload.example(), self.run_dir,
            )
        resumed = checkpoint.resume(self.run_dir, self.replica, self.identity)
        if resumed and self.privacy is not None:
            strategy_state, privacy_state = split_state(resumed.strategy_state or {})
            self.privacy.load_state_dict(privacy_state)
            resumed = checkpoint.Resumed(resumed.next_step, resumed.run_id, strategy_state if resumed.strategy_state is not None else None)
        self.step = resumed.next_step if resumed else 0
        self.checkpoint_step = self.step  # the step a restart would replay from
        self.run_id = resumed.run_id if resumed else uuid.uuid4().hex[:12]
        if resumed:
            log.info("resuming run %s at step %d from %s", self.run_id, self.step, self.run_dir / checkpoint.CHECKPOINT)
        checkpoint.trim_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.fingerprint = weights_fingerprint(self.replica.model)
        self.links: dict[str, SiteLink] = {}
        self.arrivals: asyncio.Queue = asyncio.Queue()  # links with a new event, shared by all (see links.py)
        self.changed = asyncio.Event()
        self.stop_requested = False  # request_stop(): the loop stops before the next step or attempt
        self.finished = False
        self.known_sites: set[str] = set()  # every site that took part in this server's run
        self.told_finished: set[str] = set()
        self.handshakes = 0  # streams between hello and admission (or the finished answer)
        self.enrolment = Enrolment(Path(config.listen.tokens))
        self.server_half = self.strategy.server(self.layout, self.replica.model)
        self.reset_reason = ""  # set when the server half could not be restored: reset everywhere
        if resumed and resumed.strategy_state is None:
            self.reset_reason = "the checkpoint holds no strategy state"
        elif resumed:
            try:
                self.server_half.load_state_dict(resumed.strategy_state)
            except (KeyError, ValueError) as exc:
                self.reset_reason = f"the checkpoint's strategy state does not load ({exc})"
        self.half_at_step_start = self.server_half.state_dict()  # restored after an aborted attempt
        self.went_ahead: set[SiteLink] = set()  # participants that began the next step by themselves
        self._state_encoded: tuple[tuple[int, str], list[Encoded]] | None = None  # _state_messages
        self._block_hashes: tuple[tuple[int, str], list[int]] | None = None  # _resync
        self.going_on: set[SiteLink] = set()  # those of them whose uploads the next step takes
        self.view = OperatorView(  # made here: a missing TensorBoard stops the server before it listens
            config.training.steps, self.step, workload.metric_name, config.training.progress_every_s,
            self.run_dir, config.training.tensorboard,
        )

    # ------------------------------------------------------------------ the site streams

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

    async def Join(self, request_iterator, context):
        try:
            await self._join(context)
        except asyncio.CancelledError:  # the site cancelled its call, or the server is stopping: nothing to report
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
                await Coordinator._until_site_ends(context, deadline)
        except (Exception, asyncio.CancelledError):  # the site left, sent garbage or did not read: the status ends it
            pass
        await context.abort(code, reason)

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
        and newcomers of one step share it; the step's end drops it."""
        version = (self.step, self.fingerprint)
        if self._state_encoded is None or self._state_encoded[0] != version:
            _, chunks = encode_chunks(  # serialised a chunk at a time: the state's bytes are held once
                state_payload(self.replica, self.step), chunk_bytes=self.config.wire.chunk_bytes, kind=pb.STATE,
                base_fingerprint=self.fingerprint,
            )
            self._state_encoded = (version, [Encoded.of(cpb.ServerMessage(chunk=c)) for c in chunks])
        return self._state_encoded[1]

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
            chunks = encode_payload(repair, chunk_bytes=self.config.wire.chunk_bytes, kind=pb.REPAIR, base_fingerprint=self.fingerprint)
            messages = [Encoded.of(cpb.ServerMessage(chunk=c)) for c in chunks]
        nbytes = sum(m.wire_size() for m in messages)
        link.repair_bytes += nbytes
        what = "the full state" if repair is None else f"{len(repair.tensors)} of {len(own)} state blocks"
        log.warning("site %s has weights %s, sending %s (%d bytes)", link.site_id, one_line(request.fingerprint, 12), what, nbytes)
        self._send(link, *messages)

    # ------------------------------------------------------------------ the step loop

    async def run(self) -> None:
        """Train until ``training.steps``; checkpoint and write the final model."""
        steps = self.config.training.steps
        finished_at_start = self.step >= steps
        first = True
        self.audit("run", action="resumed" if self.step else "started", step=self.step, steps=steps,
                   workload=self.config.workload.spec, strategy=self.label, dp=self.config.dp is not None)
        with MetricsWriter(self.run_dir / "metrics.jsonl") as metrics, self.view:
            while self.step < steps:
                if self.privacy and (reason := self.privacy.stop_reason()):
                    log.info("run %s stops after %d steps: %s", self.run_id, self.step, reason)
                    steps = self.step
                    break
                attempt, failures = 0, 0
                going_on, went_ahead = self.going_on, self.went_ahead
                self.going_on, self.went_ahead = set(), set()
                while True:
                    if attempt and self.privacy and (reason := self.privacy.stop_reason()):  # the aborted attempt's release counted
                        raise RunStopped(f"step {self.step} cannot be retried: {reason}")
                    need = (self.config.federation.initial_sites or self.config.federation.min_sites) if first else self.config.federation.min_sites
                    try:
                        participants = await self._quorum(need)
                    except StopRequested:
                        await self._stop()
                    started = time.perf_counter()
                    self.step_refusals = set()
                    reset = self._strategy_state_reset(participants)
                    if reset:  # what went ahead began from the halves before the reset
                        going_on = set()
                    result = await self._run_step(participants, attempt, reset, going_on, went_ahead)
                    if result is not None:
                        break
                    attempt, going_on, went_ahead = attempt + 1, set(), set()  # what went ahead answers attempt 0
                    # An abort caused by a refused site is that site's doing: it is dropped
                    # (and quarantined when it persists); only the others can stop the run.
                    if not self.step_refusals:
                        failures += 1
                        if failures >= MAX_ATTEMPTS_PER_STEP:
                            raise RunStopped(f"step {self.step} failed {failures} times in a row; see the log above")
                first = False
                self.view.step(await self._finish_step(result, attempt, started, metrics))
        self.finished = True
        checkpoint.save_final_model(self.run_dir, self.replica)
        for link in list(self.links.values()):
            if not link.admitted:  # joined during the last step: send it the final model
                self._send(link, *self._state_messages())
            self._send(link, Encoded.of(cpb.ServerMessage(finished=cpb.Finished(reason=f"run {self.run_id} finished after {steps} steps"))))
            link.finish()
            self.told_finished.add(link.site_id)
        log.info("run %s finished: %d steps, model in %s", self.run_id, steps, self.run_dir / checkpoint.FINAL_MODEL)
        self.view.finished(steps)
        self.audit("run", action="finished", steps=steps)
        await asyncio.to_thread(self._write_report)  # the sites already know the run is over
        await self._linger(finished_at_start)

    async def _linger(self, finished_at_start: bool) -> None:
        """Keep listening ``linger_s`` for sites that have not heard that the run finished.

        Those are the sites that took part and were disconnected at the end, or, when the
        server started on an already finished run (a second ``docker compose up``), every
        enrolled site. A site that joins meanwhile gets the final state and ``finished``
        and stops; handshakes under way are waited for. Then the server stops listening.
        """
        expected = set(await self.enrolment.site_ids()) if finished_at_start else self.known_sites
        deadline = time.monotonic() + self.config.federation.linger_s
        while ((missing := expected - self.told_finished) or self.handshakes) and (remaining := deadline - time.monotonic()) > 0:
            self.changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self.changed.wait()
            except TimeoutError:
                if missing:
                    log.warning("%s did not reconnect after the run finished", ", ".join(sorted(missing)))

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

    def request_stop(self) -> None:
        """The operator's stop: the step under way finishes or aborts (bounded by
        ``phase_timeout_s``), then :meth:`run` checkpoints, tells the sites and raises
        :class:`StoppedByOperator`."""
        self.stop_requested = True
        self.changed.set()

    async def _stop(self) -> NoReturn:
        """Checkpoint the committed steps, tell every connected site why its stream ends."""
        if self.step > self.checkpoint_step:
            await asyncio.to_thread(self._save_checkpoint)
        reason = (
            f"the coordinator's operator stopped run {self.run_id} after {self.step} of {self.config.training.steps} steps; "
            "it resumes from its checkpoint when the coordinator starts again"
        )
        for link in list(self.links.values()):
            link.close(grpc.StatusCode.UNAVAILABLE, reason)
        self.view.stopped(self.step)
        self.audit("run", action="stopped by the operator", step=self.step, checkpoint_step=self.checkpoint_step)
        saved = self.run_dir / checkpoint.CHECKPOINT
        kept = f"checkpoint at step {self.checkpoint_step} in {saved}" if saved.exists() else "no step was committed, so no checkpoint"
        raise StoppedByOperator(
            f"run {self.run_id} stopped by the operator after {self.step} of {self.config.training.steps} steps; "
            f"{kept}; start the server again to resume"
        )

    async def _quorum(self, need: int) -> list[SiteLink]:
        """Wait for ``need`` connected sites; send the current state to new ones."""
        timeout = self.config.federation.quorum_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if self.stop_requested:
                raise StopRequested
            self.changed.clear()
            live = sorted((link for link in self.links.values() if not link.closed), key=lambda link: link.site_id)
            if len(live) >= need:
                break
            self.view.waiting(len(live), need)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(link.site_id for link in live) or "none"
                raise RunStopped(f"only {len(live)} of the {need} sites needed were connected after {timeout:.0f} s (connected: {names})")
            try:
                async with asyncio.timeout(remaining):
                    await self.changed.wait()
            except TimeoutError:
                pass
        newcomers = [link for link in live if not link.admitted]
        if newcomers:
            state = self._state_messages()
            for link in newcomers:
                self._send(link, *state)
                link.admitted = True
                self.known_sites.add(link.site_id)
        return live

    async def _run_step(
        self, participants: list[SiteLink], attempt: int, reset: bool, going_on: set[SiteLink], went_ahead: set[SiteLink],
    ) -> StepResult | None:
        """All phases of one step; None when it was aborted (the server applied nothing).

        ``went_ahead``: the sites that began this step by themselves (attempt 0) when they
        applied the last one; ``going_on``: those of them whose uploads it takes. The other
        participants get a ``step_begin``; a site that went ahead but gets one has its
        upload that went ahead dropped (``SiteLink.stale_step``)."""
        step, min_sites = self.step, self.config.federation.min_sites
        begin = Encoded.of(cpb.ServerMessage(step_begin=cpb.StepBegin(
            step=step, fingerprint=self.fingerprint, reset_strategy_state=reset, attempt=attempt,
            checkpoint_step=self.checkpoint_step,
        )))
        for link in participants:
            if link not in going_on:
                link.stale_step = step if link in went_ahead else None
                self._send(link, begin)
        last = step + 1 == self.config.training.steps or (  # or [dp]'s last release: no site trains a step that never comes
            self.privacy is not None and self.privacy.releases + 1 >= self.privacy.max_releases)
        # The last step: sites report it done on its own.
        going_next = None if last else cpb.StepNext(checkpoint_step=step + 1 if self._checkpoints_after(step) else self.checkpoint_step)
        active, messages, phase_seconds = participants, [], []
        samples, loss_sum, bytes_up, bytes_down = 0, 0.0, 0, 0
        update: dict = {}  # decoded from the messages so far, checked before each was sent
        phase = 0
        while True:
            started = time.perf_counter()
            events = {}
            async for link, event in self._answers(active, step, attempt, phase):
                events[link] = event
            uploads = [(link, e.payload) for link, e in events.items() if isinstance(e, Upload)]
            lost = [link.site_id for link, e in events.items() if e is None]
            dones = {link.site_id: e.fingerprint for link, e in events.items() if isinstance(e, Done)}
            site_evals = {link.site_id: e.eval for link, e in events.items() if isinstance(e, Done) and e.eval is not None}
            if dones:
                for link, _ in uploads:
                    link.close(grpc.StatusCode.INVALID_ARGUMENT, f"site {link.site_id} sent a phase {phase} payload after the last phase of step {step}")
                if len(dones) < len(active):
                    # Committing now would leave the others without their strategy state at the next
                    # step: every replica returns to the step's start (sites that applied resync).
                    missing = sorted({link.site_id for link in active} - set(dones))
                    return self._abort(active, step, attempt, f"{', '.join(missing)} left before reporting step {step} done")
                fingerprint = await self._off_loop(sum(m.nbytes() for m in messages), self.replica.apply_update, update)
                if not await self._off_loop(sum(m.nbytes() for m in messages), weights_finite, self.replica.model):
                    # never committed: the last checkpoint stays the last good state
                    self._stop_for_model(active, step, attempt, f"step {step}: {WEIGHTS_NOT_FINITE}")
                return StepResult(
                    active, messages, samples, loss_sum, bytes_up, bytes_down, phase_seconds, dones, fingerprint, site_evals,
                    said_next=going_next is not None,
                )
            if lost and phase > 0:
                return self._abort(active, step, attempt, f"{', '.join(lost)} left after phase 0, which already counted them")
            if len(uploads) < min_sites:
                return self._abort(active, step, attempt, f"only {len(uploads)} of the {min_sites} sites needed sent phase {phase}")
            uploads.sort(key=lambda upload: upload[0].site_id)  # the server half sees sites in site-id order
            nonfinite = await self._off_loop(sum(u.payload.nbytes() for _, u in uploads), lambda: {
                index: reason for index, (_, u) in enumerate(uploads) if (reason := nonfinite_reason(u.header.loss_sum, u.payload))})
            if model_fault(len(nonfinite), len(uploads)):
                finite = await asyncio.to_thread(weights_finite, self.replica.model)
                self._stop_for_model(active, step, attempt, model_fault_reason(step, phase, list(nonfinite.values()), len(uploads), finite))
            screened = await self._screen(uploads, step, phase, messages, nonfinite)
            if isinstance(screened, str):
                return self._abort(active, step, attempt, screened)
            if len(screened) < len(uploads) and phase > 0:
                refused = sorted({link.site_id for link, _ in uploads} - {link.site_id for link, _ in screened})
                return self._abort(active, step, attempt, f"{', '.join(refused)} refused after phase 0, which already counted them")
            uploads = screened
            if len(uploads) < min_sites:
                return self._abort(active, step, attempt, f"only {len(uploads)} of the {min_sites} sites needed sent an acceptable phase {phase}")
            aggregated = await self._aggregate(uploads, step, phase, messages)
            if isinstance(aggregated, str):
                return self._abort(active, step, attempt, aggregated)
            uploads, message, sent, update = aggregated
            if self.privacy:  # sites receive only the noisy dense update, never the strategy's message
                # in a thread: a model-sized draw and the release count's fsync would stall every stream
                message, sent, update = await asyncio.to_thread(
                    self.privacy.release,
                    self.layout, update, sum(u.payload.num_samples for _, u in uploads), len(uploads), step, self.codec,
                )
            active = [link for link, _ in uploads]
            bytes_up += sum(u.header.total_bytes for _, u in uploads)
            if phase == 0:
                samples = sum(u.payload.num_samples for _, u in uploads)
                loss_sum = sum(u.header.loss_sum for _, u in uploads)
            header, chunks = encode_chunks(message, self.codec, self.config.wire.chunk_bytes, kind=pb.PHASE, attempt=attempt)
            messages.append(sent)  # what every site decodes
            # Serialised once for every site, a chunk at a time (the message's bytes are held
            # once). Every phase's message says that the next step follows by itself: only the
            # site's half knows which phase is its last.
            wire = [Encoded.of(cpb.ServerMessage(chunk=chunk, next=going_next if i == 0 else None)) for i, chunk in enumerate(chunks)]
            for link in active:
                self._send(link, *wire)
            bytes_down += header.total_bytes * len(active)
            phase_seconds.append(time.perf_counter() - started)
            phase += 1

    def _refuse(self, link: SiteLink, reason: str) -> None:
        """Drop a site for a bad upload; count it towards quarantine."""
        self.step_refusals.add(link.site_id)
        if link.closed:
            return
        link.close(grpc.StatusCode.INVALID_ARGUMENT, reason)
        self.audit("refused", site=link.site_id, step=self.step, reason=one_line(reason, REASON_CHARS))
        if self.quarantine.refuse(link.site_id, self.step, reason):
            self.audit("quarantined", site=link.site_id, step=self.step, reason=one_line(reason, REASON_CHARS))

    async def _screen(self, uploads: list, step: int, phase: int, messages: list, nonfinite: dict[int, str]) -> list | str:
        """The uploads that pass the strategy's checks and the influence bound (the rest, and
        ``nonfinite``'s minority, are refused), or why the step must abort when the check itself
        is broken (``screening.py``)."""
        payloads = [u.payload for _, u in uploads]
        try:
            refused = await self._off_loop(sum(p.nbytes() for p in payloads), self.screening.refusals, step, phase, payloads, messages)
        except Exception as exc:
            log.error("the %s upload check fails on every upload: %s: %s", self.strategy.name, type(exc).__name__, exc)
            return f"the {self.strategy.name} upload check failed ({type(exc).__name__})"
        refused = {**nonfinite, **refused}  # the strategy's rules say more when they refuse it too
        for index, reason in sorted(refused.items()):
            link = uploads[index][0]
            self._refuse(link, f"site {link.site_id}, step {step} phase {phase}: {reason}")
        return [upload for index, upload in enumerate(uploads) if index not in refused]

    async def _aggregate(self, uploads: list, step: int, phase: int, messages: list):
        """``(uploads, message, sent, update)``, dropping sites whose payload alone breaks the
        aggregation or the message; a reason (str) when the step must abort instead."""
        while True:
            payloads = [u.payload for _, u in uploads]
            nbytes = sum(p.nbytes() for p in payloads)
            start = self.server_half.state_dict()
            try:
                return (uploads, *await self._off_loop(nbytes, self.screening.message, self.server_half, payloads, messages))
            except Exception as exc:
                self.server_half.load_state_dict(start)  # as at the phase's start, for the recomputation
                failure = f"{type(exc).__name__}: {exc}"
            log.warning("step %d phase %d: the aggregated message fails (%s); trying each site's upload alone", step, phase, failure)
            breaking = await self._off_loop(nbytes, self.screening.breaking, start, payloads, messages)
            offenders = [uploads[index][0] for index in breaking]
            if not offenders or len(offenders) == len(uploads):
                return f"the {self.strategy.name} server half failed on phase {phase}: {failure}"
            for link in offenders:
                self._refuse(link, f"site {link.site_id}, step {step} phase {phase}: its upload breaks the aggregated message ({failure})")
            uploads = [(link, upload) for link, upload in uploads if link not in offenders]
            if phase > 0 or len(uploads) < self.config.federation.min_sites:
                return f"{', '.join(sorted(link.site_id for link in offenders))} broke phase {phase}"

    @staticmethod
    async def _off_loop(nbytes: int, function, *args):
        """``function(*args)`` in a worker thread when its data is large, so the site streams keep flowing."""
        if nbytes < INLINE_BYTES:
            return function(*args)
        return await asyncio.to_thread(function, *args)

    async def _answers(self, active: list[SiteLink], step: int, attempt: int, phase: int):
        """Yield ``(link, answer)`` for every active site as answers arrive: its upload for
        this phase or its step_done, None when it is gone or late (``phase_timeout_s``)."""
        timeout = self.config.federation.phase_timeout_s
        deadline = time.monotonic() + timeout
        waiting = set(active)
        earlier = [link for link in active if not link.inbox.empty()]  # events that came before this round
        while waiting:
            if earlier:
                link = earlier.pop()
            elif not self.arrivals.empty():
                link = self.arrivals.get_nowait()
            else:
                try:
                    # asyncio.timeout, never wait_for, for every wait here: on Python 3.11 wait_for
                    # drops a cancel that lands as the awaited value arrives, so a Ctrl-C during a
                    # busy run went unheard (tests/test_end_of_run.py).
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                        link = await self.arrivals.get()
                except TimeoutError:
                    for link in sorted(waiting, key=lambda link: link.site_id):
                        link.close(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"site {link.site_id} sent nothing for step {step} phase {phase} within {timeout:g} s (federation.phase_timeout_s)",
                        )
                        yield link, None
                    return
            while link in waiting and not link.inbox.empty():  # not waiting: an event for a later round, it stays queued
                answer = self._answer(link, link.inbox.get_nowait(), step, attempt, phase)
                if answer is not SKIP:
                    waiting.discard(link)
                    yield link, answer

    def _answer(self, link: SiteLink, event, step: int, attempt: int, phase: int):
        """What ``event`` means for the round: the event itself, None (the site is dropped) or SKIP."""
        if isinstance(event, Closed):
            log.warning("site %s lost during step %d phase %d: %s", link.site_id, step, phase, event.reason)
            return None
        if isinstance(event, SyncRequest):
            self._resync(link, event)
            return SKIP
        header_step = (event.step, event.attempt) if isinstance(event, Done) else (event.payload.header.step, event.payload.header.attempt)
        if header_step < (step, attempt):
            return SKIP  # an answer to an aborted attempt: the site has moved on
        if isinstance(event, Upload) and header_step == (step + 1, 0):
            return SKIP  # the next step begun by itself, but this step was aborted or restarted: it begins again
        if isinstance(event, Upload) and header_step == (link.stale_step, 0):
            link.stale_step = None
            return SKIP  # this step begun by itself, but the site got a step_begin: it computes it again
        if isinstance(event, Done):
            if phase == 0:
                link.close(grpc.StatusCode.INVALID_ARGUMENT, f"site {link.site_id} reported step {step} done before uploading its phase 0 payload")
                return None
            return event
        try:
            check_protocol(event.payload, step, attempt, phase, self.fingerprint, self._max_samples(step))
        except PayloadError as exc:
            self._refuse(link, f"site {link.site_id}, step {step} phase {phase}: {exc}")
            return None
        return event

    def _max_samples(self, step: int) -> int:
        """The most samples an upload of ``step`` may claim: a batch per local step it trains on."""
        if self.privacy:
            return self.privacy.max_samples
        return self.screening.max_samples(self.config.training.batch_size, step)

    def _abort(self, links: list[SiteLink], step: int, attempt: int, reason: str) -> None:
        log.warning("step %d attempt %d aborted: %s", step, attempt, reason)
        abort = Encoded.of(cpb.ServerMessage(step_abort=cpb.StepAbort(step=step, reason=reason)))
        for link in links:
            if not link.closed:
                self._send(link, abort)
        self.server_half.load_state_dict(self.half_at_step_start)  # sites restore theirs at the next step_begin
        return None

    def _stop_for_model(self, links: list[SiteLink], step: int, attempt: int, reason: str) -> NoReturn:
        """Refuse the step as a whole and stop: nothing is committed and no site is refused or
        counted towards quarantine; every site is told why (a status it does not retry)."""
        self._abort(links, step, attempt, reason)
        for link in list(self.links.values()):
            link.close(grpc.StatusCode.FAILED_PRECONDITION, f"run {self.run_id} stopped: {reason}")
        self.audit("run", action="stopped: the model is not finite", step=step, reason=one_line(reason, REASON_CHARS))
        raise ModelNotFinite(reason)

    def _strategy_state_reset(self, participants: list[SiteLink]) -> bool:
        """Whether every half restarts fresh at this step: only when some participant, or the
        server, cannot restore the step's state (logged with the reason)."""
        missing = [link.site_id for link in participants if self.step not in link.state_steps]
        if missing:
            self.reset_reason = f"{', '.join(missing)} cannot restore the strategy state at step {self.step}"
        if not self.reset_reason:
            return False
        log.warning("step %d: strategy state reset on every replica: %s", self.step, self.reset_reason)
        self.reset_reason = ""
        self.server_half = self.strategy.server(self.layout, self.replica.model)
        self.half_at_step_start = self.server_half.state_dict()
        for link in participants:
            link.state_steps = frozenset({self.step})
        return True

    async def _finish_step(self, result: StepResult, attempt: int, started: float, metrics: MetricsWriter) -> dict:
        step, steps = self.step, self.config.training.steps
        self.fingerprint = result.fingerprint
        seconds = time.perf_counter() - started  # as the in-process simulation: evaluation excluded
        mismatched = sorted(site for site, fp in result.site_fingerprints.items() if fp != self.fingerprint)
        if mismatched:
            log.warning("step %d: %s ended with different weights; they resync at the next step", step, ", ".join(mismatched))
        self.step += 1
        self._state_encoded = self._block_hashes = None  # a new model version: the old state's encoding is not kept
        self.half_at_step_start = self.server_half.state_dict()
        for link in result.participants:
            if link.site_id in result.site_fingerprints:  # it saved its half's state before reporting done
                link.state_steps = frozenset({self.step})
        if result.said_next:  # every participant has begun the next step by itself
            self.went_ahead = set(result.participants)
            # Those whose weights differed began from the wrong ones: they get a step_begin (and the state).
            self.going_on = {link for link in result.participants if link.site_id not in mismatched}
        wire_up = {link.site_id: link.wire_up for link in result.participants}
        wire_down = {link.site_id: link.wire_down for link in result.participants}
        messages_up = {link.site_id: link.messages_up for link in result.participants}
        messages_down = {link.site_id: link.messages_down for link in result.participants}
        repair_bytes = {link.site_id: link.repair_bytes for link in result.participants}
        full_states = {link.site_id: link.full_states for link in result.participants}
        for link in result.participants:
            link.next_step_counts()
        record = {
            "strategy": self.label,
            "step": step,
            "sites": len(result.participants),
            "samples": result.samples,
            "train_loss": result.loss_sum / result.samples,
            "bytes_up": result.bytes_up,
            "bytes_down": result.bytes_down,
            "seconds": seconds,
            "fingerprint": self.fingerprint,
            "wire_bytes_up": sum(wire_up.values()),
            "wire_bytes_down": sum(wire_down.values()),
            "wire_bytes_up_by_site": wire_up,
            "wire_bytes_down_by_site": wire_down,
            # gRPC messages: one each way per phase and site once steps follow by themselves
            "wire_messages_up_by_site": messages_up,
            "wire_messages_down_by_site": messages_down,
            # sent because a site's weights differed (block repairs and full states), within wire_bytes_down
            "repair_bytes_by_site": repair_bytes,
            "full_states_by_site": full_states,
            "phase_seconds": result.phase_seconds,
            "site_ids": [link.site_id for link in result.participants],
            "attempt": attempt,
            "fingerprint_mismatches": mismatched,
            **self.screening.weights_record(step, [link.site_id for link in result.participants]),
            **(self.strategy.describe(self.layout, result.messages) if not self.privacy else {}),
        }
        if self.privacy and (is_eval_step(step, self.config.training.eval_every, steps) or self.privacy.stop_reason()):
            record["dp_epsilon"] = self.privacy.epsilon()
        if is_eval_step(step, self.config.training.eval_every, steps):
            evals = self._checked_evals(result.site_evals)
            if evals:
                record.update(combine(evals))
            test = self.replica.workload.test
            if test is not None and len(test):
                scores = await asyncio.to_thread(self.replica.evaluate)
                record.update({f"test_{k}": v for k, v in scores.items()})
        metrics.write(record)
        if self._checkpoints_after(step) or (self.privacy and self.privacy.stop_reason()):
            await asyncio.to_thread(self._save_checkpoint)
        return record

    def _save_checkpoint(self) -> None:
        """Checkpoint the committed steps: the replica, the server half at the next step's start."""
        checkpoint.save_checkpoint(
            self.run_dir, self.replica, self.step, self.run_id, self.identity,
            {**self.half_at_step_start, **(self.privacy.state_dict() if self.privacy else {})},
        )
        self.checkpoint_step = self.step

    def _checkpoints_after(self, step: int) -> bool:
        """Whether the server checkpoints once ``step`` is committed."""
        every, steps = self.config.training.checkpoint_every, self.config.training.steps
        return bool(every and (step + 1) % every == 0) or step + 1 == steps

    def _checked_evals(self, reports: dict) -> dict[str, SiteEval]:
        """The sites' evaluation reports that pass the checks; the others are logged and left out."""
        evals = {}
        for site, report in reports.items():
            try:
                evals[site] = check_report(report, self.eval_metrics, self.config.federation.max_eval_samples)
            except EvalRejected as exc:
                log.warning("step %d: evaluation report of site %s left out: %s", self.step - 1, site, exc)
        return evals

    def _write_report(self) -> None:
        """``summary.json`` and the plots of ``dadfl sim``, from this run's metrics."""
        from dadfl.report import write_plots  # matplotlib: imported only when there is a run to plot
        records = list(read_metrics(self.run_dir / "metrics.jsonl"))
        if not records:
            return
        summary = run_summary(records, self.label, self.replica.workload.metric_name)
        if self.privacy:
            summary.update(self.privacy.summary())
            log.info("run %s: (ε = %.3g, δ = %g)-differentially private", self.run_id, summary["dp_epsilon"], self.privacy.budget.delta)
        write_summary(self.run_dir / "summary.json", [summary])
        write_plots(self.run_dir)
