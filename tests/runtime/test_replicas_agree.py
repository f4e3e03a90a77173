"""Replicas on other hardware agree, and one that diverged is repaired block by block.

A real federation (coordinator and site processes on loopback gRPC): site 1 runs another
machine's float kernels (environment variables of its process only), site 2 alters a
weight of its replica in the middle of the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.protos.repair import apply_repair, block_hashes, repair_payload
from dadfl.protos.state import state_payload
from dadfl.replica import OptimizerConfig, Replica
from dadfl.server import simulate_processes
from dadfl.simulation import SimulationConfig, StrategySpec
from dadfl.strategies import exchange, make_strategy, weights_fingerprint
from dadfl.strategies.base import layer_gradient
from dadfl.strategies.checks import ModelFacts, check_update
from dadfl.strategies.payload import tensor_key
from dadfl.workloads import load_workload

from tests.helpers.workloads import TAMPER_ENV

ROOT = Path(__file__).resolve().parents[2]  # holds the tests package, so its workloads import as tests.helpers.workloads
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def replica(hidden: int = 256) -> Replica:
    return Replica(load_workload("digits-mlp", hidden=hidden), make_strategy("dsgd"), OptimizerConfig(momentum=0.9))


@pytest.mark.slow
@pytest.mark.network
def test_other_kernels_and_a_tampered_replica(tmp_path):
    spec = StrategySpec(name="dsgd")  # bench/bench_kernels.py runs every strategy
    config = SimulationConfig(
        workload="tests.helpers.workloads:tampering_mlp", workload_path=[ROOT], workload_options={"hidden": 256}, sites=3,
        batch_size=16, steps=6, eval_every=6, device="cpu", optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9),
        strategies=[spec],
    )
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as metrics:
        summary = simulate_processes(config, spec, metrics, site_env={1: OTHER_KERNELS, 2: {TAMPER_ENV: "4"}})
    records = list(read_metrics(path))
    assert len(records) == 6 and summary["full_states"] == 0
    state_bytes = state_payload(replica(), 0).nbytes()
    # The other kernels: never a differing fingerprint, so nothing to repair.
    assert [r["step"] for r in records if "site-001" in r["fingerprint_mismatches"]] == []
    assert sum(r["repair_bytes_by_site"]["site-001"] for r in records) == 0
    # The altered weight: seen at the end of the step it happened in, repaired at the next one
    # with one block of a few bytes (the output bias), not the state's 680 KB.
    tampered = [r["step"] for r in records if r["fingerprint_mismatches"]]
    assert len(tampered) == 1 and records[tampered[0]]["fingerprint_mismatches"] == ["site-002"], tampered
    repair = records[tampered[0] + 1]["repair_bytes_by_site"]["site-002"]
    assert 0 < repair < state_bytes / 100, (repair, state_bytes)
    assert summary["repair_bytes"] == repair


def test_repair_restores_an_altered_replica_with_its_differing_blocks():
    server, site = replica(), replica()
    site.load_weights_from(server)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for r in (server, site):  # one step so that both hold momentum
        r.apply_update({name: torch.ones_like(p) for name, p in r.model.named_parameters()})
    with torch.no_grad():
        site.model[-1].bias[3] += 1
    assert weights_fingerprint(site.model) != weights_fingerprint(server.model)
    repair = repair_payload(server, 1, block_hashes(site), block_hashes(server))
    assert list(repair.tensors) == [f"model/{len(server.model) - 1}.bias@0"]
    assert apply_repair(site, repair) == 1
    assert weights_fingerprint(site.model) == weights_fingerprint(server.model)
    assert block_hashes(site) == block_hashes(server)
    assert torch.equal(site.model(x), server.model(x))
    # Lists that do not line up (no momentum yet at one side): only the full state repairs.
    assert repair_payload(server, 1, block_hashes(server)[:-1], block_hashes(server)) is None


@pytest.mark.parametrize(
    "key, tensor, error",
    [
        ("model/0.weight@7", torch.zeros(4), "names no block"),
        ("weights@0", torch.zeros(4), "names no block"),
        ("model/0.bias@0", torch.zeros(3), "the state's is"),
        ("model/0.bias@0", torch.zeros(256, dtype=torch.float64), "the state's is"),
    ],
)
def test_a_repair_that_does_not_fit_is_refused_before_anything_is_written(key, tensor, error):
    target = replica()
    before = weights_fingerprint(target.model)
    good = {"model/0.weight@0": torch.zeros(256 * 64)}
    with pytest.raises(ValueError, match=error):
        apply_repair(target, type(state_payload(target, 0))(0, 0, 0, {**good, key: tensor}))
    assert weights_fingerprint(target.model) == before


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("name", ["dad", "rankdad", "powersgd"])
def test_a_replica_on_another_device_applies_steps_to_the_same_bits(name, device):
    """Two sites' messages, computed on the CPU, applied by a CPU replica and by one on ``device``."""
    workload = load_workload("digits-mlp", hidden=256)
    cpu = Replica(workload, make_strategy(name), OptimizerConfig(momentum=0.9, weight_decay=1e-3))
    other = Replica(workload, make_strategy(name), OptimizerConfig(momentum=0.9, weight_decay=1e-3), device=torch.device(device))
    other.load_weights_from(cpu)
    for step, messages in two_sites_steps(cpu, batch=16):
        assert other.apply(messages) == cpu.apply(messages), f"step {step}"


def two_sites_steps(replica: Replica, batch: int, steps: int = 3):
    """(step, messages) of two sites with consecutive batches of ``replica``'s training data,
    computed on ``replica``'s weights: the caller applies each step before the next is made."""
    sites = [replica.strategy.site(replica.layout, replica.model) for _ in range(2)]
    server = replica.strategy.server(replica.layout, replica.model)
    train = replica.workload.training_data()
    for step in range(steps):
        locals_ = [replica.local(train.inputs[i : i + batch], train.targets[i : i + batch]) for i in (2 * batch * step, (2 * step + 1) * batch)]
        yield step, exchange(sites, server, locals_, step)[0]


@pytest.mark.parametrize("optimizer", [OptimizerConfig(momentum=0.9, weight_decay=1e-3), OptimizerConfig(name="adam", lr=1e-3)], ids=["sgd", "adam"])
@pytest.mark.parametrize("name", ["dsgd", "dad", "rankdad", "powersgd"])
@pytest.mark.parametrize("spec", [("digits-mlp", {"hidden": 64}), ("char-transformer", {"d_model": 16, "layers": 1, "max_sequences": 64})], ids=lambda s: s[0])
def test_an_update_applied_one_parameter_at_a_time_has_the_bits_of_the_whole_one(spec, name, optimizer):
    """What a replica applies (``Decoded``: the messages decoded a parameter at a time, each
    entry stepped and freed) ends on the bits of the whole decoded update; the transformer's
    learned positions are a matrix rank-dAD compresses outside any captured layer."""
    workload = load_workload(spec[0], **spec[1])
    whole = Replica(workload, make_strategy(name), optimizer)
    each = Replica(workload, make_strategy(name), optimizer)
    each.load_weights_from(whole)
    for step, messages in two_sites_steps(whole, batch=8):
        assert each.apply(messages) == whole.apply_update(whole.decode(messages)), f"step {step}"


@pytest.mark.parametrize("optimizer", [OptimizerConfig(momentum=0.9, weight_decay=1e-3), OptimizerConfig(name="adam", lr=1e-3)], ids=["sgd", "adam"])
def test_a_parameter_of_one_chunk_steps_whole_to_the_bits_of_the_chunked_step(monkeypatch, optimizer):
    """``canonical_step`` steps a parameter of at most ``CHUNK_ELEMENTS`` as it is, without
    flat views; chunks of 7 elements (every parameter cut, most cuts ragged) end on the same bits."""
    from dadfl.strategies import canonical

    workload = load_workload("digits-mlp", hidden=16)
    whole = Replica(workload, make_strategy("dsgd"), optimizer)
    chunked = Replica(workload, make_strategy("dsgd"), optimizer)
    chunked.load_weights_from(whole)
    for step, messages in two_sites_steps(whole, batch=8):
        expected = whole.apply(messages)
        with monkeypatch.context() as patch:
            patch.setattr(canonical, "CHUNK_ELEMENTS", 7)
            assert chunked.apply(messages) == expected, f"step {step}"


def test_an_update_that_names_a_parameter_twice_is_refused():
    """A dict keeps a key's last value; entries made one at a time must not step a parameter
    twice: the coordinator's message check refuses them before the message is sent."""
    target = replica(hidden=8)
    name, param = next(iter(target.model.named_parameters()))

    class Twice:
        def items(self):
            return iter([(name, torch.ones_like(param)), (name, torch.ones_like(param))])

    with pytest.raises(ValueError, match="twice"):
        check_update(ModelFacts.from_model(target.model, target.layout), Twice())
    with pytest.raises(ValueError, match="twice"):
        target.apply_update(Twice())


def test_float64_factors_are_multiplied_in_float64():
    """Every replica decodes in float64 (``canonical.py``): a layer's factors are never narrowed
    back to the weight's float32 before their product, whose float32 sums differ between
    kernels; factors narrower than the weight (autocast's) are widened to it."""
    layer = replica(hidden=32).layout.layers[0]
    rows = 4096  # long sums: where float32 kernels round differently
    generator = torch.Generator().manual_seed(0)
    A = torch.randn(layer.groups, rows, layer.in_per_group, generator=generator).double()
    D = torch.randn(layer.groups, rows, layer.out_per_group, generator=generator).double()
    weight, bias = layer_gradient(layer, {tensor_key(layer.module, "A"): A, tensor_key(layer.module, "D"): D})
    assert weight.dtype == torch.float64 and torch.equal(weight, torch.bmm(D.transpose(1, 2), A).reshape(layer.weight_shape))
    assert bias.dtype == torch.float64 and torch.equal(bias, D.sum(dim=1).reshape(-1))
    weight, _ = layer_gradient(layer, {tensor_key(layer.module, "A"): A.bfloat16(), tensor_key(layer.module, "D"): D.bfloat16()})
    assert weight.dtype == layer.weight_dtype
