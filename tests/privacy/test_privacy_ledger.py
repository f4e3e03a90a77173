"""The site's privacy ledger: its ε is the accountant's over every run, it survives on disk,
and with privacy.max_epsilon a second run that would pass the budget is refused over gRPC."""

from __future__ import annotations

import asyncio
import json
import logging
import queue

import grpc
import pytest

from dadfl.client.data import site_dataset
from dadfl.privacy.ledger import LEDGER_FILE, BudgetSpent, LedgerEntry, LedgerFile, PrivacyLedger, composed_epsilon, rdp_epsilon
from dadfl.trust.run_checks import PrivateRefusal, RunRefused
from dadfl.privacy.accounting import epsilon, site_sample_rate
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos.channel import PROTOCOL_VERSION
from dadfl.server.enrol import enroll
from dadfl.workloads import load_workload
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config

pytest.importorskip("opacus")


def test_composed_epsilon_is_the_rdp_accountants_over_the_same_history():
    from opacus.accountants import RDPAccountant

    history = [(1.0, 0.05, 300), (1.7, 0.02, 1000), (0.8, 0.1, 7)]
    accountant = RDPAccountant()
    accountant.history = list(history)
    assert composed_epsilon(history, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert composed_epsilon(history[:1], 1e-5) == pytest.approx(epsilon(1.0, 0.05, 300, 1e-5), rel=1e-12)
    assert composed_epsilon([], 1e-5) == 0.0 == composed_epsilon([(1.0, 0.05, 0)], 1e-5)


def test_the_ledger_counts_on_disk_and_refuses_the_step_past_the_budget(tmp_path):
    ledger = PrivacyLedger.of_site(tmp_path, "site-a")
    path = tmp_path / "site-a" / LEDGER_FILE
    for _ in range(5):
        ledger.charge("run1", 1.0, 0.05)
    assert not list(path.parent.glob("*.tmp")), "written to a temporary name, then renamed"
    with pytest.raises(BudgetSpent, match="another process holds the privacy ledger"):
        PrivacyLedger.of_site(tmp_path, "site-a")
    ledger.close()

    # A second run composes with the first; the budget lets exactly three of its steps through.
    limit = composed_epsilon([(1.0, 0.05, 5), (1.2, 0.04, 3)], 1e-5) * (1 + 1e-9)
    reopened = PrivacyLedger.of_site(tmp_path, "site-a", budget=(limit, 1e-5))
    assert reopened.epsilon(reopened._history()) == pytest.approx(epsilon(1.0, 0.05, 5, 1e-5), rel=1e-12)
    with pytest.raises(BudgetSpent, match="would reach ε = .* above privacy.max_epsilon"):
        reopened.admit("run2", 1.2, 0.04, 4)
    reopened.admit("run2", 1.2, 0.04, 3)
    reopened.admit("run1", 1.0, 0.05, 5)  # a run's own steps are not counted twice at admission
    for _ in range(3):
        reopened.charge("run2", 1.2, 0.04)
    before = path.read_bytes()
    with pytest.raises(BudgetSpent, match="one more step would take this site's records to ε"):
        reopened.charge("run2", 1.2, 0.04)
    assert path.read_bytes() == before, "a refused step is not counted"
    entries = json.loads(before)["entries"]
    assert [(e["run_id"], e["steps"]) for e in entries] == [("run1", 5), ("run2", 3)]
    # The budget's δ, not a run's: at a large δ the RDP conversion goes negative, which never counts as spent.
    assert PrivacyLedger(None, "x", budget=(1.0, 0.9)).epsilon([(1.0, 0.05, 5)]) == 0.0
    assert PrivacyLedger(None, "x", budget=(1.0, 1e-5)).epsilon([(1e-300, 0.05, 5)]) == float("inf")
    reopened.close()


def test_a_ledger_that_cannot_be_written_refuses_the_upload_and_counts_nothing(tmp_path):
    ledger = PrivacyLedger.of_site(tmp_path, "site-a")
    ledger.charge("run1", 1.0, 0.05)
    (tmp_path / "site-a" / (LEDGER_FILE + ".tmp")).mkdir()  # the temporary name is taken: the write fails
    with pytest.raises(BudgetSpent, match="cannot be written"):
        ledger.charge("run1", 1.0, 0.05)
    assert ledger.steps == {("run1", 1.0, 0.05): 1}
    ledger.close()


def test_the_running_rdp_of_a_long_ledger_gives_the_accountants_epsilon_and_refuses_exactly_past_the_budget(tmp_path):
    """The ledger keeps the RDP sum as it counts (from the entries once, then one step's curve
    per upload): after 200 earlier runs and 30 uploads its ε is Opacus's RDPAccountant's over
    the same history, and the budget lets exactly those 30 uploads through."""
    from opacus.accountants import RDPAccountant

    path = tmp_path / "site-a" / LEDGER_FILE
    path.parent.mkdir()
    earlier = [LedgerEntry(run_id=f"run{i}", noise_multiplier=1.0 + i / 100, sample_rate=0.01 + i / 10_000, steps=3) for i in range(200)]
    path.write_text(LedgerFile(version=1, site_id="site-a", entries=earlier).model_dump_json())
    accountant = RDPAccountant()
    accountant.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in earlier] + [(1.3, 0.02, 30)]
    limit = accountant.get_epsilon(1e-5) * (1 + 1e-9)
    ledger = PrivacyLedger.of_site(tmp_path, "site-a", budget=(limit, 1e-5))
    for _ in range(30):
        ledger.charge("now", 1.3, 0.02)
    assert rdp_epsilon(ledger.rdp, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    with pytest.raises(BudgetSpent, match="one more step would take this site's records to ε"):
        ledger.charge("now", 1.3, 0.02)
    ledger.close()
    reread = PrivacyLedger.of_site(tmp_path, "site-a")
    assert reread.steps[("now", 1.3, 0.02)] == 30 and len(reread.steps) == 201
    reread.close()


@pytest.mark.parametrize("content, message", [
    (b"{not json", "cannot be read"),
    (json.dumps({"version": 1, "site_id": "site-a", "entries": [{"run_id": "r", "noise_multiplier": 1.0, "sample_rate": 2.0, "steps": 1}]}).encode(),
     "entries.0.sample_rate"),
    (json.dumps({"version": 1, "site_id": "site-a", "entries": [{"run_id": "r", "noise_multiplier": 1.0, "sample_rate": 0.1, "steps": -1}]}).encode(),
     "entries.0.steps"),
    (json.dumps({"version": 1, "site_id": "site-b", "entries": []}).encode(), "belongs to site 'site-b'"),
])
def test_an_unreadable_or_foreign_ledger_refuses_rather_than_start_from_zero(tmp_path, content, message):
    path = tmp_path / "site-a" / LEDGER_FILE
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(BudgetSpent, match=message):
        PrivacyLedger.of_site(tmp_path, "site-a")


def dp_run(tmp_path, name: str, quorum_timeout_s: float):
    (tmp_path / name).mkdir()
    return server_config(
        tmp_path / name, strategy={"name": "dad"},
        training={"steps": 6, "batch_size": 16, "eval_every": 6, "checkpoint_every": 0},
        federation={"min_sites": 1, "phase_timeout_s": 20, "quorum_timeout_s": quorum_timeout_s, "linger_s": 1},
        dp={"noise_multiplier": 1.0, "max_grad_norm": 0.5, "max_sample_rate": 0.025},
    )


@pytest.mark.network
def test_a_second_run_past_the_sites_budget_is_refused_over_grpc(tmp_path):
    """Two coordinators, one after the other, on the same site data: the first run's six
    uploads are in the site's ledger at the site's own rate, and the second run, which
    alone meets the floor but with the first would take the records past
    privacy.max_epsilon, is refused before the site trains."""
    first = dp_run(tmp_path, "first", quorum_timeout_s=30)
    server = ServerThread(first).start()
    state_dir = tmp_path / "site-state"

    def site(run, endpoint: str, **privacy):  # enrolled at that coordinator, same data and state_dir
        return site_config(run.run_dir.parent, "site-a", endpoint, 0, 2, state_dir=str(state_dir), privacy={"require_dp": True, "max_delta": 1e-5, **privacy})

    summary = SiteThread(site(first, server.endpoint)).start().join(120)
    server.join(60)
    assert summary.steps == 6 and "finished" in summary.finished
    ledger = json.loads((state_dir / "site-a" / LEDGER_FILE).read_text())
    [entry] = ledger["entries"]
    assert entry["steps"] == 6 and entry["noise_multiplier"] == 1.0 and 0 < entry["sample_rate"] <= 0.1

    own_rate = entry["sample_rate"]
    limit = epsilon(1.0, own_rate, 12, 1e-5) * 0.999  # less than both runs at the site's rate
    assert epsilon(1.0, 0.025, 6, 1e-5) <= limit, "the second run alone meets the floor"

    second = dp_run(tmp_path, "second", quorum_timeout_s=10)  # ends the run, after both sites refused it (seconds on a busy machine)
    server = ServerThread(second).start()
    no_ledger = site_config(second.run_dir.parent, "site-b", server.endpoint, 1, 2, privacy={"require_dp": True, "max_epsilon": limit, "max_delta": 1e-5})
    with pytest.raises(RunRefused, match="privacy.max_epsilon bounds this site's records over every run: set state_dir"):
        SiteThread(no_ledger).start().join(60)
    refused = SiteThread(site(second, server.endpoint, max_epsilon=limit)).start()
    with pytest.raises(RunRefused, match="spent ε = .* in earlier runs .* above privacy.max_epsilon"):
        refused.join(60)
    with pytest.raises(Exception, match="only 0 of the 1 sites needed"):
        server.join(30)
    assert json.loads((state_dir / "site-a" / LEDGER_FILE).read_text()) == ledger, "nothing counted for the refused run"


def test_an_upload_past_the_budget_is_refused_by_the_site_and_not_sent(tmp_path):
    """A coordinator that asks for more uploads than its plan (replays, or a hostile one):
    the site's own session refuses the upload that would pass privacy.max_epsilon."""
    from dadfl.client.config import SiteConfig
    from dadfl.client.site import Session, Site
    from dadfl.protos import coordinator_pb2 as cpb
    from tests.privacy.test_privacy_network import dp_text
    from tests.trust.test_site_trust import run_config

    steps = 4
    config = run_config(dp=dp_text(), steps=steps, batch_size=16)

    def site(**privacy) -> Site:
        data = {"source": "partition", "site_index": 0, "num_sites": 1}
        return Site(SiteConfig.model_validate({
            "site_id": "a", "token": "t" * 20, "connect": {"server": "h:1"}, "data": data, "state_dir": str(tmp_path),
            "privacy": {"require_dp": True, **privacy},
        }))

    probe = site()
    probe.prepare(config)
    rate = probe.run.releases.sample_rate  # this site's own Poisson rate
    probe.close()
    # The run states the site's own rate, so its plan is exactly the budget.
    config = run_config(dp=dp_text(max_sample_rate=rate), steps=steps, batch_size=16)
    limit = epsilon(1.0, rate, steps, 1e-5) * (1 + 1e-9)
    bounded = site(max_epsilon=limit, max_delta=1e-5)
    bounded.prepare(config)
    session = Session(bounded)
    session.step = cpb.StepBegin(step=0, fingerprint="0" * 64)
    replica = bounded.run.replica
    inputs, targets = bounded.run.batches.at(0)
    payload = replica.half.begin(replica.local(inputs, targets), 0)
    for _ in range(steps):
        session.upload(payload)
    sent = len(session.take_outgoing())
    with pytest.raises(RunRefused, match="one more step would take this site's records to ε .* above privacy.max_epsilon"):
        session.upload(payload)
    assert session.take_outgoing() == [] and sent >= steps, "nothing of the refused upload went out"
    assert json.loads((tmp_path / "a" / LEDGER_FILE).read_text())["entries"][0]["steps"] == steps
    # A reconnect with the same config keeps the run; the same run id with a smaller σ is checked anew.
    kept = bounded.run
    bounded.prepare(config)
    assert bounded.run is kept
    with pytest.raises(RunRefused, match="above privacy.max_epsilon"):
        bounded.prepare(run_config(dp=dp_text(max_sample_rate=rate, noise_multiplier=0.5), steps=steps, batch_size=16))
    bounded.close()
    with pytest.raises(BudgetSpent, match="was closed"):
        kept.releases.charge()


def run_id_of(endpoint: str, tokens, caplog) -> str:
    """The coordinator's run id, as an enrolled site hears it in the run config; the probe
    then leaves instead of sending its ready, and the coordinator logs why."""
    token = enroll(tokens, "probe", replace=True)
    outgoing: queue.Queue = queue.Queue()
    with grpc.insecure_channel(endpoint) as channel:
        responses = cpb_grpc.CoordinatorStub(channel).Join(iter(outgoing.get, None))
        outgoing.put(cpb.SiteMessage(hello=cpb.Hello(site_id="probe", token=token, protocol_version=PROTOCOL_VERSION)))
        run_id = next(responses).config.run_id
        outgoing.put(cpb.SiteMessage(leaving=cpb.Leaving(reason="only asked for the run id\nforged log line")))
        outgoing.put(None)
        assert next(responses).WhichOneof("kind") == "closing"
    assert "site probe leaves instead of sending ready: only asked for the run id\\nforged log line" in caplog.text
    return run_id


@pytest.mark.network
def test_a_site_whose_budget_refuses_an_upload_mid_run_says_why_and_the_step_goes_on(tmp_path, caplog, monkeypatch):
    """site-0's ledger already counts three uploads of this run (a restarted coordinator
    replayed them); its budget admits the run's six planned steps, so it refuses its fourth
    upload here. It sends the done of the step it applied and leaves with its reason: the
    coordinator logs it and goes on with the other two at once (no abort, no wait for
    phase_timeout_s, no quarantine: a departure is not a refusal). Every site writes its
    ledger (and fsyncs it) off the event loop its stream runs on."""
    caplog.set_level(logging.INFO)
    steps, state_dir = 6, tmp_path / "site-state"
    phase_timeout_s = 3600  # a coordinator that waited for it would outlast the joins below

    def site(i: int, endpoint: str, **privacy):
        return site_config(tmp_path, f"site-{i}", endpoint, i, 3, state_dir=str(state_dir / str(i)), privacy=privacy)

    rate = site_sample_rate(16, len(site_dataset(site(0, "h:1"), load_workload("digits-mlp", hidden=16))[0]))
    config = server_config(  # the run's rate is site-0's own: its floor is met exactly by the planned steps
        tmp_path, strategy={"name": "dsgd"}, training={"steps": steps, "batch_size": 16, "eval_every": steps, "checkpoint_every": 0},
        federation={"min_sites": 2, "initial_sites": 3, "phase_timeout_s": phase_timeout_s, "quorum_timeout_s": 30, "linger_s": 1},
        dp={"noise_multiplier": 1.0, "max_grad_norm": 0.5, "max_sample_rate": rate},
    )
    server = ServerThread(config).start()
    run_id = run_id_of(server.endpoint, config.listen.tokens, caplog)
    replayed = PrivacyLedger.of_site(state_dir / "0", "site-0")
    for _ in range(3):
        replayed.charge(run_id, 1.0, rate)
    replayed.close()
    on_loop = []
    write = PrivacyLedger._write

    def write_where(ledger, counted):
        try:
            on_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:  # no event loop runs in this thread
            on_loop.append(False)
        write(ledger, counted)

    monkeypatch.setattr(PrivacyLedger, "_write", write_where)
    limit = epsilon(1.0, rate, steps, 1e-5) * (1 + 1e-9)
    sites = [SiteThread(site(0, server.endpoint, require_dp=True, max_epsilon=limit, max_delta=1e-5)).start()]
    sites += [SiteThread(site(i, server.endpoint)).start() for i in (1, 2)]
    with pytest.raises(RunRefused, match="one more step would take this site's records to ε .* above privacy.max_epsilon"):
        sites[0].join(60)
    summaries = [site.join(60) for site in sites[1:]]
    server.join(60)

    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["site_ids"] for r in records] == [["site-0", "site-1", "site-2"]] * 3 + [["site-1", "site-2"]] * 3
    assert all(r["attempt"] == 0 for r in records) and "aborted" not in caplog.text
    # the site's own log has the ε; the server hears the fixed phrase, never the site's records or ε
    assert f"site site-0 leaves the run: {PrivateRefusal.PUBLIC}" in caplog.text
    assert "site site-0 leaves the run: one more step" not in caplog.text
    assert not (config.run_dir / "quarantine.json").exists() and "closing site site-0" not in caplog.text
    assert {s.fingerprint for s in summaries} == {records[-1]["fingerprint"]}
    [entry] = json.loads((state_dir / "0" / "site-0" / LEDGER_FILE).read_text())["entries"]
    assert entry["steps"] == steps, "the refused upload was not counted"
    assert len(on_loop) == 3 + 2 * steps and not any(on_loop)
