"""In-process federation on built-in data: replicas identical, metrics and plots written."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dadfl.cli import app
from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.simulation import SimulationConfig, StrategySpec, simulate


def small_config(**overrides):
    values = dict(workload="digits-mlp", sites=3, steps=6, batch_size=8, eval_every=3, partition="dirichlet", alpha=0.5)
    values.update(overrides)
    return SimulationConfig(**values)


@pytest.mark.parametrize("name", ["dsgd", "dad", "auto", "edad"])
def test_exact_strategies_train_identically(tmp_path, name):
    """Exact strategies apply the same update as dSGD: the same weights bit for bit, or
    within float rounding (factor sums associate differently)."""
    config = small_config()
    with MetricsWriter(tmp_path / "reference.jsonl") as metrics:
        reference = simulate(config, StrategySpec(name="dsgd"), metrics)
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        summary = simulate(config, StrategySpec(name=name), metrics)
    assert summary["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-4)
    records = [r for r in read_metrics(tmp_path / "m.jsonl") if r["strategy"] == name]
    assert [r["step"] for r in records] == list(range(6))
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in records)
    assert "test_accuracy" in records[2] and "test_accuracy" in records[5]


def test_training_improves_the_held_out_metric(tmp_path):
    config = small_config(steps=60, batch_size=16, partition="iid", eval_every=60)
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        summary = simulate(config, StrategySpec(name="auto"), metrics)
    assert summary["metric"] > 0.5, summary  # chance is 0.1 on ten digits


@pytest.mark.slow
@pytest.mark.network
def test_sim_command_writes_table_metrics_and_plots(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dadfl.cli", "sim", "--steps", "4", "--sites", "2", "--batch-size", "4",
         "--strategies", "dsgd;dad:downlink=factors", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "loss.png").stat().st_size > 0
    summaries = json.loads((run_dir / "summary.json").read_text())
    assert [s["strategy"] for s in summaries] == ["dsgd", "dad(downlink=factors)"]
    assert "dad(downlink=factors)" in result.stdout
    # Effective ranks per layer, per site and of the sum, for the factor strategy only; its plot.
    records = list(read_metrics(run_dir / "metrics.jsonl"))
    dad = [r for r in records if r["strategy"] == "dad(downlink=factors)"]
    assert {"rank90/0/site0", "rank99/0/site1", "rank90/0/sum"} <= set(dad[0])  # every rank_every = 5 steps
    assert not any(key.startswith("rank") for r in dad[1:] for key in r)
    assert not any(key.startswith("rank") for r in records if r["strategy"] == "dsgd" for key in r)
    assert [p.name for p in run_dir.glob("rank_*.png")] == ["rank_dad_downlink_factors_.png"]
    assert "dad(downlink=factors): components holding 90% of" in result.stdout  # a rank to try, per layer


def test_the_results_table_fits_80_columns_and_says_what_is_compared():
    from rich.console import Console

    from dadfl.cli import summary_table
    from dadfl.simulation import DEMO_STRATEGIES

    long = StrategySpec.parse("rankdad:rank=4,factor_bits=8,reduce_on_server=false,raw_input=dense")
    specs = [*DEMO_STRATEGIES, long]
    summaries = [{"strategy": spec.display, "metric_name": "accuracy", "steps": 300, "metric": 0.97, "test_loss": 0.1,
                  "bytes_up_per_step": 1.4e6, "bytes_down_per_step": 316e3, "seconds_per_step": 0.0551} for spec in specs]
    console = Console(width=80, record=True)
    console.print(summary_table(summaries, specs))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    for spec in DEMO_STRATEGIES:  # each name whole on its row
        assert any(line.strip().startswith(spec.display + "  ") for line in lines), spec.display
    assert any(line.strip().startswith("rankdad(factor_… [1]  ") for line in lines)  # too long: a short name
    assert "[1] " + long.display in [line.strip() for line in lines]  # and the legend
    text = " ".join(" ".join(lines).split())
    assert "Raw-input layer sent as a rank-r projection of its gradient: rank-dAD r=4," in text
    assert "Raw-input layer sent as its dense gradient: dSGD, dAD, auto, edAD, rankdad(" in text


def test_the_demo_compares_rank_r_strategies_at_equal_exposure_with_8_bit_factors():
    from dadfl.simulation import DEMO_STRATEGIES

    assert SimulationConfig().strategies == list(DEMO_STRATEGIES)
    rank_r = [spec for spec in DEMO_STRATEGIES if spec.name in ("rankdad", "powersgd")]
    assert {spec.raw_input_exposure() for spec in rank_r} == {"a rank-r projection of its gradient"}
    for name in ("rankdad", "powersgd"):
        assert {spec.options.get("factor_bits", 32) for spec in rank_r if spec.name == name} == {32, 8}


@pytest.mark.network
def test_sim_command_rejects_bad_input_with_a_clear_message(tmp_path):
    bad = tmp_path / "sim.toml"
    bad.write_text('workload = "digits-mlp"\nsitez = 3\n')
    result = subprocess.run(
        [sys.executable, "-m", "dadfl.cli", "sim", "--config", str(bad), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"},  # the path, however long, on one line
    )
    assert result.returncode == 2
    assert "sim.toml" in result.stdout and "sitez" in result.stdout and "remove it" in result.stdout
    # the same command in this process (the console wraps lines)
    result = CliRunner().invoke(app, ["sim", "--strategies", "edad", "--workload", "digits-cnn", "--steps", "1", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "use 'dad' or 'auto'" in " ".join(result.output.split())


def test_example_simulation_config_runs(tmp_path):
    """The shipped configs/simulation.toml is valid and trains (two steps here; ``dadfl sim`` in
    this process: the process of the command is test_sim_command_writes_table_metrics_and_plots)."""
    from pathlib import Path

    config = Path(__file__).parents[2] / "configs" / "simulation.toml"
    result = CliRunner().invoke(app, ["sim", "--config", str(config), "--steps", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (run_dir,) = tmp_path.iterdir()
    labels = {record["strategy"] for record in read_metrics(run_dir / "metrics.jsonl")}
    assert len(labels) == 5 and {"rank-dAD r=2", "rank-dAD r=2 8-bit", "PowerSGD r=2"} <= labels
