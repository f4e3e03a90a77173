"""An enrolled malicious site cannot crash, stop or poison a federation.

One run per strategy: a coordinator, two honest sites as real processes, and a malicious
site (enrolled, with a real token, speaking the real protocol from this process) that
computes genuine payloads and sends, step after step, one attack each. It is dropped at
every refusal, rejoins, and goes on until the coordinator quarantines it. Every honest
site must exit 0, the run must complete, and the final accuracy must be within one point
of the same two honest sites without it (the in-process simulation, which the networked
runtime matches bit for bit).
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import grpc
import pytest
import torch

import dadfl.client.site as site_module
from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.replica import OptimizerConfig
from dadfl.server.enrol import enroll
from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from dadfl.strategies import Payload
from dadfl.strategies.base import split_key
from dadfl.client.config import SiteConfig
from tests.helpers.network import ServerThread, SiteThread, server_config, write_toml

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process

MALICIOUS = "mallory"
STEPS = 60
BATCH = 16
LR = 0.05
WORKLOAD = {"spec": "breast-cancer-mlp", "options": {"hidden": 16}}
QUARANTINE_AFTER = 10  # one full cycle of attacks, then quarantine


def floats(payload: Payload, change) -> Payload:
    tensors = {k: change(k, t) if t.is_floating_point() else t for k, t in payload.tensors.items()}
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)


def random_bytes(payload):
    generator = torch.Generator().manual_seed(payload.step)
    return floats(payload, lambda k, t: torch.randint(-(2**31), 2**31 - 1, t.shape, dtype=torch.int32, generator=generator).view(torch.float32))


def bit_flip(payload):
    key = max((k for k, t in payload.tensors.items() if t.is_floating_point()), key=lambda k: payload.tensors[k].numel())
    values = payload.tensors[key].clone()
    bits = values.view(torch.int32)
    bits.view(-1)[int(values.abs().argmax())] ^= 1 << 30  # the exponent's top bit of the largest entry
    return Payload(payload.step, payload.phase, payload.num_samples, {**payload.tensors, key: bits.view(torch.float32)})


def times_1e6(payload):
    return floats(payload, lambda k, t: t * 1e6)


def sign_flip(payload):
    return floats(payload, lambda k, t: -t if split_key(k)[1] in ("grad", "D", "P") else t)


def factors_1e30(payload):
    return floats(payload, lambda k, t: torch.where(t < 0, -1e30, 1e30).to(t.dtype))


def first_key(payload, roles):
    return next((k for k in payload.tensors if split_key(k)[1] in roles), None)


def inconsistent_ranks(payload):
    """P one rank wider than Q; without P/Q, A one row short of D; else a gradient cut short."""
    tensors = dict(payload.tensors)
    if (key := first_key(payload, ("P",))) is not None:
        tensors[key] = torch.cat([tensors[key], tensors[key][..., :1]], dim=-1)
    elif (key := first_key(payload, ("A",))) is not None:
        tensors[key] = tensors[key][:, :-1]
    else:
        key = first_key(payload, ("grad",))
        tensors[key] = tensors[key].reshape(-1)[:-1]
    return Payload(payload.step, payload.phase, payload.num_samples, tensors)


def missing_key(payload):
    key = first_key(payload, ("A", "P", "Q")) or first_key(payload, ("grad",))
    return Payload(payload.step, payload.phase, payload.num_samples, {k: t for k, t in payload.tensors.items() if k != key})


def wrong_rows(payload):
    return Payload(payload.step, payload.phase, payload.num_samples - 1, payload.tensors)


ATTACKS = {
    "random bytes": random_bytes,
    "bit flip": bit_flip,
    "genuine x1e6": times_1e6,
    "sign flip": sign_flip,
    "1e30 factors": factors_1e30,
    "inconsistent ranks": inconsistent_ranks,
    "missing key": missing_key,
    "NaN loss": lambda payload: payload,  # the loss is replaced in the header
    "wrong row count": wrong_rows,
}
# Within honest bounds, so not detectable: a sign flip at honest magnitude is one honest-
# sized contribution; num_samples off by one is detectable only where rows travel.
UNDETECTABLE = {"sign flip"}
ROWS_TRAVEL = {"dad", "edad"}  # auto sends this small model's layers as (smaller) dense gradients
# A dense gradient left out means "no gradient at this site" (a parameter its batch did not
# reach): it adds nothing, as zeros would, so it is allowed where only gradients travel
# (auto on this small model; PowerSGD's dense warm-up steps).
ONLY_GRADIENTS = {"dsgd", "auto", "powersgd", "fedavg"}


@dataclass
class Ledger:
    order: list[str] = field(default_factory=lambda: list(ATTACKS))
    sent: int = 0
    pending: str | None = None
    refused: dict[str, str] = field(default_factory=dict)
    accepted: set[str] = field(default_factory=set)
    quarantined: str = ""


class MaliciousSession(site_module.Session):
    ledger: Ledger

    def upload(self, payload, loss_sum=0.0):
        if self.site.config.site_id != MALICIOUS:  # honest sites in threads of this process
            return super().upload(payload, loss_sum)
        ledger = MaliciousSession.ledger
        if payload.phase == 0:
            if ledger.pending is not None:
                ledger.accepted.add(ledger.pending)
            name = ledger.order[ledger.sent] if ledger.sent < len(ledger.order) else "1e30 factors"
            ledger.sent += 1
            ledger.pending = name
        name = ledger.pending
        payload = ATTACKS[name](payload)
        super().upload(payload, math.nan if name == "NaN loss" else loss_sum)


def attack(site: site_module.Site, ledger: Ledger) -> None:
    """Rejoin after every refusal until quarantined or the run is over."""
    for _ in range(200):
        try:
            if asyncio.run(site.join(insecure=True)):
                return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                ledger.quarantined = exc.details()
                return
            if ledger.pending is not None:
                ledger.refused.setdefault(ledger.pending, exc.details())
                ledger.pending = None


STRATEGIES = [
    StrategySpec(name="dsgd"),
    StrategySpec(name="dad"),
    StrategySpec(name="auto"),
    StrategySpec(name="edad"),
    StrategySpec(name="rankdad", options={"rank": 2}),
    StrategySpec(name="rankdad", options={"rank": 2, "reduce_on_server": True}),
    StrategySpec(name="powersgd", options={"rank": 1, "start_iter": 2}),
    StrategySpec(name="fedavg", options={"local_steps": 2}),  # model deltas; samples bounded by 2 batches
]


def honest_site(tmp_path, index: int, endpoint: str, process: bool):
    """An honest site: a ``dadfl site`` process, or ``run_site`` in a thread of this one."""
    site_id = f"site-{index}"
    config = {
        "site_id": site_id, "token": enroll(tmp_path / "tokens.json", site_id), "device": "cpu", "threads": 1,
        "connect": {"server": endpoint, "backoff_initial_s": 0.1, "max_attempts": 5},
        "data": {"source": "partition", "site_index": index, "num_sites": 2},
    }
    if not process:
        return SiteThread(SiteConfig.model_validate(config)).start()
    toml = write_toml(tmp_path / f"{site_id}.toml", config)
    with (tmp_path / f"{site_id}.log").open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "dadfl.client", "--config", str(toml), "--insecure"], stdout=log, stderr=subprocess.STDOUT)


def finish(site, tmp_path, index: int) -> None:
    """Wait for an honest site; it must end cleanly (exit 0 for a process)."""
    if isinstance(site, SiteThread):
        summary = site.join(120)  # raises what the site raised
        assert summary.finished, f"site-{index} did not hear that the run finished"
        return
    try:
        code = site.wait(timeout=120)
    finally:
        if site.poll() is None:
            site.kill()
    assert code == 0, f"site-{index} exited with {code}:\n" + (tmp_path / f"site-{index}.log").read_text()[-3000:]


def attacked_run(tmp_path, monkeypatch, spec: StrategySpec, processes: bool) -> Ledger:
    config = server_config(
        tmp_path,
        threads=1,
        workload=WORKLOAD,
        optimizer={"lr": LR},
        strategy={"name": spec.name, "options": spec.options},
        training={"steps": STEPS, "batch_size": BATCH, "eval_every": STEPS, "checkpoint_every": 0},
        # the timeouts only guard against a hang: honest site processes can take minutes to start on a busy
        # machine, and a phase that timed out an honest site would restart its step
        federation={"min_sites": 2, "initial_sites": 3, "linger_s": 0, "quarantine_after": QUARANTINE_AFTER,
                    "phase_timeout_s": 300, "quorum_timeout_s": 300},
    )
    server = ServerThread(config).start()
    ledger = MaliciousSession.ledger = Ledger()
    monkeypatch.setattr(site_module, "Session", MaliciousSession)
    honest = [honest_site(tmp_path, index, server.endpoint, processes) for index in range(2)]
    malicious = site_module.Site(SiteConfig.model_validate({
        "site_id": MALICIOUS, "token": enroll(tmp_path / "tokens.json", MALICIOUS), "device": "cpu",
        "connect": {"server": server.endpoint}, "data": {"source": "partition", "site_index": 0, "num_sites": 2},
    }))
    attacker = threading.Thread(target=attack, args=(malicious, ledger), daemon=True)
    attacker.start()
    for index, site in enumerate(honest):
        finish(site, tmp_path, index)
    server.join(60)
    attacker.join(30)

    records = list(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(math.isfinite(r["train_loss"]) for r in records)
    # Every attack is refused in the phase it is sent, so no step restarts: the honest sites go
    # on. PowerSGD is the exception: an upload refused in its second phase was already counted
    # in the first, so that step restarts once without the attacker.
    restarted = [r["step"] for r in records if r["attempt"]]
    if spec.name == "powersgd":
        assert all(r["attempt"] <= 1 for r in records) and len(restarted) <= len(ATTACKS), restarted
    else:
        assert not restarted, restarted

    must_refuse = set(ATTACKS) - UNDETECTABLE - (set() if spec.name in ROWS_TRAVEL else {"wrong row count"})
    must_refuse -= {"missing key"} if spec.name in ONLY_GRADIENTS else set()
    assert must_refuse <= set(ledger.refused), f"accepted: {sorted(ledger.accepted)}, refused: {sorted(ledger.refused)}"
    assert "quarantined" in ledger.quarantined
    assert MALICIOUS in json.loads((tmp_path / "run" / "quarantine.json").read_text())
    assert MALICIOUS not in records[-1]["site_ids"]

    simulation = SimulationConfig(
        workload=WORKLOAD["spec"], workload_options=WORKLOAD["options"], sites=2, batch_size=BATCH, steps=STEPS,
        eval_every=STEPS, device="cpu", optimizer=OptimizerConfig(name="sgd", lr=LR, momentum=0.9), strategies=[spec],
    )
    with MetricsWriter(tmp_path / "clean.jsonl") as metrics:
        clean = simulate(simulation, spec, metrics)
    attacked = records[-1]["test_accuracy"]
    report = {
        "strategy": spec.display, "refused": ledger.refused, "accepted": sorted(ledger.accepted),
        "quarantined_at_step": json.loads((tmp_path / "run" / "quarantine.json").read_text())[MALICIOUS]["step"],
        "accuracy": attacked, "clean_accuracy": clean["metric"],
    }
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert abs(attacked - clean["metric"]) <= 0.01, report
    return ledger


@pytest.mark.slow
@pytest.mark.parametrize("spec", STRATEGIES, ids=lambda spec: spec.display)
def test_a_malicious_site_is_dropped_then_quarantined_and_the_run_completes(tmp_path, monkeypatch, spec):
    attacked_run(tmp_path, monkeypatch, spec, processes=False)


@pytest.mark.slow
def test_honest_site_processes_exit_0_beside_a_malicious_site(tmp_path, monkeypatch):
    """rank-dAD with concatenated factors: the strategy where inconsistent ranks once made
    every honest site's decode fail (exit 1)."""
    attacked_run(tmp_path, monkeypatch, StrategySpec(name="rankdad", options={"rank": 2}), processes=True)


def test_a_payload_the_rules_miss_is_caught_by_the_message_check(tmp_path, monkeypatch):
    """Defence in depth: with rank-dAD's upload rules switched off, a P without its Q
    breaks the aggregation; the coordinator finds the site whose upload alone breaks it,
    drops it, recomputes the step without it, and no site ever receives a bad message."""
    from dadfl.strategies.rankdad import RankDAD

    monkeypatch.setattr(RankDAD, "check_uploads", lambda self, *args, **kwargs: [])
    spec = StrategySpec(name="rankdad", options={"rank": 2, "reduce_on_server": True})
    ledger = attacked_run(tmp_path, monkeypatch, spec, processes=False)
    assert "breaks the aggregated message" in ledger.refused["missing key"]
