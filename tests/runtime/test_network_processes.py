"""The networked runtime trains the same model, bit for bit, as the in-process simulation:
every strategy with the coordinator and sites in threads (real gRPC on loopback, the config
files of the multi-process simulation), and the multi-process simulation itself (a coordinator
and site processes) once."""

from __future__ import annotations

import pytest

from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.replica import OptimizerConfig
from dadfl.server import simulate_processes
from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from tests.helpers.network import simulate_threads

pytestmark = pytest.mark.network  # every test here starts a coordinator, a site or a process


@pytest.mark.parametrize(
    "spec",
    [
        StrategySpec(name="dsgd"),
        StrategySpec(name="dad"),
        StrategySpec(name="edad", options={"downlink": "factors"}),
        StrategySpec(name="rankdad", options={"rank": 2, "raw_input": "low_rank"}),  # error feedback, re-reduction
        StrategySpec(name="powersgd", options={"rank": 2, "start_iter": 2}),
        StrategySpec(name="rankdad", options={"rank": 2, "raw_input": "low_rank", "factor_bits": 8}),  # int8 codes
        StrategySpec(name="powersgd", options={"rank": 2, "start_iter": 2, "factor_bits": 8}),
        StrategySpec(name="fedavg", options={"local_steps": 3}),  # uploads claim 3 batches of samples
        StrategySpec(name="diloco", options={"local_steps": 2, "inner_lr": 0.003}),
    ],
    ids=lambda spec: spec.name + (f"-{spec.options['factor_bits']}bit" if "factor_bits" in spec.options else ""),
)
def test_a_grpc_federation_trains_exactly_like_the_in_process_simulation(tmp_path, spec):
    same_as_in_process(tmp_path, spec, simulate_threads)


@pytest.mark.slow
def test_processes_train_at_bf16_exactly_like_the_in_process_simulation(tmp_path):
    """The processes' own path (config files, one interpreter each); training.precision reaches
    every site process in the run config: bf16 factors up and down, every replica
    bit-identical to the in-process run's."""
    seen = []
    spec = StrategySpec(name="dad", options={"downlink": "factors", "raw_input": "activations"})
    same_as_in_process(tmp_path, spec, lambda config, spec, metrics: simulate_processes(config, spec, metrics, progress=seen.append), "bf16")
    assert seen == list(range(6))


def same_as_in_process(tmp_path, spec: StrategySpec, federation, precision: str = "fp32") -> None:
    """``federation(config, spec, metrics)`` (threads or processes) against :func:`simulate`."""
    config = SimulationConfig(
        workload="digits-mlp", workload_options={"hidden": 16}, sites=3, partition="quantity", batch_size=24, steps=6,
        eval_every=3, device="cpu", optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), strategies=[spec],
        precision=precision,
    )
    with MetricsWriter(tmp_path / "networked.jsonl") as metrics:
        summary = federation(config, spec, metrics)
    # Every mode runs every replica on config.threads (1) torch threads: products round
    # differently with other thread counts.
    with MetricsWriter(tmp_path / "memory.jsonl") as metrics:
        reference = simulate(config, spec, metrics)
    networked = list(read_metrics(tmp_path / "networked.jsonl"))
    in_memory = list(read_metrics(tmp_path / "memory.jsonl"))
    assert [r["step"] for r in networked] == list(range(6))
    for net, mem in zip(networked, in_memory, strict=True):
        for key in ("strategy", "step", "sites", "samples", "train_loss", "bytes_up", "bytes_down", "fingerprint"):
            assert net[key] == mem[key], key
        assert net.get("test_accuracy") == mem.get("test_accuracy")
        assert net["wire_bytes_up"] > net["bytes_up"] and len(net["wire_bytes_up_by_site"]) == 3
        if 0 < net["step"] < 5:  # step 0 adds the state and step_begin, the last step a step_done of its own
            # One round trip per phase: each site's upload of this step went with the done of
            # the step before; the server's message of the last phase started the next step.
            phases = len(net["phase_seconds"])
            assert net["wire_messages_down_by_site"] == net["wire_messages_up_by_site"] == dict.fromkeys(net["site_ids"], phases)
    assert summary["metric"] == reference["metric"] and summary["bytes_up"] == reference["bytes_up"]
