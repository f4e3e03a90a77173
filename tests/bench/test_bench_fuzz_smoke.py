"""The fuzz benchmark end to end with tiny numbers: it runs, fuzzes, and reports every figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fuzz_benchmark_reports_its_figures(tmp_path):
    out = tmp_path / "fuzz.json"
    # three cases bound the fuzzing; its time budget and the timeout only guard against a hang
    result = subprocess.run(
        [sys.executable, "-m", "bench.bench_fuzz", "--cases", "3", "--budget-s", "600", "--steps", "10", "--no-clean", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert 1 <= figures["cases"] <= 3 and sum(figures["outcomes"].values()) == figures["cases"]
    assert figures["crashes"] == 0 and figures["tracebacks_in"] == []
    # the figures say why when the first federation committed no step (a stopped or stalled run)
    assert figures["peak_coordinator_rss_mib"] > 0 and figures["steps_done"][0] >= 1, figures
    for key in ("accepted_mutated", "largest_accepted_norm_ratio", "accuracy_fuzzed", "max_abs_weight_diff_vs_clean", "by_kind"):
        assert key in figures
