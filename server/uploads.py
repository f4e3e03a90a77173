"""``dadfl.server.uploads`` — one phase's uploads: collected as they arrive, checked, aggregated into one message.

The step loop waits for every active site's answer to the phase (its upload, or its
``step_done`` after the last phase) in the order they arrive, at most
``federation.phase_timeout_s``; a site late or gone answers None. Each upload is checked
as it comes (:func:`~dadfl.trust.protocol.check_protocol`: its step, attempt, phase,
samples and the weights fingerprint it was computed from), then all of the phase's
uploads together with the strategy's rules and the influence bound (``screening.py``).
The server half aggregates what passed, the message is decoded as every site will
decode it, and a site whose upload alone breaks that is found by trying each upload
alone and refused.

Refusals (README "Trust"): a site whose upload fails a check, whose contribution is out of
bounds, or whose upload alone breaks the aggregated message is dropped like a lost site
and counted towards quarantine (``quarantine.py``, ``federation.quarantine_after``).
Answers to an aborted attempt, and uploads that began a step the site must compute again
(``SiteLink.stale_step``), are skipped. Work on large payloads runs in a worker thread
(above ``INLINE_BYTES``) so the site streams keep flowing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from dadfl.sanitize import REASON_CHARS, one_line

from .links import Closed, Done, SiteLink, SyncRequest, Upload
from dadfl.trust.protocol import PayloadError, check_protocol

log = logging.getLogger("dadfl.server")

INLINE_BYTES = 1 << 20  # smaller work runs on the event loop: a hop to a worker thread costs more
SKIP = object()  # an event that does not answer the current round


class PhaseUploads:
    """The upload part of :class:`~dadfl.server.coordinator.Coordinator`, which holds the
    state these methods use (config, screening, server half, the arrivals queue)."""

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
                    # busy run went unheard (tests/runtime/test_end_of_run.py).
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
                message = functools.partial(self.screening.message, sites=[link.site_id for link, _ in uploads])
                return (uploads, *await self._off_loop(nbytes, message, self.server_half, payloads, messages))
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
