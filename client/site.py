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
bad token, wrong layout) end the site with the reason. What one connection does with each
server message is ``session.py``'s; this module owns the connection, its retries and the run
the server's config builds.

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

from dadfl.audit import FILE as AUDIT_FILE
from dadfl.audit import AuditLog, code_identity
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos.channel import PROTOCOL_VERSION, channel_options
from dadfl.protos.codec import codec_id
from dadfl.privacy.ledger import BudgetSpent, PrivacyLedger, RunReleases
from dadfl.replica import Replica, resolve_device
from dadfl.sanitize import REASON_CHARS, one_line
from dadfl.trust.run_checks import PrivateRefusal, RunRefused, build_workload, check_run_config, check_same_model
from dadfl.workloads import BUILTIN, Split
from dadfl.workloads.batches import PoissonBatches

from .config import FileData, SiteConfig
from .data import data_source, held_out_source, load_site_batches, read_data_file
from .data_checks import CheckedBatches, check_batches, check_dataset
from .half_states import HalfStates
from .session import Run, Session, SiteSummary, StateLost

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


class GaveUp(RuntimeError):
    """The server stayed unreachable for ``connect.give_up_after_s`` seconds or ``connect.max_attempts`` attempts in a row."""


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
