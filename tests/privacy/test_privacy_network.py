"""[dp] over gRPC: a real coordinator and sites draw fresh Poisson batches, release only the
noisy dense update and account the same ε, also across a killed coordinator process; hostile
dp fields are refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dadfl.client.config import SiteConfig
from dadfl.trust.run_policy import PrivacyPolicy
from dadfl.privacy.ledger import LEDGER_FILE
from dadfl.trust.run_checks import RunRefused, check_run_config
from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.privacy.accounting import SitePrivacy, epsilon
from dadfl.server.config import ServerConfig
from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from tests.helpers.network import simulate_threads
from tests.trust.test_site_trust import demo_site_config, error_lines, fake_coordinator, run_config, run_site_process, site_toml, write_marker_workload  # noqa: F401 (a fixture)


@pytest.mark.network
def test_sites_draw_fresh_poisson_batches_and_account_the_same_epsilon(tmp_path):
    """Sites (in threads, from the multi-process simulation's config files) draw every upload's
    Poisson batch from the operating system (a replay is a new sample, as the accountant counts
    it); the simulation seeds its draws. Both release the same dense noisy update every step
    and account the same ε."""
    spec = StrategySpec(name="dad")
    config = SimulationConfig(
        workload="digits-mlp", workload_options={"hidden": 16}, sites=3, batch_size=24, steps=6, eval_every=3,
        device="cpu", strategies=[spec], dp={"noise_multiplier": 1.0, "max_grad_norm": 0.5},
    )
    with MetricsWriter(tmp_path / "networked.jsonl") as metrics:
        summary = simulate_threads(config, spec, metrics)
    with MetricsWriter(tmp_path / "memory.jsonl") as metrics:
        reference = simulate(config, spec, metrics)
    networked, in_memory = list(read_metrics(tmp_path / "networked.jsonl")), list(read_metrics(tmp_path / "memory.jsonl"))
    for net, mem in zip(networked, in_memory, strict=True):
        for key in ("step", "sites", "bytes_down", "dp_epsilon"):
            assert net.get(key) == mem.get(key), key
        assert net["fingerprint_mismatches"] == []  # every site applied the coordinator's noisy update
        assert net["fingerprint"] != mem["fingerprint"]  # the coordinator's noise is its own secret, not the simulation's seed
    assert len({r["samples"] for r in networked}) > 1  # Poisson batches
    # About 72 samples a step: six steps drawing the simulation's sizes by chance is below 1e-8.
    assert [r["samples"] for r in networked] != [r["samples"] for r in in_memory], "the sites' draws are not seeded"
    assert summary["dp_epsilon"] == reference["dp_epsilon"] > 0


PUBLIC_DP = {"max_grad_norm": 1.0, "max_sample_rate": 0.1, "noise_multiplier": 1.0, "delta": 1e-5, "epsilon": 3.0, "accountant": "rdp"}


def dp_text(**fields) -> str:
    return json.dumps({**PUBLIC_DP, **fields})


HOSTILE_DP = {
    "not JSON": ("{max_grad_norm", "not valid JSON"),
    "negative norm": (dp_text(max_grad_norm=-1), "max_grad_norm"),
    "NaN rate": (dp_text().replace('"max_sample_rate": 0.1', '"max_sample_rate": NaN'), "max_sample_rate"),
    "rate above 1": (dp_text(max_sample_rate=2), "max_sample_rate"),
    "extra key": (dp_text(noise_seed=0), "noise_seed: Extra inputs"),
    "string norm": (dp_text(max_grad_norm="1"), "max_grad_norm"),
    "infinite sigma": (dp_text().replace('"noise_multiplier": 1.0', '"noise_multiplier": Infinity'), "noise_multiplier"),
    "zero sigma": (dp_text(noise_multiplier=0), "noise_multiplier"),
    "delta of 1": (dp_text(delta=1.0), "delta"),
    "NaN epsilon": (dp_text().replace('"epsilon": 3.0', '"epsilon": NaN'), "epsilon"),
    "unknown accountant": (dp_text(accountant="moments"), "accountant"),
    "no sigma": (json.dumps({k: v for k, v in PUBLIC_DP.items() if k != "noise_multiplier"}), "noise_multiplier: Field required"),
}


@pytest.mark.parametrize("name", list(HOSTILE_DP))
def test_hostile_dp_fields_of_a_run_config_are_refused(name):
    text, message = HOSTILE_DP[name]
    with pytest.raises(RunRefused, match="dp") as refused:
        check_run_config(run_config(dp=text), demo_site_config(), max_chunk_bytes=4 << 20)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_site_refuses_dp_with_a_low_rank_strategy_and_accepts_a_valid_section():
    with pytest.raises(RunRefused, match="cannot give it.*rankdad"):
        check_run_config(run_config(dp=dp_text(), strategy="rankdad"), demo_site_config(), max_chunk_bytes=4 << 20)
    checked = check_run_config(run_config(dp=dp_text()), demo_site_config(), max_chunk_bytes=4 << 20)
    assert checked.privacy == SitePrivacy(**PUBLIC_DP)
    assert check_run_config(run_config(), demo_site_config(), max_chunk_bytes=4 << 20).privacy is None


def floor_site(**policy) -> SiteConfig:
    return demo_site_config().model_copy(update={"privacy": PrivacyPolicy(**policy)})


def test_a_site_refuses_a_run_below_its_privacy_floor_naming_the_setting_and_values():
    """steps=5 at σ=1, q=0.1, δ=1e-5: the site's own RDP ε, not the ε the coordinator states."""
    pytest.importorskip("opacus")
    own = epsilon(1.0, 0.1, 5, 1e-5, "rdp")
    cases = [
        (dict(require_dp=True), "", "privacy.require_dp = true"),
        (dict(require_dp=True, min_noise_multiplier=1.5), dp_text(), "σ = 1 is below privacy.min_noise_multiplier = 1.5"),
        (dict(require_dp=True, max_delta=1e-6), dp_text(), "δ = 1e-05 is above privacy.max_delta = 1e-06"),
        # the coordinator understates its ε: the site's own accountant decides
        (dict(require_dp=True, max_epsilon=own * 0.9, max_delta=1e-5), dp_text(epsilon=own * 0.5), f"ε = {own:.4g} (σ = 1, q = 0.1, 5 steps"),
        (dict(require_dp=True, max_epsilon=own * 0.9, max_delta=1e-5), dp_text(epsilon=own * 0.5, accountant="prv"), "above privacy.max_epsilon"),
        (dict(require_dp=True, max_epsilon=100.0, max_delta=1e-5), dp_text(noise_multiplier=1e-300), "ε = inf (σ = 1e-300"),  # the accountant divides by zero
    ]
    for policy, dp, message in cases:
        with pytest.raises(RunRefused) as refused:
            check_run_config(run_config(dp=dp), floor_site(**policy), max_chunk_bytes=4 << 20)
        assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    meets = floor_site(require_dp=True, min_noise_multiplier=1.0, max_delta=1e-5, max_epsilon=own * 1.01)
    assert check_run_config(run_config(dp=dp_text()), meets, max_chunk_bytes=4 << 20).privacy.noise_multiplier == 1.0
    assert check_run_config(run_config(), floor_site(), max_chunk_bytes=4 << 20).privacy is None  # no floor: no DP needed


def test_a_site_process_below_its_floor_refuses_before_importing_the_workload(tmp_path, fake_coordinator):
    marker = write_marker_workload(tmp_path)
    coordinator, address = fake_coordinator(run_config(workload="marker_wl:build", dp=dp_text(noise_multiplier=0.5)))
    toml = site_toml(tmp_path, address, allowed_workloads=["marker_wl."], privacy={"require_dp": True, "min_noise_multiplier": 0.8})
    result = run_site_process(toml, pythonpath=tmp_path)
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert "σ = 0.5 is below privacy.min_noise_multiplier = 0.8" in line and "Traceback" not in result.stderr
    assert not marker.exists() and coordinator.received == ["hello", "leaving"]


def test_a_privacy_floor_without_require_dp_is_refused_in_the_site_config():
    with pytest.raises(ValidationError, match="max_epsilon would not stop a run without differential privacy: set require_dp"):
        PrivacyPolicy(max_epsilon=3.0)
    with pytest.raises(ValidationError, match="max_delta"):
        PrivacyPolicy(require_dp=True, max_delta=1.0)
    with pytest.raises(ValidationError, match="max_epsilon is a budget at a δ: set max_delta"):
        PrivacyPolicy(require_dp=True, max_epsilon=3.0)
    with pytest.raises(ValidationError, match="min_noise_multiplier"):
        PrivacyPolicy(require_dp=True, min_noise_multiplier=float("nan"))


def test_a_site_whose_rate_exceeds_the_accounted_one_refuses_to_join():
    privacy = SitePrivacy(**PUBLIC_DP)
    assert privacy.site_rate(batch_size=32, num_samples=640) == 0.05
    with pytest.raises(ValueError, match="at least 320 records"):
        privacy.site_rate(batch_size=32, num_samples=100)


@pytest.mark.parametrize(
    "dp,strategy,match",
    [({"noise_multiplier": 1.0}, "dad", "max_sample_rate is required"),
     ({"noise_multiplier": 1.0, "max_sample_rate": 0.1}, "powersgd", "cannot run with \\[dp\\]"),
     ({"noise_multiplier": 1.0, "max_sample_rate": 0.1}, "dsgd:batch=4", "batch_size 4 is too small for \\[dp\\]")],
)
def test_the_coordinator_refuses_a_dp_section_it_cannot_honour(dp, strategy, match):
    name, _, batch = strategy.partition(":batch=")
    with pytest.raises(ValidationError, match=match):
        ServerConfig(dp=dp, strategy={"name": name}, training={"batch_size": int(batch or 32)})


@pytest.mark.slow
@pytest.mark.network
def test_a_killed_private_coordinator_counts_every_release_and_never_reuses_noise(tmp_path):
    """The coordinator is SIGKILLed mid-run and restarted: the release count on disk covers
    every update the sites received (replays included), replayed steps get fresh noise, the
    run stops before passing the ε it planned for its steps, and summary.json states the
    accountant's ε for the count."""
    import re
    import signal
    import subprocess

    from dadfl.audit import verify
    from tests.helpers.network import SiteThread, dadfl_command, free_port, server_config, site_config, write_toml
    from tests.runtime.test_resume_exact import ENV, records, wait_for

    steps, port = 14, free_port()
    server = server_config(
        tmp_path, threads=1, listen={"address": f"127.0.0.1:{port}"}, strategy={"name": "dad"},
        training={"steps": steps, "batch_size": 16, "eval_every": 7, "checkpoint_every": 4},
        federation={"min_sites": 2, "phase_timeout_s": 20, "quorum_timeout_s": 60, "linger_s": 2},
        dp={"noise_multiplier": 1.0, "max_grad_norm": 0.5, "max_sample_rate": 0.1},
    )
    connect = {"max_attempts": 2000, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}
    sites = [site_config(tmp_path, f"site-{i}", f"127.0.0.1:{port}", i, 2, connect=connect, state_dir=str(tmp_path / "sites"))
             for i in range(2)]
    server_toml = write_toml(tmp_path / "server.toml", server.model_dump(mode="json"))
    log_path = tmp_path / "server.log"

    def start_server() -> subprocess.Popen:
        with log_path.open("a") as log:
            return subprocess.Popen(dadfl_command("server", "--config", str(server_toml), "--insecure"), env=ENV, stdout=log, stderr=log)

    process = start_server()
    threads = [SiteThread(config).start() for config in sites]
    try:
        wait_for(lambda: len(records(server.run_dir)) >= 6 or process.poll() is not None, 180, "6 steps")
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        before = {r["step"]: r["fingerprint"] for r in records(server.run_dir)}
        assert 6 <= len(before) < steps, "the kill must come after a checkpoint and before the end"
        process = start_server()
        assert process.wait(180) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    applied = [thread.join(60).steps for thread in threads]  # updates each site received and applied, replays included
    history, log_text = records(server.run_dir), log_path.read_text()
    resumed_at = int(re.search(r"resuming run \w+ at step (\d+)", log_text).group(1))
    replayed = [step for step in before if step >= resumed_at]
    summary = json.loads((server.run_dir / "summary.json").read_text())[0]
    releases = summary["dp_releases"]
    assert json.loads((server.run_dir / "dp_releases.json").read_text()) == {"releases": releases}
    assert releases >= max(applied) and releases >= len(before) + len(history) - resumed_at
    assert summary["dp_epsilon"] == epsilon(1.0, 0.1, releases, 1e-5) == history[-1]["dp_epsilon"]
    assert releases <= steps and summary["dp_epsilon"] <= epsilon(1.0, 0.1, steps, 1e-5)  # the planned ε is a ceiling
    assert [r["step"] for r in history] == list(range(len(history)))
    if replayed:  # the replays spent budget: the run stopped before its last step
        assert len(history) < steps and "stops after" in log_text
        assert all(history[step]["fingerprint"] != before[step] for step in replayed if step < len(history))  # fresh noise
    assert all(history[step]["fingerprint"] == before[step] for step in before if step < resumed_at)
    # Each site's own ledger counted every upload, the replayed ones too: at least one per update it applied.
    for config, count in zip(sites, applied):
        [entry] = json.loads((tmp_path / "sites" / config.site_id / LEDGER_FILE).read_text())["entries"]
        assert entry["steps"] >= count and entry["noise_multiplier"] == 1.0
        # ... and its audit trail recorded each of those uploads, with the count at that upload
        audit = verify(tmp_path / "sites" / config.site_id / "audit.jsonl")
        uploads = [r for r in audit.records if r["event"] == "upload"]
        assert audit.broken is None and [u["dp"]["uploads_counted"] for u in uploads] == list(range(1, entry["steps"] + 1))
        assert {u["dp"]["noise_multiplier"] for u in uploads} == {1.0}


@pytest.mark.network
def test_the_coordinator_stops_before_a_step_would_pass_the_target_epsilon(tmp_path):
    from tests.helpers.network import ServerThread, SiteThread, server_config, site_config

    server_cfg = server_config(
        tmp_path, strategy={"name": "auto"}, training={"steps": 200, "batch_size": 16, "eval_every": 50, "checkpoint_every": 0},
        dp={"noise_multiplier": 1.5, "target_epsilon": 1.0, "max_sample_rate": 0.05},
    )
    server = ServerThread(server_cfg).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, 2)).start() for i in range(2)]
    server.join()
    summaries = [site.join() for site in sites]
    history = list(read_metrics(server_cfg.run_dir / "metrics.jsonl"))
    summary = json.loads((server_cfg.run_dir / "summary.json").read_text())[0]
    steps = len(history)
    assert 0 < steps < 200 and summary["dp_releases"] == steps
    assert summary["dp_epsilon"] <= 1.0 < epsilon(1.5, 0.05, steps + 1, 1e-5)
    assert history[-1]["dp_epsilon"] == summary["dp_epsilon"]
    assert all("finished" in s.finished for s in summaries)  # the sites heard the run end
    assert {s.fingerprint for s in summaries} == {history[-1]["fingerprint"]}


@pytest.mark.network
def test_a_step_whose_release_was_aborted_at_the_ceiling_is_not_retried(tmp_path, monkeypatch):
    """The last release the ε ceiling allows goes out, then a site is lost before its done:
    the coordinator stops before a retry would release again (ServerPrivacy.release does not
    check: the sites would already have uploaded, and counted, the retry)."""
    import dadfl.client.site as site_module
    from dadfl.client.site import GaveUp
    from dadfl.server.coordinator import RunStopped
    from tests.helpers.network import ServerThread, SiteThread, server_config, site_config
    from tests.runtime.test_network_dropout import at_phase_message, flaky_session

    steps = 3
    monkeypatch.setattr(site_module, "Session", flaky_session("site-1", at_phase_message(steps - 1, 0)))
    config = server_config(
        tmp_path, strategy={"name": "dsgd"}, training={"steps": steps, "batch_size": 16, "eval_every": steps, "checkpoint_every": 0},
        federation={"min_sites": 2, "initial_sites": 2, "phase_timeout_s": 20, "quorum_timeout_s": 20},
        dp={"noise_multiplier": 1.0, "max_grad_norm": 0.5, "max_sample_rate": 0.05},
    )
    server = ServerThread(config).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, 2, connect={"max_attempts": 2})).start() for i in range(2)]
    with pytest.raises(RunStopped, match=f"step {steps - 1} cannot be retried: one more step would take ε above"):
        server.join(60)
    for site in sites:
        with pytest.raises(GaveUp):
            site.join(60)
    assert json.loads((config.run_dir / "dp_releases.json").read_text()) == {"releases": steps}
    assert [r["step"] for r in read_metrics(config.run_dir / "metrics.jsonl")] == list(range(steps - 1))
