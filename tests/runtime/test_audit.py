"""Audit trails: hash-chained lines that ``dadfl audit verify`` checks, written by real
sites and a real coordinator over loopback gRPC."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dadfl.audit import AuditError, AuditLog, verify
from dadfl.cli import app
from dadfl.trust.run_checks import RunRefused
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config


def test_a_changed_removed_or_cut_line_breaks_the_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for step in range(4):
        log.append("upload", step=step, bytes=100)
    intact = path.read_bytes()
    assert verify(path).broken is None and verify(path).lines == 4

    lines = intact.splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1].replace(b'"bytes":100', b'"bytes":10') + b"".join(lines[2:]))
    assert verify(path).broken.startswith("line 2 was changed") and verify(path).lines == 1
    path.write_bytes(b"".join(lines[:1] + lines[2:]))
    assert verify(path).broken.startswith("line 2 has seq 2")
    path.write_bytes(intact[:-5])
    assert "line 4 is cut short" in verify(path).broken
    with pytest.raises(AuditError, match="cut line"):
        log.append("upload", step=4)  # nothing more is added to a damaged trail


def test_appends_from_two_writers_and_after_an_archived_file_keep_one_chain_each(tmp_path):
    """The log remembers the chain's end it wrote last: another writer's lines (the coordinator
    and an operator's command share a file), a long line and a file archived and started anew
    must each be noticed, never chained over."""
    path = tmp_path / "audit.jsonl"
    coordinator, operator = AuditLog(path), AuditLog(path)
    coordinator.append("run", action="started")
    operator.append("operator", command="stop", note="x" * 20_000)  # longer than the first piece of tail read
    coordinator.append("run", action="stopped")
    operator.append("operator", command="status")
    checked = verify(path)
    assert checked.broken is None and [r["event"] for r in checked.records] == ["run", "operator", "run", "operator"]
    path.rename(tmp_path / "archived.jsonl")
    coordinator.append("run", action="started")
    assert [r["seq"] for r in verify(path).records] == [0] and verify(path).broken is None
    assert verify(tmp_path / "archived.jsonl").lines == 4


def test_audit_verify_command_prints_the_summary_and_finds_a_tampered_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append("workload", run_id="r1", workload="digits-mlp", strategy="dsgd", decision="allowed", code={"module": "m", "file_sha256": "ab" * 32})
    for step in range(3):
        log.append("upload", run_id="r1", coordinator="fl.example.org:50051", step=step, bytes=1000,
                   tensors=[{"layer": "0", "role": "activations", "shape": [16, 64], "bytes": 1000}])
    result = CliRunner().invoke(app, ["audit", "verify", str(path)])
    assert result.exit_code == 0, result.output
    assert "run r1: 3 uploads to fl.example.org:50051" in result.stdout and "steps 0..2, 3,000 bytes" in result.stdout
    assert "activations of 1 layer (0)" in result.stdout and "chain intact" in result.stdout

    text = path.read_text().replace('"step":1', '"step":7')
    path.write_text(text)
    result = CliRunner().invoke(app, ["audit", "verify", str(path)])
    assert result.exit_code == 1 and "line 3 was changed after it was written" in result.output


@pytest.mark.network
def test_sites_and_the_coordinator_record_what_left_and_who_took_part(tmp_path):
    config = server_config(tmp_path, training={"steps": 3, "eval_every": 3, "checkpoint_every": 0}, federation={"min_sites": 2, "linger_s": 0})
    server = ServerThread(config).start()
    sites = [site_config(tmp_path, f"site-{i}", server.endpoint, i, 2, state_dir=str(tmp_path / f"state-{i}")) for i in range(2)]
    refused = site_config(tmp_path, "site-r", server.endpoint, 0, 2, state_dir=str(tmp_path / "state-r"), allowed_workloads=["digits-cnn"])
    threads = [SiteThread(site).start() for site in [*sites, refused]]
    for thread in threads[:2]:
        thread.join(120)
    with pytest.raises(RunRefused):
        threads[2].join(120)
    server.join(120)

    records = verify(tmp_path / "state-0" / "site-0" / "audit.jsonl").records
    decision, *uploads = records
    assert decision["event"] == "workload" and decision["decision"] == "allowed" and decision["workload"] == "digits-mlp"
    assert decision["code"]["module"] == "dadfl.workloads.digits" and len(decision["code"]["file_sha256"]) == 64
    assert [u["step"] for u in uploads] == [0, 1, 2] and {u["coordinator"] for u in uploads} == {server.endpoint}
    assert {t["role"] for u in uploads for t in u["tensors"]} == {"gradients"}  # dsgd sends gradients
    assert all(u["bytes"] == sum(t["bytes"] for t in u["tensors"]) > 0 for u in uploads)

    refusal = verify(tmp_path / "state-r" / "site-r" / "audit.jsonl").records
    assert [(r["event"], r["decision"]) for r in refusal] == [("workload", "refused")] and refusal[0]["code"] == {}
    assert "allowed_workloads" in refusal[0]["reason"]

    coordinator = verify(config.run_dir / "audit.jsonl")
    assert coordinator.broken is None
    events = [(r["event"], r.get("site"), r.get("action")) for r in coordinator.records]
    assert events[0] == ("run", None, "started") and events[-1] == ("run", None, "finished")
    assert {("join", "site-0", None), ("join", "site-1", None)} <= set(events)
    for path in (tmp_path / "state-0" / "site-0" / "audit.jsonl", config.run_dir / "audit.jsonl"):
        text = path.read_text()
        assert sites[0].token not in text and "inputs" not in text  # no token, no data
    assert json.loads((tmp_path / "state-0" / "site-0" / "audit.jsonl").read_text().splitlines()[0])["prev"] == "0" * 64
