"""TLS by default: a site that trusts the dev CA trains; untrusted or plain-text peers cannot."""

from __future__ import annotations

import pytest

from dadfl.client.site import GaveUp, SiteRefused, run_site
from dadfl.server.coordinator import StoppedByOperator
from dadfl.metrics import read_metrics
from dadfl.server.certs import make_dev_certs
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """One TLS coordinator (dev certs) for a two-step run with a single site."""
    tmp = tmp_path_factory.mktemp("tls")
    certs = make_dev_certs(tmp / "certs", ("coordinator",))
    config = server_config(
        tmp,
        listen={"tls_cert": str(certs["server.pem"]), "tls_key": str(certs["server.key"])},
        training={"steps": 2},
        federation={"min_sites": 1, "quorum_timeout_s": 60},
    )
    server = ServerThread(config, insecure=False).start()
    yield tmp, certs, server


@pytest.mark.network
@pytest.mark.parametrize("wrong", ["ca_cert", "tls_server_name"])
def test_site_with_an_untrusted_ca_or_name_stops_at_once_saying_so(tls_server, tmp_path, wrong):
    """A certificate that does not verify fails the same way every time: no retries."""
    tmp, certs, server = tls_server
    connect = {"ca_cert": str(certs["ca.pem"]), "tls_server_name": "coordinator", "max_attempts": 5,
               "backoff_initial_s": 30}  # a retry would take the test past its timeout
    connect[wrong] = str(make_dev_certs(tmp_path / "other")["ca.pem"]) if wrong == "ca_cert" else "elsewhere"
    with pytest.raises(SiteRefused, match="TLS handshake with .* failed .* check that the coordinator serves TLS, that connect.ca_cert"):
        run_site(site_config(tmp, "mallory", server.endpoint, 0, 1, connect=connect))


@pytest.mark.network
def test_plain_text_site_cannot_talk_to_a_tls_server(tls_server):
    tmp, _, server = tls_server
    config = site_config(tmp, "plain", server.endpoint, 0, 1, connect={"max_attempts": 2})
    with pytest.raises(GaveUp):
        run_site(config, insecure=True)


@pytest.mark.network
def test_site_without_ca_must_say_insecure(tls_server):
    tmp, _, server = tls_server
    with pytest.raises(SiteRefused, match="set connect.ca_cert"):
        run_site(site_config(tmp, "no-ca", server.endpoint, 0, 1))


@pytest.mark.network
def test_site_trusting_the_dev_ca_trains_over_tls(tls_server):
    tmp, certs, server = tls_server
    # the certificate names the compose service too; the site dials 127.0.0.1 and expects that name
    config = site_config(tmp, "hospital-a", server.endpoint, 0, 1, connect={"ca_cert": str(certs["ca.pem"]), "tls_server_name": "coordinator"})
    summary = SiteThread(config, insecure=False).start().join()
    server.join()
    records = list(read_metrics(tmp / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1]
    assert summary.steps == 2 and summary.fingerprint == records[-1]["fingerprint"]


def test_server_refuses_to_start_without_certificates_unless_insecure(tmp_path):
    config = server_config(tmp_path)
    with pytest.raises(ValueError, match="--insecure"):
        config.require_tls()


@pytest.mark.network
def test_a_second_coordinator_cannot_listen_on_a_port_in_use(tmp_path):
    """gRPC shares ports by default (SO_REUSEPORT): two coordinators would split the sites between them."""
    (tmp_path / "first").mkdir()
    first = ServerThread(server_config(tmp_path / "first", federation={"min_sites": 1})).start()  # waits for a site
    second = ServerThread(server_config(tmp_path, listen={"address": first.endpoint}))
    with pytest.raises(OSError, match="is the port taken"):
        second.start()
    first.stop()
    with pytest.raises(StoppedByOperator):
        first.join(30)
