"""A resume refuses another run's checkpoint and trims a record cut short by a kill. (A
coordinator process killed mid-run that resumes from its last checkpoint: ``test_resume_exact.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from dadfl.metrics import read_metrics
from dadfl.server import checkpoint
from dadfl.server.coordinator import Coordinator
from dadfl.strategies.robust import CLIP_HISTORY_STEPS
from tests.helpers.network import server_config


def test_resume_refuses_a_checkpoint_of_a_different_run(tmp_path):
    config = server_config(tmp_path)
    coordinator = Coordinator(config)
    checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {}, {})
    assert Coordinator(config).step == 3
    other = server_config(tmp_path, strategy={"name": "dad"})
    with pytest.raises(ValueError, match="different strategy"):
        Coordinator(other)


def test_the_robust_standings_resume_to_the_bit_and_a_malformed_one_is_refused(tmp_path):
    """The robust rule's standing of each site and its peers' (``Screening.standing``,
    ``Screening.peer_standing``) are coordinator state: a restarted coordinator reads them back
    exactly, and refuses a checkpoint whose standings are not site ids to finite numbers."""
    config = server_config(tmp_path, federation={"agreement_margin": 0.5})
    coordinator = Coordinator(config)
    assert coordinator.screening.agreement_margin == 0.5  # the configured margin is the rule's
    standing = {"site-a": 0.1 + 0.2, "site-b": -1 / 3, "site-c": 5e-324}
    peers = {"site-a": -0.7 / 3, "site-b": 1e-300}
    checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {}, standing, None, peers)
    resumed = Coordinator(config).screening
    assert resumed.standing == standing and resumed.peer_standing == peers
    for malformed in ({"site-a": float("nan")}, {"site-a": "0.5"}, [0.5]):
        checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {}, malformed)
        with pytest.raises(ValueError, match="malformed robust standing"):
            Coordinator(config)
        checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {}, standing, None, malformed)
        with pytest.raises(ValueError, match="malformed robust standing"):
            Coordinator(config)


def test_the_clip_history_resumes_to_the_bit_and_a_malformed_one_is_refused(tmp_path):
    """The clip's history (``Screening.recent_norms``: each site's recent update norms by phase)
    is coordinator state too: read back exactly, and refused unless it is site ids to phases to
    at most CLIP_HISTORY_STEPS finite, non-negative numbers."""
    config = server_config(tmp_path)
    coordinator = Coordinator(config)
    recent = {"site-a": {0: [0.1 + 0.2, 5e-324, 1e300]}, "site-b": {0: [1 / 3], 1: [2.0] * CLIP_HISTORY_STEPS}}
    coordinator.screening.recent_norms, coordinator.screening.standing = recent, {"site-a": 0.5}
    coordinator._save_checkpoint()  # as the step loop checkpoints
    resumed = Coordinator(config).screening
    assert resumed.recent_norms == recent and resumed.standing == {"site-a": 0.5}
    for malformed in (
        {"site-a": {0: [float("inf")]}}, {"site-a": {0: [-1.0]}}, {"site-a": {0: [1.0] * (CLIP_HISTORY_STEPS + 1)}},
        {"site-a": {"x": [1.0]}}, {"site-a": {"²": [1.0]}}, {"site-a": [1.0]}, [1.0],
    ):
        checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {}, {}, malformed)
        with pytest.raises(ValueError, match="malformed robust clip history"):
            Coordinator(config)


def test_the_sites_momenta_resume_to_the_bit_and_a_malformed_one_is_refused(tmp_path):
    """The robust rule's momenta (``Screening.momenta``: each site's, by phase and parameter, flat
    float32) are coordinator state: a restarted coordinator reads them back to the bit, with the
    configured μ, and refuses tensors that are not flat, finite float32 of one size per name."""
    config = server_config(tmp_path, federation={"agreement_momentum": 0.8})
    coordinator = Coordinator(config)
    assert coordinator.screening.momentum == 0.8
    generator = torch.Generator().manual_seed(0)
    momenta = {
        "site-a": {0: {"0.weight": torch.randn(6, generator=generator), "0.bias": torch.randn(2, generator=generator)}},
        "site-b": {0: {"0.weight": torch.randn(6, generator=generator)}, 1: {"0.bias": torch.full((2,), 5e-38)}},
    }
    coordinator.screening.momenta = momenta
    coordinator._save_checkpoint()  # as the step loop checkpoints
    resumed = Coordinator(config).screening.momenta
    assert {s: {p: sorted(h) for p, h in ph.items()} for s, ph in resumed.items()} == {s: {p: sorted(h) for p, h in ph.items()} for s, ph in momenta.items()}
    assert all(torch.equal(resumed[s][p][n], t) for s, ph in momenta.items() for p, h in ph.items() for n, t in h.items())
    for malformed in (
        torch.tensor([float("nan"), 0.0]), torch.zeros(2, dtype=torch.float64), torch.zeros(1, 2), torch.zeros(3),
    ):
        bad = {**momenta, "site-c": {0: {"0.bias": malformed}}}
        checkpoint.save_checkpoint(config.run_dir, coordinator.replica, 3, "abc", coordinator.identity, {}, {}, None, None, bad)
        with pytest.raises(ValueError, match="malformed robust momentum"):
            Coordinator(config)


def test_a_record_cut_short_by_a_kill_is_not_read_and_the_resume_trims_it(tmp_path):
    """A coordinator killed while writing a step's record leaves a last line without its newline
    (that step has no checkpoint yet and runs again); a reader polling the file mid-write sees the
    same. Neither raises, and trimming for the resume drops that line; a broken complete line still raises."""
    path = tmp_path / "metrics.jsonl"
    complete = [json.dumps({"step": step, "train_loss": 1.0 / (step + 1)}) + "\n" for step in range(3)]
    path.write_text("".join(complete) + '{"step": 3, "train_loss": 0.')
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    checkpoint.trim_metrics(path, next_step=3)
    assert path.read_text() == "".join(complete)
    path.write_text(complete[0] + '{"step": 1, "train_loss": 0.\n' + complete[2])
    with pytest.raises(json.JSONDecodeError):
        list(read_metrics(path))
