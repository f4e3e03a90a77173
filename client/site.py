"""``dadfl.client.site`` — a site: joins the coordinator, trains on local data, never sends the data itself.

``run_site`` connects (TLS with the configured CA, or plain text when the config has no
CA), says hello with its site id and token, builds its replica from the run config the
server sends (workload, strategy, optimizer, batch size), answers with its model layout
fingerprint, loads the state the server sends, then follows the server step by step:
local forward/backward, the strategy's site half for every phase, apply the update,
report the weights fingerprint. When the server's message of a step says ``next``, the
site goes on by itself: it applies the update, begins the next step at once and sends its
step_done with that step's upload (one round trip per step; the server checks the
weights fingerprint on the upload). When its weights differ from the server's at an
explicit step_begin it sends the hashes of its state's blocks and the server answers with
the blocks that differ (``protos/repair.py``); only when that does not restore the server's
fingerprint does it ask for the full state. Its strategy half's state is saved after every step
(``half_states.py``) and restored when the server begins a step the half is not at (a
restarted coordinator replaying from its checkpoint, an aborted attempt, a restarted
site). A dropped connection is retried with exponential backoff; refusals (unknown site,
bad token, wrong layout) end the site with the reason.

The client is asyncio (``grpc.aio``): one coroutine reads the stream, handles each message
and writes what the handling produced, with no thread between them; many sites can run
in one process (``run_site_async``). The steps of a run whose step's work
(``step_work_bytes``: model bytes × local steps) is ``INLINE_BYTES`` or more, a [dp] run's
steps (each upload's privacy ledger is written and fsync'd first) and the replica's build
run in a worker thread, so they do not stall other streams.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from dataclasses import dataclass, field

import grpc
import torch
from torch.utils.data import Dataset

from dadfl.audit import FILE as AUDIT_FILE
from dadfl.audit import AuditLog, code_identity, payload_entry
from dadfl.metrics import is_eval_step
from dadfl.privacy.accounting import poisson_cap
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.channel import PROTOCOL_VERSION, channel_options
from dadfl.protos.codec import PayloadAssembler, codec_id, encode_payload
from dadfl.protos.repair import apply_repair, block_hashes
from dadfl.protos.state import load_state
from dadfl.replica import Replica, resolve_device
from dadfl.sanitize import REASON_CHARS, one_line
from dadfl.strategies import Payload, weights_fingerprint
from dadfl.workloads import BUILTIN, Split
from dadfl.workloads.batches import PoissonBatches

from .config import FileData, SiteConfig
from .data import data_source, held_out_source, load_site_batches, read_data_file
from .data_checks import CheckedBatches, check_batches, check_dataset
from .half_states import HalfStates
from dadfl.privacy.ledger import BudgetSpent, PrivacyLedger, RunReleases
from dadfl.trust.run_checks import PrivateRefusal, RunRefused, build_workload, check_run_config, check_same_model

log = logging.getLogger("dadfl.site")

MAX_CHUNK_BYTES = 4 << 20  # the largest chunk_bytes a server config allows
# A step's work is measured as model bytes × the batches the step trains on (the strategy's
# batches_per_step: 1 for one-batch strategies, H for FedAvg/DiLoCo's H local steps), since a
# forward/backward costs about the same per model byte. A step under INLINE_BYTES runs on the
# event loop, where a hop to a thread would cost more than the step; one at or over it runs in
# a worker thread, so it does not stall every other stream on the loop.
INLINE_BYTES = 1 << 20
FINISHED_STATUS_S = 2.0  # after `finished`, how long a site waits for the stream's status before cancelling its call
PERMANENT = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
}
# A TLS handshake that fails (the coordinator's certificate is not signed by connect.ca_cert,
# does not name connect.tls_server_name, or the coordinator speaks plain text) fails the same
# way every time: gRPC reports it as UNAVAILABLE, which is otherwise worth retrying.
TLS_FAILURES = ("handshake failed", "verification check failed")


def tls_closed_advice(connect) -> str:
    """A TLS server that closes the connection while connecting has most often refused the
    site's client certificate, which gRPC reports as a closed socket, like a network fault:
    the site keeps retrying, and says what to check."""
    if connect.client_cert is None:
        return ("; if the coordinator requires client certificates (listen.require_client_cert), set connect.client_cert "
                "and connect.client_key to the files `dadfl enroll SITE --cert` wrote")
    return "; if the coordinator requires client certificates, check that connect.client_cert was issued by its CA (`dadfl enroll SITE --cert`)"


def step_work_bytes(replica: Replica) -> int:
    """The work of one step, as ``INLINE_BYTES`` measures it: the model's parameter bytes times
    the batches one step trains on."""
    model_bytes = sum(p.numel() * p.element_size() for p in replica.model.parameters())
    return model_bytes * replica.strategy.batches_per_step()


class SiteRefused(RuntimeError):
    """The server refused this site for a reason retrying cannot fix."""


class ServerClosed(grpc.RpcError):
    """The server is ending this stream; its ``closing`` message says with which status and why
    (the status itself may be lost to a write that fails as the stream ends)."""

    def __init__(self, closing: cpb.Closing):
        super().__init__(closing.reason)
        self._code = next((c for c in grpc.StatusCode if c.value[0] == closing.code), grpc.StatusCode.UNKNOWN)
        self._details = closing.reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class GaveUp(RuntimeError):
    """The server stayed unreachable for ``connect.give_up_after_s`` seconds or ``connect.max_attempts`` attempts in a row."""


class StateLost(RuntimeError):
    """A saved strategy state the site announced is gone: rejoin so the server resets it."""


@dataclass
class SiteSummary:
    steps: int = 0  # steps this site completed
    resyncs: int = 0  # full states received because the weights differed
    repairs: int = 0  # block repairs that restored the server's weights
    connections: int = 0
    fingerprint: str = ""
    finished: str = ""


@dataclass
class Run:
    """What the site built from the server's run config; kept across reconnects."""

    config: cpb.RunConfig
    replica: Replica
    batches: CheckedBatches
    codec: int
    states: HalfStates
    half_step: int | None = 0  # the step whose start the half holds; None in the middle of a step
    held_out: Dataset | None = None  # evaluation data
    releases: RunReleases | None = None  # [dp]: Poisson batches, clipped samples, each upload in the ledger
    large: bool = False  # a step's work of INLINE_BYTES or more: its steps run in a worker thread
    checkpoint_step: int = 0  # the server's checkpoint step as the last step begin named it

    @property
    def off_loop(self) -> bool:
        """Whether its messages are handled in a worker thread: a large step's work, or [dp]'s
        ledger write and fsync before every upload, would stall every stream on the event loop."""
        return self.large or self.releases is not None

    def prepare_half(self, begin: cpb.StepBegin) -> None:
        """Bring the strategy half to the start of ``begin.step``: reset, restore or keep."""
        replica, step = self.replica, begin.step
        if begin.reset_strategy_state:
            replica.half = replica.strategy.site(replica.layout, replica.model)
            self.states.save(step, replica.half.state_dict())
        elif self.half_step != step:
            fresh = replica.strategy.site(replica.layout, replica.model)
            if step:
                self._restore(fresh, step)
            replica.half = fresh
        self.half_step = step
        # step - 1: a step begun by itself restarts from there if the step before aborts; the
        # checkpoint step named before: a `next` names the checkpoint before it is saved
        self.states.keep_only({self.checkpoint_step, begin.checkpoint_step, step - 1, step})
        self.checkpoint_step = begin.checkpoint_step

    def save_half(self, begin: cpb.StepBegin) -> None:
        """After applying ``begin.step``: save the half as the state at the next step's start.
        The one before ``begin.step`` is no longer needed, nor an older checkpoint step than
        ``begin``'s: the server committed and checkpointed both before this step's message."""
        step = begin.step + 1
        self.states.save(step, self.replica.half.state_dict())
        self.states.keep_only({begin.checkpoint_step, step - 1, step})
        self.half_step = step

    def _restore(self, half, step: int) -> None:
        state = self.states.load(step)
        try:
            if state is None:
                raise ValueError("it is gone")
            half.load_state_dict(state)
        except (KeyError, ValueError) as exc:
            self.states.forget(step)
            raise StateLost(f"the saved strategy state at step {step} cannot be restored ({exc}); rejoining so the server resets it") from None


class Session:
    """One connection's message handling; the site's replica outlives it in ``self.run``."""

    def __init__(self, site: "Site"):
        self.site = site
        self.outgoing: list[cpb.SiteMessage] = []  # written to the stream after each handled message
        self.assembler: PayloadAssembler | None = None
        self.step: cpb.StepBegin | None = None  # the step under way
        self.messages: list[Payload] = []
        self.waiting_for_sync = False
        self.going_next: cpb.StepNext | None = None  # the `next` of the server message being assembled
        self.pending_done: cpb.StepDone | None = None  # goes with the first chunk of the next upload

    def take_outgoing(self) -> list[cpb.SiteMessage]:
        outgoing, self.outgoing = self.outgoing, []
        return outgoing

    def send(self, **kind) -> None:
        message = cpb.SiteMessage(**kind)
        if "chunk" in kind and self.pending_done is not None:
            message.previous_done.CopyFrom(self.pending_done)
            self.pending_done = None
        self.outgoing.append(message)

    def send_owed_done(self) -> None:
        """Send on its own the done that was to ride with the next upload, if one is owed."""
        if self.pending_done is not None:
            self.send(step_done=self.pending_done)
            self.pending_done = None

    def leave(self, reason: str) -> None:
        """Replace what the failed handling left to send by the done this site still owes (the
        step it applied stands: the server commits it rather than abort it) and ``leaving``."""
        self.outgoing = []
        self.send_owed_done()
        self.send(leaving=cpb.Leaving(reason=reason[:REASON_CHARS]))  # the server escapes it for its log

    def handle(self, message: cpb.ServerMessage) -> bool:
        """Act on one server message; True when the run is over."""
        kind = message.WhichOneof("kind")
        if kind == "config":
            self.site.prepare(message.config)
            self.assembler = PayloadAssembler(message.config.max_payload_bytes)
            run = self.site.run
            self.send(ready=cpb.Ready(
                layout_fingerprint=run.replica.layout.fingerprint(), strategy_state_steps=sorted(run.states.steps())
            ))
        elif kind == "chunk":
            if message.chunk.HasField("header"):
                self.going_next = message.next if message.HasField("next") else None
            assembled = self.assembler.feed(message.chunk)
            if assembled is not None:
                if assembled.header.kind == pb.STATE:
                    self.on_state(assembled.payload)
                elif assembled.header.kind == pb.REPAIR:
                    self.on_repair(assembled.payload, assembled.header.base_fingerprint)
                else:
                    self.on_message(assembled.payload)
        elif kind == "step_begin":
            self.on_step_begin(message.step_begin)
        elif kind == "step_abort":
            log.warning("step %d aborted by the server: %s", message.step_abort.step, one_line(message.step_abort.reason, REASON_CHARS))
            self.step, self.messages, self.waiting_for_sync, self.pending_done = None, [], False, None
        elif kind == "finished":
            self.site.summary.finished = one_line(message.finished.reason, REASON_CHARS)
            return True
        elif kind == "closing":
            raise ServerClosed(message.closing)
        return False

    def on_state(self, state: Payload) -> None:
        replica = self.site.run.replica
        load_state(replica, state)
        self.site.summary.fingerprint = weights_fingerprint(replica.model)
        log.info("loaded the server's state for step %d (%s)", state.step, self.site.summary.fingerprint[:12])
        if self.waiting_for_sync:
            self.waiting_for_sync = False
            self.site.summary.resyncs += 1
            self.start_step()

    def on_repair(self, repair: Payload, fingerprint: str) -> None:
        """The blocks of the server's state that differed here: apply them; ask for the full
        state when the weights still differ."""
        if not self.waiting_for_sync or self.step is None or fingerprint != self.step.fingerprint:
            return  # the answer to a request of an aborted step: the next step_begin asks again
        replica = self.site.run.replica
        blocks = apply_repair(replica, repair)
        self.site.summary.fingerprint = weights_fingerprint(replica.model)
        if self.site.summary.fingerprint != fingerprint:
            log.warning("step %d: %d repaired blocks left the weights at %s, asking for the full state",
                        self.step.step, blocks, self.site.summary.fingerprint[:12])
            self.send(sync_request=cpb.SyncRequest(step=self.step.step, fingerprint=self.site.summary.fingerprint))
            return
        log.info("step %d: repaired %d blocks of the state (%s)", self.step.step, blocks, fingerprint[:12])
        self.waiting_for_sync = False
        self.site.summary.repairs += 1
        self.start_step()

    def on_step_begin(self, begin: cpb.StepBegin) -> None:
        self.step, self.messages = begin, []
        self.site.run.prepare_half(begin)
        if self.site.summary.fingerprint != begin.fingerprint:
            self.waiting_for_sync = True
            self.send(sync_request=cpb.SyncRequest(
                step=begin.step, fingerprint=self.site.summary.fingerprint, block_hashes=block_hashes(self.site.run.replica),
            ))
            return
        self.start_step()

    def start_step(self) -> None:
        run, begin = self.site.run, self.step
        if run.releases is not None:
            inputs, targets = run.batches.at(begin.step)
            if not 1 <= len(targets) <= poisson_cap(run.config.batch_size):
                # A Poisson draw with no sample (chance about e^-batch_size) or far above the batch: nothing to
                # send; the server goes on without this site once the phase times out.
                log.warning("step %d: the Poisson draw holds %d samples; this site sits the step out", begin.step, len(targets))
                self.send_owed_done()  # the step before still needs this site's done
                return
            local = run.replica.local(inputs, targets)
        else:
            local = run.replica.work(run.batches.at, begin.step)
        run.half_step = None  # from here until the update is applied the half holds part of a step
        payload = run.replica.half.begin(local, begin.step)
        self.upload(payload, loss_sum=local.loss_sum)
        # The upload is encoded: the model's gradients (model-sized) need not wait for the
        # message with it; a half that uses them later holds its own reference.
        run.replica.model.zero_grad(set_to_none=True)

    def upload(self, payload: Payload, loss_sum: float = 0.0) -> None:
        run = self.site.run
        if run.releases is not None:
            try:
                run.releases.charge()  # on disk before the upload goes out
            except BudgetSpent as exc:
                raise PrivateRefusal(str(exc)) from None
        self.site.audit(
            "upload", run_id=run.config.run_id, coordinator=self.site.config.connect.server, attempt=self.step.attempt,
            **payload_entry(payload), **({"dp": run.releases.spent()} if run.releases is not None else {}),
        )  # on disk before the upload goes out
        chunks = encode_payload(
            payload, run.codec, run.config.chunk_bytes, kind=pb.PHASE,
            attempt=self.step.attempt, loss_sum=loss_sum, base_fingerprint=self.step.fingerprint,
        )
        for chunk in chunks:
            self.send(chunk=chunk)

    def on_message(self, message: Payload) -> None:
        if self.step is None:
            return  # the message of an aborted step
        replica = self.site.run.replica
        message = message.to(replica.device)
        self.messages.append(message)
        reply = replica.half.receive(message)
        if reply is not None:
            self.upload(reply)
            return
        fingerprint = replica.apply(self.messages)
        self.site.run.save_half(self.step)  # before step_done: a kill after it loses nothing
        self.site.summary.fingerprint = fingerprint
        self.site.summary.steps += 1
        step = self.step.step
        done = cpb.StepDone(step=step, attempt=self.step.attempt, fingerprint=fingerprint, eval=self.evaluate())
        if step % 10 == 0:
            log.info("step %d done (%s)", step, fingerprint[:12])
        self.step, self.messages = None, []
        if self.going_next is None:
            self.send(step_done=done)
            return
        self.pending_done = done  # the next step begins now; its upload carries this done
        self.on_step_begin(cpb.StepBegin(step=step + 1, fingerprint=fingerprint, attempt=0, checkpoint_step=self.going_next.checkpoint_step))

    def evaluate(self) -> cpb.EvalReport | None:
        """The updated global model on this site's held-out data, on evaluation steps."""
        run, step = self.site.run, self.step.step
        if run.held_out is None or not run.config.eval_every:
            return None
        if not is_eval_step(step, run.config.eval_every, run.config.steps):
            return None
        scores = run.replica.evaluate(run.held_out)
        log.info("after step %d: held-out %s on %d samples", step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()),
                 len(run.held_out))
        return cpb.EvalReport(samples=len(run.held_out), metrics=scores)


@dataclass
class Site:
    config: SiteConfig
    run: Run | None = None
    summary: SiteSummary = field(default_factory=SiteSummary)
    data_file: Split | None = None  # data.path as read before connecting: every run trains on it
    ledger: PrivacyLedger | None = None  # what [dp] runs have spent of this site's records
    audit_log: AuditLog | None = None  # <state_dir>/<site_id>/audit.jsonl: every upload and code decision (dadfl/audit.py)

    def __post_init__(self) -> None:
        if self.config.state_dir is not None and self.audit_log is None:
            self.audit_log = AuditLog(self.config.state_dir / self.config.site_id / AUDIT_FILE)  # beside its privacy ledger

    def prepare(self, config: cpb.RunConfig) -> None:
        """Build the replica and data stream for the server's run (once per run id); the
        decision, allowed or refused, goes to the audit trail with the code it ran."""
        if self.run is not None and config == self.run.config:
            return  # a reconnect to the same run; any other config is checked and built anew
        decision = {"run_id": config.run_id, "coordinator": self.config.connect.server, "workload": config.workload,
                    "strategy": config.strategy, "dp": bool(config.dp)}
        imported: list[str] = []  # the workload's module, once _prepare imported it
        try:
            self._prepare(config, imported)
        except Exception as exc:
            reason = exc.PUBLIC if isinstance(exc, PrivateRefusal) else one_line(str(exc), REASON_CHARS)
            self.audit("workload", **decision, decision="refused", reason=reason, code=self._code(imported))
            raise
        self.audit("workload", **decision, decision="allowed", code=self._code(imported))

    def audit(self, event: str, **fields) -> None:
        if self.audit_log is not None:
            self.audit_log.append(event, site=self.config.site_id, **fields)

    @staticmethod
    def _code(imported: list[str]) -> dict:
        """The workload's code as imported here; empty when it was refused before its import."""
        return code_identity(imported[0]) if imported and imported[0] in sys.modules else {}

    def _prepare(self, config: cpb.RunConfig, imported: list[str]) -> None:
        checked = check_run_config(config, self.config, MAX_CHUNK_BYTES)  # before any workload code is imported
        imported.append(BUILTIN.get(checked.workload, checked.workload).partition(":")[0])
        workload = build_workload(checked, self.config.limits, self.config.workload_path)
        privacy = checked.privacy
        replica = Replica(
            workload, checked.strategy, checked.optimizer, resolve_device(self.config.device),
            max_grad_norm=privacy.max_grad_norm if privacy else None, probe=True, precision=checked.precision,
        )
        check_same_model(replica, config.layout_fingerprint, config.layout_line_hashes, config.model_probe)
        batches, held_out = load_site_batches(self.config, workload, config.batch_size, replica.device, self.data_file)
        source = data_source(self.config, workload)
        poisson, releases = None, None
        if privacy:
            try:
                rate = privacy.site_rate(config.batch_size, len(batches))
                releases = RunReleases.admit(self.privacy_ledger(), config.run_id, privacy, rate, config.steps)
            except (ValueError, BudgetSpent) as exc:
                raise PrivateRefusal(str(exc)) from None
            poisson = PoissonBatches(batches.dataset, rate, seed=None)  # every upload a fresh sample (dadfl.privacy)
        batches = check_batches(replica.model, workload.loss, batches, source, replica.device)
        if poisson is not None:  # checked on the fixed batch of step 0, drawn by Poisson sampling from here
            batches = CheckedBatches(poisson, batches.conversion, batches.source)
        if held_out is not None:
            held_out = check_dataset(replica.model, workload.loss, held_out, held_out_source(self.config, source), replica.device)
        states = HalfStates(self.config.state_dir, self.config.site_id, config.run_id, replica.device)
        large = step_work_bytes(replica) >= INLINE_BYTES
        self.run = Run(config, replica, batches, codec_id(config.codec), states, held_out=held_out, releases=releases, large=large)
        log.info("site %s: run %s, %s with %s, %d steps", self.config.site_id, config.run_id, config.workload, config.strategy, config.steps)

    def privacy_ledger(self) -> PrivacyLedger:
        """The site's ledger (``dadfl.privacy.ledger``), opened at its first [dp] run and held until :meth:`close`."""
        if self.ledger is None:
            policy = self.config.privacy
            if policy.max_epsilon is not None and self.config.state_dir is None:
                raise BudgetSpent("privacy.max_epsilon bounds this site's records over every run: set state_dir, where the site keeps its privacy ledger")
            budget = None if policy.max_epsilon is None else (policy.max_epsilon, policy.max_delta)
            self.ledger = PrivacyLedger.of_site(self.config.state_dir, self.config.site_id, budget)
        return self.ledger

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    async def join(self, insecure: bool = False) -> bool:
        """Open a channel (``open_channel``) and take part over one stream; True when the run finished."""
        channel = open_channel(self.config, insecure)
        try:
            return await self.connect_once(channel)
        finally:
            await channel.close()

    async def connect_once(self, channel: grpc.aio.Channel) -> bool:
        """One stream from hello to its end; True when the run finished."""
        session = Session(self)
        session.send(hello=cpb.Hello(site_id=self.config.site_id, token=self.config.token, protocol_version=PROTOCOL_VERSION))
        call = cpb_grpc.CoordinatorStub(channel).Join()
        try:
            while True:
                for outgoing in session.take_outgoing():
                    await call.write(outgoing)
                message = await call.read()
                if message is grpc.aio.EOF:
                    return False
                try:
                    finished = await self._handle(session, message)
                except (grpc.RpcError, StateLost):  # the server ends the stream, or the site rejoins
                    raise
                except Exception as exc:  # the site stops: the server hears why now, not at its phase timeout
                    await self._leave(call, session, exc)
                    raise
                if finished:
                    await self._await_status(call)
                    return True
        except asyncio.InvalidStateError:  # a write after the server ended the stream: reading raises its status
            await call.read()
            return False
        finally:
            call.cancel()

    @classmethod
    async def _leave(cls, call, session: Session, exc: Exception) -> None:
        """Tell the server that this site leaves and why: a refusal of the run config in its own
        words (they name settings and limits), a privacy refusal in a fixed phrase (its words
        name the site's records and ε), otherwise only the error's type."""
        if isinstance(exc, PrivateRefusal):
            reason = exc.PUBLIC
        elif isinstance(exc, RunRefused):
            reason = str(exc)
        else:
            reason = f"the site stopped on {type(exc).__name__}; its log says why"
        session.leave(reason)
        try:
            for outgoing in session.take_outgoing():
                await call.write(outgoing)
        except (grpc.RpcError, asyncio.InvalidStateError):
            return  # the stream is already gone
        await cls._await_status(call)

    @staticmethod
    async def _await_status(call) -> None:
        """After ``finished`` or ``leaving``: end this side and read until the server's status
        (at most FINISHED_STATUS_S) before the call is cancelled. A cancel racing the status the
        server sends as its handler returns makes gRPC log an error at the server."""
        async def until_end() -> None:
            while await call.read() is not grpc.aio.EOF:
                pass

        try:
            await call.done_writing()
            async with asyncio.timeout(FINISHED_STATUS_S):  # not wait_for, which may drop a cancel (server/uploads.py)
                await until_end()
        except (TimeoutError, asyncio.InvalidStateError, grpc.RpcError):
            pass  # the run has finished either way

    async def _handle(self, session: Session, message: cpb.ServerMessage) -> bool:
        """``session.handle``, in a worker thread for the replica's build and the steps of a run that is ``off_loop``."""
        kind = message.WhichOneof("kind")
        if kind == "config" or (self.run is not None and self.run.off_loop and kind in ("chunk", "step_begin")):
            return await asyncio.to_thread(session.handle, message)
        return session.handle(message)


def open_channel(config: SiteConfig, insecure: bool) -> grpc.aio.Channel:
    """TLS with the configured CA (and the site's certificate, for mutual TLS); plain text
    only when explicitly ``insecure``."""
    options = channel_options(MAX_CHUNK_BYTES)
    connect = config.connect
    if insecure:
        return grpc.aio.insecure_channel(connect.server, options=options)
    if connect.ca_cert is None:
        raise SiteRefused("TLS is on by default: set connect.ca_cert to the server's CA certificate, or pass --insecure")
    if not connect.ca_cert.is_file():
        raise SiteRefused(f"connect.ca_cert {connect.ca_cert} does not exist; copy the server's CA certificate there")
    identity = {}
    if connect.client_cert is not None:
        for field_name, path in (("client_cert", connect.client_cert), ("client_key", connect.client_key)):
            if not path.is_file():
                raise SiteRefused(f"connect.{field_name} {path} does not exist; copy the files `dadfl enroll {config.site_id} --cert` wrote there")
        identity = {"certificate_chain": connect.client_cert.read_bytes(), "private_key": connect.client_key.read_bytes()}
    credentials = grpc.ssl_channel_credentials(root_certificates=connect.ca_cert.read_bytes(), **identity)
    if connect.tls_server_name:
        options.append(("grpc.ssl_target_name_override", connect.tls_server_name))
    return grpc.aio.secure_channel(connect.server, credentials, options=options)


def run_site(config: SiteConfig, insecure: bool = False) -> SiteSummary:
    """Take part in the server's run until it finishes; reconnect with backoff when dropped."""
    return asyncio.run(run_site_async(config, insecure))


async def run_site_async(config: SiteConfig, insecure: bool = False) -> SiteSummary:
    """:func:`run_site` as a coroutine: many sites may share one event loop."""
    if config.threads:
        torch.set_num_threads(config.threads)
    resolve_device(config.device)  # no CUDA for device = "cuda": say so before connecting
    data_file = None
    if isinstance(config.data, FileData):  # a missing or unreadable file fails before connecting, too
        data_file = read_data_file(config.data.path, config.data.target_column)
    site = Site(config, data_file=data_file)
    try:
        return await _take_part(site, insecure)
    finally:
        site.close()


async def _take_part(site: Site, insecure: bool) -> SiteSummary:
    """Join, and rejoin with backoff, until the run finishes (``run_site_async``)."""
    config, connect = site.config, site.config.connect
    failures, delay = 0, connect.backoff_initial_s
    since = time.monotonic()  # the start of the current run of failed connections
    while True:
        steps_before = site.summary.steps
        try:
            site.summary.connections += 1
            if await site.join(insecure):
                log.info("site %s: %s", config.site_id, site.summary.finished)
                return site.summary
            reason = "the server ended the stream"
        except grpc.RpcError as exc:
            if exc.code() in PERMANENT:
                raise SiteRefused(f"site {config.site_id} refused by {connect.server}: {one_line(exc.details() or '', REASON_CHARS)}") from None
            if any(failure in (exc.details() or "").lower() for failure in TLS_FAILURES):
                raise SiteRefused(
                    f"site {config.site_id}: the TLS handshake with {connect.server} failed "
                    f"({one_line(exc.details() or '', REASON_CHARS)}); check that the coordinator serves TLS, that connect.ca_cert "
                    "is the CA that signed its certificate and connect.tls_server_name a name in it"
                ) from None
            reason = f"{exc.code().name}: {one_line(exc.details() or '', REASON_CHARS)}"
            if not insecure and "socket closed" in (exc.details() or "").lower():
                reason += tls_closed_advice(connect)
        except StateLost as exc:
            reason = str(exc)
        if site.summary.steps > steps_before:
            failures, delay, since = 0, connect.backoff_initial_s, time.monotonic()  # the connection was useful: start over
        failures += 1
        waited = time.monotonic() - since
        if failures >= connect.max_attempts or waited >= connect.give_up_after_s:
            raise GaveUp(
                f"site {config.site_id}: gave up after {waited:.0f} s and {failures} attempt{'s' if failures > 1 else ''} to reach the coordinator at "
                f"{connect.server} (last: {reason}); check that it runs and listens there, then start the site again "
                "(connect.give_up_after_s, connect.max_attempts)"
            )
        pause = min(delay * (0.5 + random.random()), max(connect.give_up_after_s - waited, 0.0))  # jitter: sites that lost the server together do not return together
        if site.run is None and failures > 1:  # no coordinator reached yet: one line said so, the rest is detail
            log.debug("site %s: %s; trying again in %.1f s (%d/%d)", config.site_id, reason, pause, failures, connect.max_attempts)
        elif site.run is None:
            log.warning("site %s: the coordinator at %s is not reachable yet (%s); trying for up to %.0f s",
                        config.site_id, connect.server, reason, connect.give_up_after_s)
        else:
            log.warning("site %s: %s; reconnecting in %.1f s (%d/%d)", config.site_id, reason, pause, failures, connect.max_attempts)
        await asyncio.sleep(pause)
        delay = min(delay * 2, connect.backoff_max_s)
