"""Enrolment: tokens issued once, only hashes stored; unknown sites and bad tokens refused."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import threading
import tomllib

import grpc
import pytest
from typer.testing import CliRunner

import dadfl.server.enrol as enrol_module
from dadfl.cli import app
from dadfl.client.config import SiteConfig
from dadfl.client.site import SiteRefused, run_site
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos import coordinator_pb2_grpc as cpb_grpc
from dadfl.protos.channel import PROTOCOL_VERSION
from dadfl.server.coordinator import RunStopped
from dadfl.server.enrol import (
    MAX_TOKENS_FILE_BYTES, Enrolment, EnrolmentError, check_tokens_file, enroll, read_enrolment, token_hash, verify, write_tokens,
)
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config


def test_token_file_holds_only_hashes(tmp_path):
    path = tmp_path / "tokens.json"
    token = enroll(path, "hospital-a")
    text = path.read_text()
    assert token not in text and "hospital-a" in text
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    verify(read_enrolment(path), "hospital-a", token)
    with pytest.raises(EnrolmentError, match="wrong token"):
        verify(read_enrolment(path), "hospital-a", token + "x")
    with pytest.raises(EnrolmentError, match="not enrolled"):
        verify(read_enrolment(path), "hospital-b", token)


def test_enrolling_twice_needs_replace_and_revokes_the_old_token(tmp_path):
    path = tmp_path / "tokens.json"
    old = enroll(path, "a")
    with pytest.raises(ValueError, match="already enrolled"):
        enroll(path, "a")
    new = enroll(path, "a", replace=True)
    verify(read_enrolment(path), "a", new)
    with pytest.raises(EnrolmentError):
        verify(read_enrolment(path), "a", old)


def test_an_oversized_token_file_is_refused(tmp_path):
    path = tmp_path / "tokens.json"
    token = enroll(path, "a")
    with path.open("a") as file:  # still JSON: only its size is wrong
        file.write(" " * MAX_TOKENS_FILE_BYTES)
    with pytest.raises(ValueError, match="over 16 MiB"):
        read_enrolment(path)
    path.write_text(path.read_text().strip())
    verify(read_enrolment(path), "a", token)


def test_bad_site_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match="site id"):
        enroll(tmp_path / "t.json", "../evil")
    with pytest.raises(ValueError, match="site id"):
        enroll(tmp_path / "t.json", "site\n")  # "$" in a re.match pattern would let it through


def test_enroll_command_prints_a_valid_site_config(tmp_path):
    server_toml = tmp_path / "server.toml"
    server_toml.write_text(f'[listen]\naddress = "0.0.0.0:50051"\ntokens = "{tmp_path / "tokens.json"}"\n')
    result = CliRunner().invoke(app, ["enroll", "hospital-a", "--config", str(server_toml), "--address", "fl.example.org:50051"])
    assert result.exit_code == 0, result.output
    site = SiteConfig.model_validate(tomllib.loads(result.output))
    assert site.site_id == "hospital-a" and site.connect.server == "fl.example.org:50051"
    verify(read_enrolment(tmp_path / "tokens.json"), "hospital-a", site.token)
    assert "sha256" in json.loads((tmp_path / "tokens.json").read_text())["sites"]["hospital-a"]


def test_enroll_demo_share_gives_a_partition_and_bad_shares_are_refused(tmp_path):
    server_toml = tmp_path / "server.toml"
    server_toml.write_text(f'[listen]\naddress = "0.0.0.0:50051"\ntokens = "{tmp_path / "tokens.json"}"\n')
    result = CliRunner().invoke(app, ["enroll", "b", "--config", str(server_toml), "--demo-share", "1/3"])
    assert result.exit_code == 0, result.output
    site = SiteConfig.model_validate(tomllib.loads(result.output))
    assert (site.data.source, site.data.site_index, site.data.num_sites) == ("partition", 1, 3)
    result = CliRunner().invoke(app, ["enroll", "c", "--config", str(server_toml), "--demo-share", "3/3"])
    assert result.exit_code == 2 and "INDEX/COUNT" in result.output
    assert "c" not in json.loads((tmp_path / "tokens.json").read_text())["sites"], "a refused enrolment stores nothing"


def test_enroll_writes_the_label_column_and_the_held_out_data(tmp_path):
    server_toml = tmp_path / "server.toml"
    server_toml.write_text(f'[listen]\naddress = "0.0.0.0:50051"\ntokens = "{tmp_path / "tokens.json"}"\n')

    def enrolled(site_id: str, *options: str) -> SiteConfig:
        result = CliRunner().invoke(app, ["enroll", site_id, "--config", str(server_toml), "--data", f"{site_id}.csv", *options])
        assert result.exit_code == 0, result.output
        return SiteConfig.model_validate(tomllib.loads(result.output))

    site = enrolled("a", "--target-column", "diagnosis", "--held-out", "a-test.csv")
    assert (site.data.target_column, str(site.evaluation.path), site.evaluation.fraction) == ("diagnosis", "a-test.csv", None)
    site = enrolled("b", "--held-out", "0.3")
    assert (site.data.target_column, site.evaluation.fraction) == ("target", 0.3)
    assert enrolled("c", "--held-out", "none").evaluation is None
    assert enrolled("d").evaluation.fraction == 0.2  # the default
    for options, message in ((["--held-out", "1.5"], "strictly between 0 and 1"),
                             (["--demo-share", "0/2", "--target-column", "y"], "--target-column names the label column")):
        result = CliRunner().invoke(app, ["enroll", "e", "--config", str(server_toml), *options])
        assert result.exit_code == 2 and message in result.output, result.output
    assert "e" not in json.loads((tmp_path / "tokens.json").read_text())["sites"]


@pytest.mark.network
def test_unknown_sites_and_bad_tokens_are_refused_and_the_run_goes_on(tmp_path):
    server = ServerThread(server_config(tmp_path, training={"steps": 2}, federation={"min_sites": 1})).start()
    good = site_config(tmp_path, "good", server.endpoint, 0, 1)
    with pytest.raises(SiteRefused, match="'stranger' is not enrolled on this server; run `dadfl enroll stranger`"):
        run_site(SiteConfig.model_validate({**good.model_dump(), "site_id": "stranger"}), insecure=True)
    with pytest.raises(SiteRefused, match="wrong token for site 'good'"):
        run_site(SiteConfig.model_validate({**good.model_dump(), "token": "x" * 43}), insecure=True)
    summary = SiteThread(good).start().join()
    server.join()
    assert summary.steps == 2


def test_a_running_coordinator_sees_a_re_enrolment_of_the_same_size_in_the_same_clock_tick(tmp_path):
    """The token file is replaced on every write: a new version is seen even when its size and
    modification time equal the old one's (a fast `enroll --replace`)."""
    path = tmp_path / "tokens.json"
    enroll(path, "hospital-a")
    enrolment = Enrolment(path)
    joined_with = asyncio.run(enrolment.for_join()).sites["hospital-a"]["sha256"]
    assert asyncio.run(enrolment.revocation("hospital-a", joined_with)) is None
    before = path.stat()
    enroll(path, "hospital-a", replace=True)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert "enrolled again" in asyncio.run(enrolment.revocation("hospital-a", joined_with))


def first_answer(endpoint: str, site_id: str, token: str) -> cpb.ServerMessage:
    """What the coordinator answers a hello: the run config, or ``closing`` with the refusal."""
    hello = cpb.SiteMessage(hello=cpb.Hello(site_id=site_id, token=token, protocol_version=PROTOCOL_VERSION))
    with grpc.insecure_channel(endpoint) as channel:
        return next(cpb_grpc.CoordinatorStub(channel).Join(iter([hello])))


@pytest.mark.network
def test_joins_share_one_reading_of_the_token_file_until_an_edit_which_the_next_join_sees(tmp_path, monkeypatch):
    """Admitting N sites reads the token file once, in a worker thread (not on the event loop
    every stream shares); an edit in place (same inode) takes effect at the next join."""
    config = server_config(tmp_path, federation={"min_sites": 1, "quorum_timeout_s": 6})
    path = config.listen.tokens
    old_token = enroll(path, "hospital-a")
    server = ServerThread(config).start()
    readers = []

    def read_enrolment_counted(file):
        readers.append(threading.current_thread())
        return read_enrolment(file)

    monkeypatch.setattr(enrol_module, "read_enrolment", read_enrolment_counted)
    for _ in range(4):
        assert first_answer(server.endpoint, "hospital-a", old_token).WhichOneof("kind") == "config"
    assert len(readers) == 1 and server._thread not in readers

    new_token, b_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    tokens = json.loads(path.read_text())
    tokens["sites"]["hospital-a"]["sha256"] = token_hash(new_token)
    tokens["sites"]["hospital-b"] = {"sha256": token_hash(b_token)}
    inode = path.stat().st_ino
    with path.open("r+") as file:  # edited where it is, as an operator's editor may
        file.write(json.dumps(tokens))
        file.truncate()
    assert path.stat().st_ino == inode
    refused = first_answer(server.endpoint, "hospital-a", old_token)
    assert refused.WhichOneof("kind") == "closing" and "wrong token for site 'hospital-a'" in refused.closing.reason
    assert first_answer(server.endpoint, "hospital-a", new_token).WhichOneof("kind") == "config"
    assert first_answer(server.endpoint, "hospital-b", b_token).WhichOneof("kind") == "config"
    assert len(readers) == 2 and server._thread not in readers
    with pytest.raises(RunStopped, match="only 0 of the 1 sites needed"):
        server.join(30)


def test_a_token_file_deleted_while_the_server_runs_is_never_read_as_no_sites(tmp_path, monkeypatch):
    """Deleted between the check for a change and the read, the file refuses joins with the
    error a missing file gives at start, and a connected site keeps the last good reading (not
    "revoked"); a file that revokes every site is read as that."""
    path = tmp_path / "tokens.json"
    enroll(path, "hospital-a")
    enrolment = Enrolment(path)
    joined_with = asyncio.run(enrolment.for_join()).sites["hospital-a"]["sha256"]
    enroll(path, "hospital-b")  # a new version, which the next join reads

    def deleted_before_the_read(file):
        file.unlink()
        return read_enrolment(file)

    with monkeypatch.context() as patch:
        patch.setattr(enrol_module, "read_enrolment", deleted_before_the_read)
        with pytest.raises(ValueError) as raced:
            asyncio.run(enrolment.for_join())
    missing = f"{path} does not exist; enrol the sites first"
    assert str(raced.value).startswith(missing), raced.value
    with pytest.raises(ValueError) as at_start:
        check_tokens_file(path)
    assert str(at_start.value) == f"listen.tokens: {raced.value}"
    with pytest.raises(ValueError, match=f"^{re.escape(str(raced.value))}$"):  # still missing: the same error from the stat
        asyncio.run(enrolment.for_join())
    assert asyncio.run(enrolment.revocation("hospital-a", joined_with)) is None
    assert asyncio.run(enrolment.site_ids()) == ["hospital-a"]

    write_tokens(path, {}, [{"site": "hospital-a", "revoked": "now"}])  # every site revoked
    assert asyncio.run(enrolment.for_join()).sites == {}
    assert "was revoked" in asyncio.run(enrolment.revocation("hospital-a", joined_with))
