"""A hospital's own workload and data: no data in the workload, unseeded models, a search
path instead of PYTHONPATH, coordinator-only options, CSV files, held-out shares, checks
on the sites' evaluation reports, and the operator's command-line basics."""

from __future__ import annotations

import math
import textwrap
import warnings

import pytest
import torch
from sklearn.datasets import load_breast_cancer
from typer.testing import CliRunner

from dadfl.cli import app
from dadfl.client.config import EvaluationData
from dadfl.client.data import hold_out
from dadfl.data_files import read_data_file
from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.server.config import ServerConfig, WorkloadConfig
from dadfl.server.coordinator import Coordinator
from dadfl.server.evaluation import EvalRejected, SiteEval, check_report, combine
from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from dadfl.workloads import SplitDataset, load_workload

KNOWN = ("loss", "accuracy")

# A package of the hospital's own, outside the project: an unseeded model, no data in the
# federation, a coordinator-only option that reads a file only the coordinator has.
PACKAGE = '''
import torch
import torch.nn.functional as F
from torch import nn
from sklearn.datasets import load_breast_cancer

from dadfl.workloads import Split, Workload


def mlp(hidden: int = 8, test_file: str | None = None, with_train: bool = False) -> Workload:
    test = None
    if test_file is not None:  # only the coordinator is given this option
        data = torch.load(test_file, weights_only=True)
        test = Split(data["inputs"], data["targets"])
    train = None
    if with_train:  # simulations partition it
        table = load_breast_cancer()
        features = torch.tensor(table.data, dtype=torch.float32)
        train = Split((features - features.mean(0)) / features.std(0), torch.tensor(table.target))
    return Workload(
        name="own-mlp",
        build_model=lambda: nn.Sequential(nn.Linear(30, hidden), nn.ReLU(), nn.Linear(hidden, 2)),  # no seed
        loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
        metric=lambda out, y: (out.argmax(-1) == y).float().mean().item(),
        example_input=torch.zeros(2, 30),
        train=train,
        test=test,
    )
'''


@pytest.fixture
def package(tmp_path):
    folder = tmp_path / "models"
    (folder / "own_models").mkdir(parents=True)
    (folder / "own_models" / "__init__.py").write_text("")
    (folder / "own_models" / "tabular.py").write_text(PACKAGE)
    return folder


def test_workload_outside_the_project_loads_from_the_search_path(package):
    with pytest.raises(ValueError, match="pip install -e PATH.*workload path"):
        load_workload("not_installed_models.tabular:mlp", [package])
    workload = load_workload("own_models.tabular:mlp", [package], hidden=4)
    assert workload.train is None and workload.test is None
    assert workload.example().shape == (2, 30)
    with pytest.raises(ValueError, match="no training data"):
        workload.training_data()


def test_unseeded_model_simulates_from_the_coordinators_weights(tmp_path, package):
    config = SimulationConfig(
        workload="own_models.tabular:mlp", workload_options={"with_train": True}, workload_path=[package],
        sites=3, steps=4, batch_size=8, eval_every=2,
    )
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        summary = simulate(config, StrategySpec(name="dad"), metrics)  # raised ReplicaDivergence before
    assert math.isnan(summary["metric"])  # no coordinator test set: no test metric, and no error
    records = list(read_metrics(tmp_path / "m.jsonl"))
    assert len({r["fingerprint"] for r in records}) == 4 and not any("test_loss" in r for r in records)


def test_coordinator_only_options_never_reach_the_sites(tmp_path, package):
    table = load_breast_cancer()
    torch.save({"inputs": torch.zeros(5, 30), "targets": torch.tensor(table.target[:5])}, tmp_path / "test.pt")
    config = ServerConfig(
        run_dir=tmp_path / "run",
        workload=WorkloadConfig(
            spec="own_models.tabular:mlp", options={"hidden": 4}, coordinator_options={"test_file": str(tmp_path / "test.pt")},
            path=[package],
        ),
    )
    coordinator = Coordinator(config)
    assert len(coordinator.replica.workload.test) == 5
    sent = coordinator.run_config()
    assert sent.workload_options == '{"hidden": 4}' and "test.pt" not in str(sent)
    assert sent.eval_every == config.training.eval_every
    with pytest.raises(ValueError, match="both workload.options and workload.coordinator_options"):
        WorkloadConfig(options={"hidden": 4}, coordinator_options={"hidden": 8})


def test_csv_as_spreadsheets_export_it_and_where_a_cell_is_wrong(tmp_path):
    """Quoted fields and Excel's byte-order mark read as plain CSV; a missing or non-numeric cell
    and a row of the wrong width are named by line and column, never by value."""
    plain = "age,marker,target\n61,0.5,1\n45,1.25,0\n"
    quoted = '"age","marker","target"\n"61","0.5","1"\n"45","1.25","0"\n\n'
    for name, text, encoding in (("plain", plain, "utf-8"), ("quoted", quoted, "utf-8"), ("excel", plain, "utf-8-sig")):
        path = tmp_path / f"{name}.csv"
        path.write_text(text, encoding=encoding)
        split = read_data_file(path)
        assert split.inputs.tolist() == [[61.0, 0.5], [45.0, 1.25]] and split.targets.tolist() == [1, 0], name
    for name, text, message in (
        ("missing", "age,marker,target\n61,0.5,1\n45,,0\n", "line 3, column 'marker' is empty"),
        ("word", "age,marker,target\n61,0.5,1\n45,high-risk,0\n", "line 3, column 'marker' is not a number"),
        ("extra", "age,marker,target\n61,0.5,1\n45,1.25,0,7\n", "line 3 has 4 values against 3 header columns"),
    ):
        path = tmp_path / f"{name}.csv"
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as refused:
            read_data_file(path)
        words = str(refused.value).replace(str(path), "PATH")  # the test's folder name may hold any digits
        assert "high-risk" not in words and "45" not in words


def test_csv_site_data_and_held_out_share(tmp_path):
    path = tmp_path / "site.csv"
    path.write_text("age,marker,target\n61,0.5,1\n45,1.25,0\n70,2.0,1\n38,0.75,0\n52,1.5,1\n")
    split = read_data_file(path)
    assert split.inputs.dtype == torch.float32 and split.targets.dtype == torch.int64
    assert split.inputs.tolist()[1] == [45.0, 1.25] and split.targets.tolist() == [1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="no column 'label'.*data.target_column"):
        read_data_file(path, target_column="label")
    bad = tmp_path / "bad.csv"
    bad.write_text("age,target\n61,0.5\n")
    with pytest.raises(ValueError, match="whole-number class labels"):
        read_data_file(bad)
    for name, text in (("wide", "age,target\n1,2,3\n"), ("narrow", "age,marker,target\n1,2\n"), ("empty", "age,target\n")):
        shifted = tmp_path / f"{name}.csv"
        shifted.write_text(text)  # a row that does not match the header would take labels from the wrong column
        with warnings.catch_warnings(), pytest.raises(ValueError, match="one value per header column"):
            warnings.simplefilter("error")  # the site's own message only, no numpy warning before it
            read_data_file(shifted)

    dataset = SplitDataset(split)
    train, held_out = hold_out(dataset, EvaluationData(fraction=0.4))
    assert len(train) == 3 and len(held_out) == 2
    assert sorted([*train.indices, *held_out.indices]) == list(range(5))  # disjoint, nothing lost
    again, _ = hold_out(dataset, EvaluationData(fraction=0.4))
    assert again.indices == train.indices  # seeded
    with pytest.raises(ValueError, match="leaves no held-out"):
        hold_out(dataset, EvaluationData(fraction=0.01))
    with pytest.raises(ValueError, match="exactly one of evaluation.path"):
        EvaluationData()


def report(samples=10, **metrics):
    return cpb.EvalReport(samples=samples, metrics=metrics or {"loss": 0.5, "accuracy": 0.9})


@pytest.mark.parametrize(
    "bad, reason",
    [
        (report(samples=0), "sample count 0"),
        (report(samples=10**9), "federation.max_eval_samples"),
        (report(loss=0.5), "not exactly"),
        (report(loss=0.5, accuracy=0.9, extra=1.0), "not exactly"),
        (report(loss=0.5, accuracy=float("nan")), "non-finite accuracy"),
        (report(loss=float("inf"), accuracy=0.5), "non-finite loss"),
    ],
)
def test_hostile_evaluation_reports_are_refused(bad, reason):
    with pytest.raises(EvalRejected, match=reason):
        check_report(cpb.EvalReport.FromString(bad.SerializeToString()), KNOWN, max_samples=10_000)


def test_evaluation_reports_combine_sample_weighted():
    evals = {"b": check_report(report(30, loss=1.0, accuracy=0.5), KNOWN, 100), "a": SiteEval(10, {"loss": 3.0, "accuracy": 1.0})}
    record = combine(evals)
    assert record["eval_samples"] == 40 and record["eval_sites"] == 2
    assert record["eval_accuracy"] == pytest.approx(0.625) and record["eval_loss"] == pytest.approx(1.5)
    assert list(record["eval_by_site"]) == ["a", "b"] and record["eval_by_site"]["b"]["samples"] == 30


def test_version_device_and_enrolled_threads(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("dadfl ")
    if not torch.cuda.is_available():
        result = runner.invoke(app, ["sim", "--device", "cuda", "--steps", "1", "--out", str(tmp_path)])
        assert result.exit_code != 0 and "no CUDA device" in result.output
        assert not any(tmp_path.iterdir())  # refused before any run folder
    server = tmp_path / "server.toml"
    server.write_text(textwrap.dedent(f'[listen]\ntokens = "{tmp_path / "tokens.json"}"\n'))
    out = tmp_path / "site.toml"
    result = runner.invoke(app, ["enroll", "h1", "--config", str(server), "--data", "h1.csv", "--workload-path", "models", "--out", str(out)])
    assert result.exit_code == 0, result.output
    import tomllib

    site = tomllib.loads(out.read_text())
    assert site["threads"] == 1 and site["data"]["path"] == "h1.csv" and site["workload_path"] == ["models"]
    assert site["evaluation"] == {"fraction": 0.2}
    out = tmp_path / "site2.toml"
    result = runner.invoke(app, [
        "enroll", "h2", "--config", str(server), "--data-factory", "own.images:folder",
        "--data-option", "root=scans/h2", "--data-option", "size=8", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert tomllib.loads(out.read_text())["data"] == {"source": "dataset", "factory": "own.images:folder", "options": {"root": "scans/h2", "size": 8}}
    result = runner.invoke(app, ["enroll", "h3", "--config", str(server), "--data", "x.csv", "--data-factory", "own.images:folder"])
    assert result.exit_code != 0 and "at most one of" in result.output



def step_record(step: int, **extra) -> dict:
    return {"step": step, "train_loss": 1.0 / (step + 1), "bytes_up": 1000, "bytes_down": 2000, "seconds": 0.01, **extra}


def test_operator_view_logs_progress_and_writes_tensorboard(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dadfl.server.progress import OperatorView

    view = OperatorView(steps=4, first_step=0, metric_name="accuracy", every_s=3600, run_dir=tmp_path, tensorboard=True)
    by_site = {"h1": {"samples": 10, "loss": 0.5, "accuracy": 0.8}}
    with caplog.at_level("INFO", logger="dadfl.server"), view:
        view.step(step_record(0))  # the first step always logs
        view.step(step_record(1, eval_accuracy=0.8, eval_loss=0.5, eval_samples=10, eval_by_site=by_site))
        view.step(step_record(2, **{"rank90/fc/update": 3.0, "rank99/fc/update": 4.0}))  # throttled
        view.step(step_record(3))  # the last step always logs
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["step 0 (1/4 done)", "step 1 (2/4 done)", "step 3 (4/4 done)"]
    assert "sites' held-out accuracy 0.8000 (after step 1)" in lines[1] and "1.0 KB up" in lines[0]

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "bytes/cumulative", "eval/accuracy", "eval_by_site/h1/accuracy", "rank90/fc/update"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("rank99/fc/update")] == [(2, 4.0)]
    assert [e.value for e in events.Scalars("bytes/cumulative")] == [3000, 6000, 9000, 12000]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(1, pytest.approx(0.8))]
