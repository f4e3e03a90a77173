"""``dadfl.client.session`` — one connection's message handling at a site, and the run it builds.

A :class:`Session` lives as long as one stream: it acts on each server message (run config,
state, block repair, step begin, the phase messages, abort, finished, closing) and queues
what the site writes back. The :class:`Run` it works on (the replica, the checked batches,
the saved strategy-half states, the [dp] releases) outlives the connection, so a site that
reconnects resumes where it was; ``dadfl.client.site`` owns the connection and its retries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from torch.utils.data import Dataset

from dadfl.audit import payload_entry
from dadfl.metrics import is_eval_step
from dadfl.privacy.accounting import poisson_cap
from dadfl.privacy.ledger import BudgetSpent, RunReleases
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import PayloadAssembler, encode_pieces, fill_chunk
from dadfl.protos.repair import apply_repair, block_hashes
from dadfl.protos.state import load_state
from dadfl.replica import Replica
from dadfl.sanitize import REASON_CHARS, one_line
from dadfl.strategies import Payload, weights_fingerprint
from dadfl.trust.run_checks import PrivateRefusal

from .data_checks import CheckedBatches
from .half_states import HalfStates

if TYPE_CHECKING:
    from .site import Site

log = logging.getLogger("dadfl.site")


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
        self.states.save(step, self.replica.half.state_dict(), keep={begin.checkpoint_step, step - 1})
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
        self._queue(cpb.SiteMessage(**kind))

    def send_chunk(self, header: pb.PayloadHeader, piece: tuple[int, bytes, bool]) -> None:
        """One chunk of an upload, written into its message (``encode_pieces``: no copy of its bytes)."""
        message = cpb.SiteMessage()
        fill_chunk(message.chunk, header, *piece)
        self._queue(message)

    def _queue(self, message: cpb.SiteMessage) -> None:
        """Queue ``message``; a chunk carries the done this site owes."""
        if self.pending_done is not None and message.HasField("chunk"):
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
        header, pieces = encode_pieces(
            payload, run.codec, run.config.chunk_bytes, kind=pb.PHASE,
            attempt=self.step.attempt, loss_sum=loss_sum, base_fingerprint=self.step.fingerprint,
        )
        for piece in pieces:
            self.send_chunk(header, piece)

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
