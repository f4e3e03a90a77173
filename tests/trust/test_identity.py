"""Mutual TLS and revocation on loopback: site certificates from `dadfl enroll --cert`,
bound to site ids; revoked sites refused at join and dropped while connected."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from dadfl.cli import app
from dadfl.client.site import GaveUp, SiteRefused, run_site
from dadfl.metrics import read_metrics
from dadfl.server.certs import issue_site_certificate, make_dev_certs
from dadfl.server.enrol import enroll, revoke
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config, write_toml


def tls_site(tmp, certs, site_id, endpoint, index, sites, token, cert=None):
    """A site config over TLS; ``cert``: (certificate, key) paths for mutual TLS."""
    identity = {"client_cert": str(cert[0]), "client_key": str(cert[1])} if cert else {}
    return site_config(tmp, site_id, endpoint, index, sites, token=token, connect={"ca_cert": str(certs["ca.pem"]), "max_attempts": 2, **identity})


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    """A coordinator that requires client certificates; a, b and c enrolled with certificates."""
    tmp = tmp_path_factory.mktemp("mtls")
    certs = make_dev_certs(tmp / "certs")
    config = server_config(
        tmp,
        listen={"tls_cert": str(certs["server.pem"]), "tls_key": str(certs["server.key"]), "client_ca": str(certs["ca.pem"]), "require_client_cert": True},
        training={"steps": 2},
        federation={"min_sites": 1, "quorum_timeout_s": 60, "linger_s": 0},
    )
    issued = {}
    for name in ("a", "b", "c"):
        cert, key, serial = issue_site_certificate(tmp / "certs", name, tmp / "sites")
        issued[name] = (cert, key, enroll(tmp / "tokens.json", name, cert_serial=serial))
    server = ServerThread(config, insecure=False).start()
    yield tmp, certs, issued, server


@pytest.mark.network
def test_site_without_a_certificate_is_refused_by_tls(mtls):
    tmp, certs, issued, server = mtls
    with pytest.raises(GaveUp, match="2 attempts to reach the coordinator.*Socket closed; if the coordinator requires client certificates.*set connect.client_cert"):
        run_site(tls_site(tmp, certs, "a", server.endpoint, 0, 1, token=issued["a"][2]))


@pytest.mark.network
def test_certificate_of_another_site_is_refused_with_the_reason(mtls):
    tmp, certs, issued, server = mtls
    config = tls_site(tmp, certs, "a", server.endpoint, 0, 1, cert=issued["b"][:2], token=issued["a"][2])
    with pytest.raises(SiteRefused, match="the client certificate names 'b', not site 'a'"):
        run_site(config)


@pytest.mark.network
def test_certificate_from_another_ca_is_refused_by_tls(mtls, tmp_path):
    tmp, certs, issued, server = mtls
    other = make_dev_certs(tmp_path / "other")
    cert = issue_site_certificate(tmp_path / "other", "a", tmp_path / "other-sites")
    assert other["ca.pem"].exists()
    with pytest.raises(GaveUp, match="check that connect.client_cert was issued by its CA"):
        run_site(tls_site(tmp, certs, "a", server.endpoint, 0, 1, cert=cert[:2], token=issued["a"][2]))


@pytest.mark.network
def test_revoked_site_and_replaced_certificate_are_refused(mtls):
    tmp, certs, issued, server = mtls
    revoke(tmp / "tokens.json", "c")
    with pytest.raises(SiteRefused, match="'c' was revoked on this server"):
        run_site(tls_site(tmp, certs, "c", server.endpoint, 0, 1, cert=issued["c"][:2], token=issued["c"][2]))
    # b is enrolled again with a new certificate: its old certificate is revoked, even with the new token
    _, _, serial = issue_site_certificate(tmp / "certs", "b", tmp / "sites-new")
    token = enroll(tmp / "tokens.json", "b", replace=True, cert_serial=serial)
    with pytest.raises(SiteRefused, match=r"the certificate of site 'b' \(serial [0-9a-f]+\) was revoked"):
        run_site(tls_site(tmp, certs, "b", server.endpoint, 0, 1, cert=issued["b"][:2], token=token))


@pytest.mark.network
def test_site_with_its_own_certificate_trains(mtls):
    tmp, certs, issued, server = mtls
    summary = SiteThread(tls_site(tmp, certs, "a", server.endpoint, 0, 1, cert=issued["a"][:2], token=issued["a"][2]), insecure=False).start().join()
    server.join()
    records = list(read_metrics(tmp / "run" / "metrics.jsonl"))
    assert summary.steps == 2 and summary.fingerprint == records[-1]["fingerprint"]


def test_enroll_cert_and_revoke_commands(tmp_path):
    certs = make_dev_certs(tmp_path / "certs")
    server_toml = write_toml(tmp_path / "server.toml", {"listen": {"address": "127.0.0.1:50051", "tokens": str(tmp_path / "tokens.json")}})
    runner = CliRunner()
    result = runner.invoke(app, ["enroll", "hospital-a", "--config", str(server_toml), "--cert", "--ca-dir", str(tmp_path / "certs"),
                                 "--cert-out", str(tmp_path / "issued")])
    assert result.exit_code == 0, result.output
    assert 'client_cert = "certs/hospital-a.pem"' in result.output and 'client_key = "certs/hospital-a.key"' in result.output
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "issued" / "hospital-a.pem").read_bytes())
    assert cert.issuer == x509.load_pem_x509_certificate(certs["ca.pem"].read_bytes()).subject
    enrolment = json.loads((tmp_path / "tokens.json").read_text())
    assert enrolment["sites"]["hospital-a"]["cert_serial"] == f"{cert.serial_number:x}"
    result = runner.invoke(app, ["enroll", "--revoke", "hospital-a", "--config", str(server_toml)])
    assert result.exit_code == 0, result.output
    enrolment = json.loads((tmp_path / "tokens.json").read_text())
    assert "hospital-a" not in enrolment["sites"]
    assert enrolment["revoked"][0]["cert_serial"] == f"{cert.serial_number:x}"
    result = runner.invoke(app, ["enroll", "b", "--config", str(server_toml), "--cert", "--ca-dir", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "ca.pem does not exist" in result.output


@pytest.mark.network
def test_connected_site_is_dropped_at_its_next_upload_once_revoked(tmp_path):
    server = ServerThread(server_config(tmp_path, training={"steps": 400, "eval_every": 400, "checkpoint_every": 0},
                                       federation={"min_sites": 1, "initial_sites": 2, "linger_s": 0})).start()
    stays = SiteThread(site_config(tmp_path, "stays", server.endpoint, 0, 2)).start()
    revoked = SiteThread(site_config(tmp_path, "revoked", server.endpoint, 1, 2)).start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "run" / "metrics.jsonl").exists() or len(list(read_metrics(tmp_path / "run" / "metrics.jsonl"))) < 5:
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.05)
    revoke(tmp_path / "tokens.json", "revoked")
    with pytest.raises(SiteRefused, match="'revoked' was revoked on the server"):
        revoked.join(60)
    summary = stays.join(120)
    server.join()
    records = list(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert records[-1]["site_ids"] == ["stays"] and len(records) == 400
    assert summary.finished and summary.fingerprint == records[-1]["fingerprint"]
