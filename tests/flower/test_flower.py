"""Flower integration: a real Flower simulation (Ray) trains bit-identically to the in-process one,
and nodes that lose their state are resynced by the server."""

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower integration needs flwr: pip install -e '.[flower]'")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from dadfl import flower  # noqa: E402
from dadfl.metrics import MetricsWriter, read_metrics  # noqa: E402
from dadfl.model_identity import identity_text  # noqa: E402
from dadfl.simulation import SimulationConfig, StrategySpec, simulate  # noqa: E402
from dadfl.workloads import partition  # noqa: E402


def small_config(spec: StrategySpec, sites: int) -> SimulationConfig:
    return SimulationConfig(
        workload="digits-mlp",
        workload_options={"hidden": 16},
        sites=sites,
        partition="dirichlet",
        batch_size=16,
        steps=3,
        eval_every=3,
        seed=3,
        device="cpu",
        strategies=[spec],
    )


def in_process_records(config, spec, path):
    with MetricsWriter(path) as metrics:
        summary = simulate(config, spec, metrics)
    return summary, list(read_metrics(path))


def assert_same_training(records, reference):
    """Same weights after every step (fingerprints hash every bit of every parameter and buffer),
    same losses and exact payload bytes."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for record, expected in zip(records, reference):
        assert record["fingerprint"] == expected["fingerprint"], f"step {record['step']}"
        for key in ("samples", "train_loss", "bytes_up", "bytes_down"):
            assert record[key] == expected[key], (key, record["step"])


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
@pytest.mark.parametrize(
    "text, sites, actors",
    [
        ("dad", 3, 1),
        # Two phases per compressed step; warm start and error feedback carried across steps,
        # with two Ray workers so a node's messages move between processes.
        ("powersgd:rank=2,start_iter=1", 2, 2),
        # Integer factors: int8 codes and their scales as Flower arrays, up and down.
        ("rankdad:rank=2,raw_input=low_rank,factor_bits=8", 2, 1),
        # Rounds of local steps; the AdamW moments carried in the half, which Flower pickles.
        ("diloco:local_steps=2,inner_lr=0.003", 2, 2),
    ],
)
def test_flower_simulation_trains_like_the_in_process_simulation(tmp_path, text, sites, actors):
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install 'flwr[simulation]'")
    spec = StrategySpec.parse(text)
    config = small_config(spec, sites)
    summary = flower.run_flower_simulation(config, spec, tmp_path, actors=actors)
    records = list(read_metrics(tmp_path / "metrics.jsonl"))
    for record in records:
        assert record["fingerprint_mismatches"] == [], "a node's weights differ from the server's"
        assert record["attempt"] == 0, "a node needed the full state"
        assert len(record["site_ids"]) == sites
    reference_summary, reference = in_process_records(config, spec, tmp_path / "reference.jsonl")
    assert_same_training(records, reference)
    assert [len(r["phase_seconds"]) for r in records] == ([1, 2, 2] if spec.name == "powersgd" else [1, 1, 1])
    assert summary["test_loss"] == reference_summary["test_loss"]
    assert "test_accuracy" in records[-1]


class DirectGrid:
    """A Grid that calls the ClientApp in this process, one Context per node (no Ray), and
    can wipe a node's ``context.state`` before a chosen message, as a restarted SuperNode would."""

    def __init__(self, num_nodes: int, wipe_before: set[tuple[str, int, int]] = frozenset(), node_configs=None):
        self.client_app = flower.make_client_app()
        self.node_configs = node_configs or {}
        self.contexts = {node: self.context(node) for node in (31, 7, 19)[:num_nodes]}
        self.wipe_before = set(wipe_before)  # (message type, step, node)
        self.wiped = []

    def context(self, node: int) -> Context:
        return Context(run_id=1, node_id=node, node_config=self.node_configs.get(node, {}), state=RecordDict(), run_config={})

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            node, step = message.metadata.dst_node_id, int(message.metadata.group_id)
            if (message.metadata.message_type, step, node) in self.wipe_before:
                self.wipe_before.remove((message.metadata.message_type, step, node))
                self.contexts[node] = self.context(node)
                flower.node._batch_streams.clear()  # a fresh process, too
                self.wiped.append((message.metadata.message_type, step, node))
            replies.append(self.client_app(message, self.contexts[node]))
        return replies


@pytest.fixture
def task_identity(monkeypatch):
    """Messages are stamped with the current task's identity, which a Flower runtime sets."""
    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)


def run_direct(tmp_path, config, spec, grid, bounds: flower.ServerBounds = flower.ServerBounds()):
    settings = flower.RunSettings(config, spec)
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        summary = flower.FlowerCoordinator(settings, grid, metrics, bounds=bounds).run()
    return summary, list(read_metrics(tmp_path / "metrics.jsonl"))


def test_a_node_that_loses_its_state_is_resynced_and_training_stays_exact(tmp_path, task_identity):
    """dAD keeps no strategy state, so a resync (full state to every node) changes nothing."""
    spec = StrategySpec(name="dad")
    config = small_config(spec, sites=3)
    lost = {(flower.STEP_MESSAGE, 1, 7), (flower.PHASE_MESSAGE, 2, 19)}  # between steps; mid-step
    grid = DirectGrid(3, lost)
    _, records = run_direct(tmp_path, config, spec, grid)
    assert sorted(grid.wiped) == sorted(lost)
    assert [r["attempt"] for r in records] == [0, 1, 1]
    assert all(r["fingerprint_mismatches"] == [] for r in records)
    _, reference = in_process_records(config, spec, tmp_path / "reference.jsonl")
    assert_same_training(records, reference)


def test_powersgd_state_restarts_everywhere_after_a_resync(tmp_path, task_identity):
    """After a resync every replica restarts its PowerSGD state, so they still agree."""
    spec = StrategySpec.parse("powersgd:rank=1,start_iter=0")
    config = small_config(spec, sites=2)
    grid = DirectGrid(2, {(flower.PHASE_MESSAGE, 1, 31)})
    _, records = run_direct(tmp_path, config, spec, grid)
    assert [r["attempt"] for r in records] == [0, 1, 0]
    assert all(r["fingerprint_mismatches"] == [] for r in records)


def test_a_node_with_another_model_is_refused_with_the_fix(tmp_path, task_identity):
    spec = StrategySpec(name="dad")
    config = small_config(spec, sites=1)
    grid = DirectGrid(1)
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        coordinator = flower.FlowerCoordinator(flower.RunSettings(config, spec), grid, metrics)
        coordinator.nodes = coordinator.wait_for_nodes()
        later = coordinator.step_content(1, 0, with_state=False)(0).config_records[flower.HEADER]
        resync = coordinator.step_content(1, 1, with_state=True)(0).config_records[flower.HEADER]
        assert later["model"] == "" and resync["model"] == coordinator.model_identity  # only where a node builds afresh
        content = coordinator.step_content(0, 0, with_state=False)
        replica = coordinator.replica
        lines, probe = replica.layout.lines(), replica.model_probe
        for header, refusal in (
            ({"layout": "0000", "model": identity_text(lines[1:], probe)}, r"in its layout: this site has parameter 0\.weight of shape"),
            ({"model": identity_text(lines, [v * 1.1 for v in probe])}, "computes a different function from the coordinator's"),
            ({"model": '{"lines": "all"}'}, "header field .{1,8}model.{1,8}: the model identity is not"),
        ):
            wrong = lambda position: _with_header(content(position), **header)  # noqa: E731
            with pytest.raises(flower.FlowerRunError, match=f"node 31 refuses the server's message: .*{refusal}"):
                coordinator.round(0, 0, 0, flower.STEP_MESSAGE, wrong)


def _with_header(content, **fields):
    content.config_records[flower.HEADER].update(fields)
    return content


def test_sites_with_their_own_data_files_train_like_the_partitioned_simulation(tmp_path, task_identity):
    """A site's ``data-path`` holding exactly its partition trains as the partition does."""
    spec = StrategySpec(name="auto")
    config = small_config(spec, sites=2)
    workload = flower.workload_for(config)
    indices = partition(2, len(workload.train), config.partition, labels=workload.labels, alpha=config.alpha, seed=config.seed)
    node_configs = {}
    for node, index in zip((7, 31), indices):  # sorted node ids: positions 0 and 1
        path = tmp_path / f"site-{node}.npz"
        np.savez(path, inputs=workload.train.inputs[index].numpy(), targets=workload.train.targets[index].numpy())
        node_configs[node] = {"data-path": str(path)}
    _, records = run_direct(tmp_path, config, spec, DirectGrid(2, node_configs=node_configs))
    _, reference = in_process_records(config, spec, tmp_path / "reference.jsonl")
    assert_same_training(records, reference)

    missing = DirectGrid(2, node_configs={7: {"data-path": str(tmp_path / "nowhere.npz")}})
    with pytest.raises(ValueError, match="data-path='.*nowhere.npz': no such file on this SuperNode"):
        run_direct(tmp_path / "missing", config, spec, missing)


def test_run_config_settings_and_errors(tmp_path):
    run_config = {"strategy": "powersgd:rank=2", "sites": 2, "batch-size": 8, "out": str(tmp_path)}
    settings, out, bounds = flower.settings_from_run_config(run_config)
    assert (settings.spec.name, settings.spec.options) == ("powersgd", {"rank": 2})
    assert (settings.config.sites, settings.config.batch_size, out) == (2, 8, tmp_path)
    assert bounds == flower.ServerBounds(100.0, None, 1 << 30)  # dadfl server's defaults
    _, _, bounds = flower.settings_from_run_config(
        {**run_config, "max-influence-ratio": 20, "max-update-norm": 5, "max-payload-bytes": 4096})
    assert bounds == flower.ServerBounds(20.0, 5.0, 4096)
    _, _, bounds = flower.settings_from_run_config({**run_config, "clip-ratio": 3, "agreement": False, "agreement-margin": 0.5})
    assert (bounds.clip_ratio, bounds.agreement, bounds.agreement_margin) == (3.0, False, 0.5)
    with pytest.raises(ValueError, match="clip_ratio"):
        flower.settings_from_run_config({**run_config, "clip-ratio": 0.5})
    with pytest.raises(ValueError, match="unknown key.*'sitez'"):
        flower.settings_from_run_config({"sitez": 2})
    for key, value in (("max-influence-ratio", 1), ("max-update-norm", 0), ("max-payload-bytes", 10), ("agreement-margin", -0.1)):
        with pytest.raises(ValueError, match=f"Flower run config.*{key.replace('-', '_')}"):  # the server config's limits
            flower.settings_from_run_config({**run_config, key: value})
