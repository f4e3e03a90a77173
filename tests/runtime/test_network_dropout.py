"""Sites that drop out mid-step, lose the quorum, stall, or rejoin; the run goes on."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

import dadfl.client.site as site_module
from dadfl.metrics import read_metrics
from dadfl.strategies import STRATEGIES
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config
from tests.helpers.workloads import TwoPhase

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process


class Dropped(grpc.RpcError):
    """What a site sees when its connection breaks: transient, so run_site reconnects."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection dropped by the test"


def flaky_session(site_id: str, should_drop, stall_until: threading.Event | None = None, wait_for_rejoin: bool = False):
    """A Session class that breaks ``site_id``'s stream once, when ``should_drop(message)``, or
    with ``stall_until`` hangs there until that event (the server timed it out); with
    ``wait_for_rejoin`` the other sites wait at each step's start (``starts_step``) from the drop
    until the dropped site is back, so that the run has steps left for it however slow the machine."""
    fired, back = threading.Event(), threading.Event()

    class FlakySession(site_module.Session):
        def handle(self, message):
            if self.site.config.site_id == site_id and fired.is_set():
                back.set()  # a message on the dropped site's new connection
            elif wait_for_rejoin and fired.is_set() and starts_step(message):
                back.wait(10)  # a hang guard, well below phase_timeout_s
            if self.site.config.site_id == site_id and not fired.is_set() and should_drop(message):
                fired.set()
                if stall_until is not None:
                    assert stall_until.wait(60), "the server never timed the stalled site out"
                else:
                    raise Dropped()
            return super().handle(message)

    return FlakySession


class LogSeen(logging.Handler):
    """``seen`` is set once a record containing ``text`` is logged."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.seen = text, threading.Event()

    def emit(self, record):
        if self.text in record.getMessage():
            self.seen.set()


def starts_step(message) -> bool:
    """A step_begin, or a phase message after which a site begins the next step by itself."""
    return message.WhichOneof("kind") == "step_begin" or message.HasField("next")


def at_step_start(step):
    """The message that starts ``step`` at a site: its step_begin, or the (one-phase) message of
    the step before, when the site goes on by itself."""
    return lambda m: (m.WhichOneof("kind") == "step_begin" and m.step_begin.step == step) or (
        m.HasField("next") and m.chunk.header.kind == 1 and m.chunk.header.step == step - 1
    )


def at_phase_message(step, phase):
    return lambda m: (
        m.WhichOneof("kind") == "chunk" and m.chunk.HasField("header") and m.chunk.header.kind == 1
        and (m.chunk.header.step, m.chunk.header.phase) == (step, phase)
    )


def run_federation(tmp_path, n_sites, steps, federation, **config):
    federation = {"initial_sites": n_sites, **federation}  # every site takes part from step 0
    training = {"steps": steps, "eval_every": steps, "checkpoint_every": 0}
    server = ServerThread(server_config(tmp_path, training=training, federation=federation, **config)).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, n_sites)).start() for i in range(n_sites)]
    summaries = [s.join() for s in sites]
    server.join()
    return summaries, list(read_metrics(tmp_path / "run" / "metrics.jsonl"))


def assert_consistent(summaries, records, steps):
    assert [r["step"] for r in records] == list(range(steps))
    assert {s.fingerprint for s in summaries} == {records[-1]["fingerprint"]}


def test_dropout_in_phase_0_completes_the_step_with_the_rest_and_the_site_rejoins(tmp_path, monkeypatch):
    # Only a step_begin separates a site's phase 0 from the step before: later steps begin
    # with the previous step's done (a site lost there aborts that step, tested below).
    monkeypatch.setattr(site_module, "Session", flaky_session("site-2", at_step_start(0), wait_for_rejoin=True))
    summaries, records = run_federation(tmp_path, 3, 30, federation={"min_sites": 2})
    assert_consistent(summaries, records, 30)
    by_step = {r["step"]: r for r in records}
    assert by_step[0]["site_ids"] == ["site-0", "site-1"] and by_step[0]["attempt"] == 0
    assert by_step[0]["samples"] == 32  # renormalised over the samples that arrived
    assert by_step[29]["sites"] == 3, "the dropped site should have rejoined"
    assert summaries[2].connections == 2 and summaries[2].steps < 30


def test_dropout_after_phase_0_restarts_a_multi_phase_step_without_the_site(tmp_path, monkeypatch):
    monkeypatch.setitem(STRATEGIES, "twophase", TwoPhase)
    monkeypatch.setattr(site_module, "Session", flaky_session("site-0", at_phase_message(3, 0)))
    summaries, records = run_federation(tmp_path, 3, 12, strategy={"name": "twophase"}, federation={"min_sites": 2})
    assert_consistent(summaries, records, 12)
    step3 = records[3]
    assert step3["attempt"] == 1 and step3["site_ids"] == ["site-1", "site-2"] and len(step3["phase_seconds"]) == 2


def test_lost_quorum_waits_for_the_site_and_retries_the_step(tmp_path, monkeypatch):
    # site-1 is lost with step 0's message, before its done: step 0 aborts (site-0, which
    # applied it and began step 1 by itself, restarts from the server's state) and is
    # retried once site-1 is back.
    monkeypatch.setattr(site_module, "Session", flaky_session("site-1", at_step_start(1)))
    summaries, records = run_federation(tmp_path, 2, 6, federation={"min_sites": 2})
    assert_consistent(summaries, records, 6)
    assert records[0]["attempt"] == 1 and records[0]["sites"] == 2


def test_stalled_site_is_timed_out_and_the_step_retried_when_it_is_back(tmp_path, monkeypatch):
    # site-1 hangs until the server has timed it out; 5 s is what the honest site has for each phase
    timed_out = LogSeen("closing site site-1: site site-1 sent nothing")
    logging.getLogger("dadfl.server").addHandler(timed_out)
    monkeypatch.setattr(site_module, "Session", flaky_session("site-1", at_step_start(1), stall_until=timed_out.seen))
    try:
        summaries, records = run_federation(tmp_path, 2, 4, federation={"min_sites": 2, "phase_timeout_s": 5})
    finally:
        logging.getLogger("dadfl.server").removeHandler(timed_out)
    assert_consistent(summaries, records, 4)
    assert records[0]["attempt"] == 1 and records[0]["sites"] == 2
    assert summaries[1].connections == 2
