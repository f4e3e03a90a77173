"""The typed step record writes the metrics keys every reader expects, in the runtimes' order."""

import json
import math

from dadfl.metrics import MetricsWriter, read_metrics, run_summary
from dadfl.records import StepRecord

CORE = ["strategy", "step", "sites", "samples", "train_loss", "bytes_up", "bytes_down", "seconds", "fingerprint"]


def core(train_loss: float = 0.5, **extra) -> StepRecord:
    return StepRecord("dsgd", 3, 2, 64, train_loss, 100, 200, 0.25, "ab12", **extra)


def test_unset_fields_are_not_written_and_spread_fields_land_in_place():
    record = core(diagnostics={"robust_factors": {"s1": 0.5}, "rank90/0/update": 2.0}, dp_epsilon=1.5)
    record.evaluation["test_loss"] = 0.4
    assert list(record.to_json()) == [*CORE, "robust_factors", "rank90/0/update", "dp_epsilon", "test_loss"]
    assert record.to_json()["robust_factors"] == {"s1": 0.5}


def test_the_network_fields_follow_the_core_and_zero_values_are_kept(tmp_path):
    record = core(
        wire_bytes_up=120, wire_bytes_down=230, wire_bytes_up_by_site={"a": 60, "b": 60}, wire_bytes_down_by_site={"a": 115, "b": 115},
        wire_messages_up_by_site={"a": 1, "b": 1}, wire_messages_down_by_site={"a": 1, "b": 1},
        repair_bytes_by_site={"a": 0, "b": 0}, full_states_by_site={"a": 0, "b": 0},
        phase_seconds=[0.2], site_ids=["a", "b"], attempt=0, fingerprint_mismatches=[],
    )
    keys = list(record.to_json())
    assert keys[:len(CORE)] == CORE and keys[len(CORE):len(CORE) + 2] == ["wire_bytes_up", "wire_bytes_down"]
    assert record.to_json()["attempt"] == 0 and record.to_json()["fingerprint_mismatches"] == []
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        metrics.write(record.to_json())
        metrics.write(core(train_loss=math.nan).to_json())
    lines = list(read_metrics(tmp_path / "metrics.jsonl"))
    assert lines[0] == json.loads(json.dumps(record.to_json()))
    summary = run_summary(lines[:1], "dsgd", "accuracy")
    assert summary["wire_bytes_up_per_step"] == 120 and summary["repair_bytes"] == 0
    assert math.isnan(lines[1]["train_loss"]) and "wire_bytes_up" not in lines[1]
