"""``dadfl.server.step_loop`` — the step loop: the strategy's server half driven over the connected sites, step by step.

Each step (:meth:`StepLoop.run`), over the sites connected, in site-id order:

1. wait for a quorum (``min_sites``; ``initial_sites`` before the first step), send the
   current state (weights + optimizer state) to sites that joined since the last step;
2. ``step_begin`` to every participant that did not begin the step by itself (below),
   then per phase: collect and check every participant's upload, aggregate, decode the
   message as every site will, serialise it once and send the same bytes to all
   (``uploads.py``);
3. once every participant has reported ``step_done`` (it has applied the update and
   saved its strategy state) the step is committed: the server applies the same update,
   logs metrics, evaluates and checkpoints on schedule. On evaluation steps each site's
   ``step_done`` carries its evaluation of the updated model on its own held-out data
   (checked and combined in ``evaluation.py``); a coordinator-side test set (the
   workload's ``test`` split) is optional.

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
Uploads that went ahead for a step that then aborted are dropped too. The last step's
done is sent on its own.

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
before aborts rather than the next one going on without it. A site that stops taking
part (its privacy budget refuses an upload, it fails) says so: it sends the done it owes,
then ``leaving`` with its reason; it is lost at once rather than at ``phase_timeout_s``,
and a departure is not a refusal.

Aborts caused by a refused site do not count towards ``MAX_ATTEMPTS_PER_STEP``. A
non-finite value the model produced is nobody's refusal: when most uploads of a phase
are non-finite (``screening.model_fault``), or the weights would be after the update,
the step is refused as a whole, nothing is committed, no site is refused, and the run
stops with one line (:class:`ModelNotFinite`): retrying the same step on the same
weights would give the same.

Strategy state across steps (PowerSGD error feedback and warm start, rank-dAD warm
start and memories) lives in the strategy's halves and is restored, never silently lost:
the server checkpoints its half's state with the step; every site saves its half's state
after each step and says in ``ready`` which steps it can restore; ``step_begin`` names
the step (and the checkpoint step, the oldest one the server may replay from), and a
site whose half is elsewhere restores its saved state at that step. An aborted attempt
restores every half to the step's start. Only when some participant cannot restore the
step's state (a site that missed steps, joined mid-run or lost its state dir) does every
replica rebuild its halves (``reset_strategy_state``, logged once): the state of every
participant must describe the same federation. That costs one step without warm start
or error feedback; exactness is unaffected.

The operator's stop (:meth:`StepLoop.request_stop`: SIGTERM, Ctrl-C, ``dadfl stop``) is
taken where the loop waits for a quorum, i.e. once the step under way has committed or
aborted: the committed steps are checkpointed and every site is told why its stream
ends. At the end the run folder gets ``summary.json`` and the plots ``dadfl sim`` writes.

About 500 lines, one class: a step's phases, aborts, dones and strategy state are one state
machine, read in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NoReturn

import grpc

from dadfl.metrics import MetricsWriter, is_eval_step, read_metrics, run_summary, write_summary
from dadfl.report import write_plots
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import encode_pieces
from dadfl.records import StepRecord
from dadfl.replica import Decoded
from dadfl.sanitize import REASON_CHARS, one_line

from . import checkpoint
from .evaluation import EvalRejected, SiteEval, check_report, combine
from .links import Done, Encoded, SiteLink, Upload
from dadfl.trust.screening import WEIGHTS_NOT_FINITE, model_fault, model_fault_reason, nonfinite_reasons, weights_finite

log = logging.getLogger("dadfl.server")

MAX_ATTEMPTS_PER_STEP = 5


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


class StepLoop:
    """The step loop of :class:`~dadfl.server.coordinator.Coordinator`, which holds the
    state these methods use (replica, server half, links, privacy, metrics, the step)."""

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
                del result  # its messages (dSGD's: the model-sized mean) are not held through the next step
        self.finished = True
        checkpoint.save_final_model(self.run_dir, self.replica)
        for link in list(self.links.values()):
            if link.closed:  # dropped, its stream still ending: it hears the end when it rejoins (``_linger``)
                continue
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
        update: dict | Decoded = {}  # decoded from the messages so far, checked before each was sent
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
            nonfinite = await self._off_loop(sum(u.payload.nbytes() for _, u in uploads), nonfinite_reasons,
                                             [u.header.loss_sum for _, u in uploads], [u.payload for _, u in uploads])
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
                    self.layout, dict(update.items()), sum(u.payload.num_samples for _, u in uploads), len(uploads), step, self.codec,
                )
            active = [link for link, _ in uploads]
            bytes_up += sum(u.header.total_bytes for _, u in uploads)
            if phase == 0:
                samples = sum(u.payload.num_samples for _, u in uploads)
                loss_sum = sum(u.header.loss_sum for _, u in uploads)
            # in the message now: not held while it is sent and answered (under dSGD each is model-sized)
            del events, uploads, screened, aggregated
            header, pieces = encode_pieces(message, self.codec, self.config.wire.chunk_bytes, kind=pb.PHASE, attempt=attempt)
            messages.append(sent)  # what every site decodes
            # Serialised once for every site, a chunk at a time (the message's bytes are held
            # once). Every phase's message says that the next step follows by itself: only the
            # site's half knows which phase is its last.
            wire = Encoded.chunks(header, pieces, going_next)
            for link in active:
                self._send(link, *wire)
            del message, wire  # the outboxes hold the bytes until written; ``sent`` is what the step applies
            bytes_down += header.total_bytes * len(active)
            phase_seconds.append(time.perf_counter() - started)
            phase += 1

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
        record = StepRecord(
            strategy=self.label,
            step=step,
            sites=len(result.participants),
            samples=result.samples,
            train_loss=result.loss_sum / result.samples,
            bytes_up=result.bytes_up,
            bytes_down=result.bytes_down,
            seconds=seconds,
            fingerprint=self.fingerprint,
            wire_bytes_up=sum(wire_up.values()),
            wire_bytes_down=sum(wire_down.values()),
            wire_bytes_up_by_site=wire_up,
            wire_bytes_down_by_site=wire_down,
            wire_messages_up_by_site=messages_up,
            wire_messages_down_by_site=messages_down,
            repair_bytes_by_site=repair_bytes,
            full_states_by_site=full_states,
            phase_seconds=result.phase_seconds,
            site_ids=[link.site_id for link in result.participants],
            attempt=attempt,
            fingerprint_mismatches=mismatched,
            diagnostics={
                **self.screening.commit(step, [link.site_id for link in result.participants]),
                **(self.strategy.describe(self.layout, result.messages) if not self.privacy else {}),
            },
        )
        if self.privacy and (is_eval_step(step, self.config.training.eval_every, steps) or self.privacy.stop_reason()):
            record.dp_epsilon = self.privacy.epsilon()
        if is_eval_step(step, self.config.training.eval_every, steps):
            evals = self._checked_evals(result.site_evals)
            if evals:
                record.evaluation.update(combine(evals))
            test = self.replica.workload.test
            if test is not None and len(test):
                scores = await asyncio.to_thread(self.replica.evaluate)
                record.evaluation.update({f"test_{k}": v for k, v in scores.items()})
        row = record.to_json()
        metrics.write(row)
        if self._checkpoints_after(step) or (self.privacy and self.privacy.stop_reason()):
            await asyncio.to_thread(self._save_checkpoint)
        return row

    def _save_checkpoint(self) -> None:
        """Checkpoint the committed steps: the replica, the server half at the next step's start."""
        checkpoint.save_checkpoint(
            self.run_dir, self.replica, self.step, self.run_id, self.identity,
            {**self.half_at_step_start, **(self.privacy.state_dict() if self.privacy else {})}, self.screening.standing,
            self.screening.recent_norms, self.screening.peer_standing, self.screening.momenta,
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
        """``summary.json`` and (``training.plots``) the plots of ``dadfl sim``, from this run's metrics."""
        records = list(read_metrics(self.run_dir / "metrics.jsonl"))
        if not records:
            return
        summary = run_summary(records, self.label, self.replica.workload.metric_name)
        if self.privacy:
            summary.update(self.privacy.summary())
            log.info("run %s: (ε = %.3g, δ = %g)-differentially private", self.run_id, summary["dp_epsilon"], self.privacy.budget.delta)
        write_summary(self.run_dir / "summary.json", [summary])
        if self.config.training.plots:
            write_plots(self.run_dir)
