"""Never blame the honest: non-finite values the model produced are the model's fault.

The rule (``server/screening.py``: ``model_fault``) on its own, then a real run over gRPC on
loopback whose optimizer diverges: every honest site computes non-finite values on the
coordinator's own weights, and the run must stop with one line that names no site, with no
site refused or quarantined (``quarantine_after`` 1: one refusal would quarantine).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dadfl.metrics import read_metrics
from dadfl.protos.state_file import fill, verify, write_state
from dadfl.server import checkpoint
from dadfl.server.coordinator import ModelNotFinite
from dadfl.trust.screening import model_fault, nonfinite_reason, weights_finite
from dadfl.strategies import Payload
from tests.helpers.network import ServerThread, SiteThread, server_config, site_config


@pytest.mark.parametrize("nonfinite, uploads, fault", [
    (3, 3, True), (2, 3, True), (1, 3, False), (0, 3, False),  # a lone site is its own fault
    (2, 2, True), (1, 2, False),  # with two sites, one non-finite upload is that site's
    (3, 4, True), (2, 4, False), (0, 0, False),
])
def test_a_majority_of_non_finite_uploads_is_the_models_fault(nonfinite, uploads, fault):
    assert model_fault(nonfinite, uploads) is fault


def test_an_upload_is_non_finite_by_its_loss_or_any_tensor():
    finite = Payload(step=0, phase=0, num_samples=4, tensors={"w:grad": torch.ones(3), "n:buffer": torch.arange(3)})
    assert nonfinite_reason(1.5, finite) is None
    assert "loss_sum=nan" in nonfinite_reason(math.nan, finite)
    assert "loss_sum=inf" in nonfinite_reason(math.inf, finite)
    for bad in (math.nan, math.inf, -math.inf):
        tensors = {**finite.tensors, "w:grad": torch.tensor([1.0, bad, 2.0])}
        assert "tensor 'w:grad': contains NaN or Inf" == nonfinite_reason(0.5, Payload(step=0, phase=0, num_samples=4, tensors=tensors))


def test_weights_with_an_inf_are_not_finite():
    model = torch.nn.Linear(3, 2)
    assert weights_finite(model)
    with torch.no_grad():
        model.bias[1] = math.inf
    assert not weights_finite(model)


@pytest.mark.network
def test_a_diverging_model_stops_the_run_and_no_honest_site_is_blamed(tmp_path):
    """lr 1e18: the first update leaves the weights finite but so large that every site's loss
    overflows at the next step. One line, no site refused, nothing committed after."""
    config = server_config(
        tmp_path,
        optimizer={"name": "sgd", "lr": 1e18, "momentum": 0.0},
        training={"steps": 6, "batch_size": 16, "eval_every": 6, "checkpoint_every": 1},
        federation={"min_sites": 3, "quarantine_after": 1, "linger_s": 0},
    )
    server = ServerThread(config).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, 3)).start() for i in range(3)]
    with pytest.raises(ModelNotFinite) as stopped:
        server.join(60)
    reason = str(stopped.value)
    assert reason.startswith("step 1 phase 0: 3 of 3 sites computed non-finite values") and "\n" not in reason
    assert "its weights are finite but its loss overflows" in reason and "no site is refused" in reason
    for site in sites:
        with pytest.raises(Exception) as told:  # told why, with a status it does not retry
            site.join(60)
        assert "no site is refused" in str(told.value), str(told.value)
    run = tmp_path / "run"
    assert not (run / "quarantine.json").exists()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0]  # step 1 was never committed
    events = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] in ("refused", "quarantined")], events
    assert [e for e in events if e["event"] == "run" and "not finite" in e["action"]]


@pytest.mark.network
def test_a_checkpoint_with_non_finite_weights_is_refused_in_one_line(tmp_path):
    """The last good state itself non-finite (a checkpoint file altered, or written by an older
    coordinator): the coordinator refuses to resume before any site joins, naming no site."""
    config = server_config(tmp_path, training={"steps": 1, "batch_size": 16, "eval_every": 1, "checkpoint_every": 1},
                           federation={"min_sites": 2, "linger_s": 0})
    server = ServerThread(config).start()
    sites = [SiteThread(site_config(tmp_path, f"site-{i}", server.endpoint, i, 2)).start() for i in range(2)]
    server.join(60)
    for site in sites:
        site.join(60)
    path = tmp_path / "run" / "checkpoint.pt"
    with path.open("rb") as file:  # read as it is stored, one weight set to inf, written back with a valid digest
        meta, header = verify(file, checkpoint.MAGIC)
        tensors = {}
        fill(file, lambda key, shape, dtype: tensors.setdefault(key, torch.empty(shape, dtype=dtype)), checkpoint.MAGIC)
    next(t for key, t in tensors.items() if key.startswith("model/")).view(-1)[0] = math.inf
    with path.open("wb") as file:
        write_state(file, Payload(header.step, 0, 0, tensors), meta, checkpoint.MAGIC)
    again = server_config(tmp_path, training={"steps": 2, "batch_size": 16, "eval_every": 2, "checkpoint_every": 1})
    with pytest.raises(ValueError) as refused:
        ServerThread(again).start()
    assert "holds non-finite weights" in str(refused.value) and "no site is at fault" in str(refused.value)
    assert "\n" not in str(refused.value)
