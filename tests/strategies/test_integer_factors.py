"""Integer factors (``factor_bits``): rank-dAD's and PowerSGD's P and Q sent as 8-bit codes
with a scale per column, the rounding carried by the error memories, the bytes a quarter,
the uploads checked like any other, replicas still bit-identical."""

import pytest
import torch

from dadfl.metrics import MetricsWriter, read_metrics
from dadfl.simulation import SimulationConfig, StrategySpec, simulate
from dadfl.strategies import local_step, make_strategy, probe_layout, reference_update
from dadfl.strategies.base import Payload
from dadfl.strategies.checks import ModelFacts
from dadfl.strategies.quantize import quantize, unpack
from dadfl.strategies.step import exchange

from tests.helpers.model_zoo import build, per_sample_cross_entropy, site_batches

SIZES = (6, 2, 4)


def test_codes_decode_within_half_a_step_of_each_columns_scale():
    factor = torch.randn(3, 50, 4, generator=torch.Generator().manual_seed(0))
    factor[1, :, 2] = 0  # an all-zero column decodes to zero, not NaN
    factor[2, :, 0] *= 1e-6  # a small column keeps its own scale
    coded = quantize(factor, 8)
    assert coded.codes.dtype == torch.int8 and coded.scale.shape == (3, 1, 4)
    error = (coded.value() - factor).abs()
    assert bool((error <= coded.scale / 2 * (1 + 1e-6)).all())
    assert float(coded.value()[1, :, 2].abs().max()) == 0.0
    assert float(coded.scale[2, 0, 0]) < 1e-5 * float(coded.scale[2, 0, 1])  # not rounded to zero by the others
    assert int(coded.codes.abs().amax(dim=-2).min()) == 0 and int(coded.codes.abs().max()) == 127
    assert quantize(factor, 16).codes.dtype == torch.int16


def run(name, options, steps, bits):
    """``steps`` exchanges on the MLP's fixed weights, a new batch each; returns what the
    replicas decoded summed, the gradients summed, the halves and the last traffic."""
    model = build("mlp")
    layout = probe_layout(model, site_batches("mlp", sizes=SIZES)[0][0])
    strategy = make_strategy(name, factor_bits=bits, **options)
    sites, server = [strategy.site(layout, model) for _ in SIZES], strategy.server(layout, model)
    updates, gradients = {}, {}
    for step in range(steps):
        batches = site_batches("mlp", sizes=SIZES, seed=step)
        locals_ = [local_step(model, layout, per_sample_cross_entropy, x, y, capture=strategy.needs_factors)
                   for x, y in batches]
        messages, traffic = exchange(sites, server, locals_, step)
        for key, value in strategy.decode(layout, messages, model).items():
            updates[key] = updates.get(key, 0) + value
        for key, value in reference_update(model, per_sample_cross_entropy, batches).items():
            gradients[key] = gradients.get(key, 0) + value
    return layout, strategy, sites, server, updates, gradients, messages, traffic


@pytest.mark.parametrize("name,options", [
    ("rankdad", {"rank": 1, "raw_input": "low_rank"}),
    ("rankdad", {"rank": 1, "raw_input": "low_rank", "reduce_on_server": False}),  # the sites' codes sent on
    # the hook's memory: each site's own ("site", the default) keeps its Q_s's rounding, not Q's
    # on the way down (strategies/powersgd.py)
    ("powersgd", {"rank": 1, "start_iter": 0, "memory": "global"}),
])
def test_the_memories_carry_the_rounding_so_no_update_is_lost(name, options):
    """Sum of decoded updates + what the memories hold = sum of gradients, to float rounding:
    each sender's memory subtracts what the receivers decode from the codes, not the factors
    before rounding (8-bit rounding is ~1e-2 of each step, 1000× the tolerance). A server that
    concatenates keeps no memory: the sites' codes go down as they came."""
    total = sum(SIZES)
    layout, strategy, sites, server, updates, gradients, messages, _ = run(name, options, 10, 8)
    assert any(t.dtype == torch.int8 for m in messages for t in m.tensors.values()), "codes went down"
    if name == "rankdad":
        for layer in layout.layers:  # the bias folded in as the matrix's last column
            def matrix(values):
                return torch.cat((values[layer.weight].reshape(1, layer.out_per_group, -1),
                                  values[layer.bias].reshape(1, -1, 1)), dim=2)
            held = server.state.errors.get(layer.module, 0) + sum(
                site.state.errors[layer.module] * (n / total) for site, n in zip(sites, SIZES))
            gap = matrix(updates) + held - matrix(gradients)
            assert float(gap.norm()) <= 1e-5 * float(matrix(gradients).norm()), layer.module
    else:
        for matrix in sites[0].plan.matrices:
            held = sum(site.errors[matrix.name] * (n / total) for site, n in zip(sites, SIZES)).reshape(matrix.shape)
            gap = updates[matrix.name] + held - gradients[matrix.name]
            assert float(gap.norm()) <= 1e-5 * float(gradients[matrix.name].norm()), matrix.name


@pytest.mark.parametrize("name,options", [
    ("rankdad", {"rank": 2, "raw_input": "low_rank"}),
    ("powersgd", {"rank": 2, "start_iter": 0}),
])
def test_bytes_are_a_byte_per_factor_entry_plus_the_scales(name, options):
    """Every float P and Q entry of the 32-bit run becomes one byte; each factor adds one
    float scale per column; dense parts are unchanged."""
    *_, messages32, traffic32 = run(name, options, 1, 32)
    *_, messages8, traffic8 = run(name, options, 1, 8)
    for phase, (m32, m8) in enumerate(zip(messages32, messages8)):
        factor_entries = sum(t.numel() for k, t in m32.tensors.items() if k.endswith((":P", ":Q")))
        columns = sum(t.shape[-1] * t[..., :1, :].numel() // t.shape[-1]
                      for k, t in m32.tensors.items() if k.endswith((":P", ":Q")))
        assert factor_entries > 0
        expected = traffic32.up[phase][0] - 3 * factor_entries + 4 * columns
        assert traffic8.up[phase] == [expected] * len(SIZES), phase
        assert traffic8.down[phase] == traffic32.down[phase] - 3 * factor_entries + 4 * columns


@pytest.mark.parametrize("name,options", [
    ("rankdad", {"rank": 2, "raw_input": "low_rank"}),
    ("powersgd", {"rank": 1, "start_iter": 0}),
])
def test_integer_uploads_are_checked_like_any_other(name, options):
    """An honest 8-bit upload passes the strategy's own checks; a NaN scale, codes without
    their scale, and float factors where codes were agreed are refused, each saying which
    tensor; a coordinator's message with codes but no scale fails to decode with its name."""
    model = build("mlp")
    layout = probe_layout(model, site_batches("mlp", sizes=SIZES)[0][0])
    facts = ModelFacts.from_model(model, layout)
    strategy = make_strategy(name, factor_bits=8, **options)
    x, y = site_batches("mlp", sizes=SIZES)[0]
    payload = strategy.site(layout, model).begin(local_step(model, layout, per_sample_cross_entropy, x, y,
                                                            capture=strategy.needs_factors), 0)

    def refused(tensors):
        upload = Payload(0, 0, payload.num_samples, tensors)
        return [r.reason for r in strategy.check_uploads(layout, facts, 0, 0, [upload], [], model)]

    assert refused(payload.tensors) == []
    key = next(k for k, t in payload.tensors.items() if t.dtype == torch.int8)
    scale = key + "_scale"
    nan_scale = {**payload.tensors, scale: torch.full_like(payload.tensors[scale], float("nan"))}
    assert "NaN" in refused(nan_scale)[0] and scale in refused(nan_scale)[0]
    assert key in refused({k: t for k, t in payload.tensors.items() if k != scale})[0]
    as_floats = unpack(payload).tensors
    assert "_scale" in refused(as_floats)[0]  # names the form agreed: codes and their scales
    with pytest.raises(ValueError, match="without their scale"):
        unpack(Payload(0, 0, 1, {k: t for k, t in payload.tensors.items() if k != scale}))


@pytest.mark.parametrize("name", ["rankdad", "powersgd"])
def test_integer_factors_need_error_feedback_and_known_widths(name):
    feedback = {"rankdad": "error_feedback", "powersgd": "use_error_feedback"}[name]
    with pytest.raises(ValueError, match="needs error feedback"):
        make_strategy(name, factor_bits=8, **{feedback: False})
    with pytest.raises(ValueError, match="must be one of 8, 16, 32"):
        make_strategy(name, factor_bits=12)


@pytest.mark.parametrize("name,options", [
    ("rankdad", {"rank": 1, "raw_input": "low_rank"}),
    ("powersgd", {"rank": 1, "start_iter": 0}),
])
def test_simulation_replicas_stay_bit_identical_and_train(tmp_path, name, options):
    """The simulation checks every replica's fingerprint after every step (a record is
    written only when they agree); 8-bit factors train the character transformer, positions
    and the tied embedding included, as far as 32-bit ones within a few points."""
    finals = {}
    for bits in (32, 8):
        spec = StrategySpec(name=name, options={**options, "factor_bits": bits})
        config = SimulationConfig(
            workload="char-transformer", workload_options={"seq_len": 8, "d_model": 16, "layers": 1, "max_sequences": 400},
            sites=3, batch_size=8, steps=30, eval_every=30, device="cpu", strategies=[spec],
        )
        with MetricsWriter(tmp_path / f"{bits}.jsonl") as metrics:
            finals[bits] = simulate(config, spec, metrics)
        assert [r["step"] for r in read_metrics(tmp_path / f"{bits}.jsonl")] == list(range(30))
    assert finals[8]["bytes_up"] < 0.6 * finals[32]["bytes_up"]
    assert abs(finals[8]["metric"] - finals[32]["metric"]) < 0.05, (finals[8]["metric"], finals[32]["metric"])


@pytest.mark.parametrize("name,options", [
    ("rankdad", {"rank": 2, "raw_input": "low_rank"}),
    ("powersgd", {"rank": 2, "start_iter": 0}),
])
def test_the_benchmarks_cost_formula_counts_integer_factors_as_they_travel(tmp_path, name, options):
    """``bench.costs``'s bytes per step at 8 bits (entries at a byte, a float scale per factor
    column, the rest float) is what rank-dAD sends; PowerSGD sends its biases dense on top."""
    from bench.costs import breakdown

    parts = breakdown("digits-mlp", {"hidden": 16, "seed": 0})
    spec = StrategySpec(name=name, options={**options, "factor_bits": 8})
    config = SimulationConfig(workload="digits-mlp", workload_options={"hidden": 16}, sites=2, batch_size=8, steps=1,
                              eval_every=1, device="cpu", strategies=[spec])
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        sent = simulate(config, spec, metrics)["bytes_up_per_step"] / config.sites
    # PowerSGD: each bias as m floats instead of one more factor row of r codes
    biases, rank = sum(layer.bias for layer in parts.layers), options["rank"]
    unfolded = 4 * biases - rank * len(parts.layers) if name == "powersgd" else 0
    assert sent == parts.low_rank_bytes(rank, factor_bits=8) + unfolded
    assert parts.low_rank_bytes(rank) == 4 * parts.low_rank(rank), "floats: as before"


def test_the_integer_factors_preset_codes_the_low_rank_strategies_only():
    """``--preset integer-factors``: the dominance workloads and the two settings of the ≥100×
    target (at their own ranks), rank-dAD and PowerSGD at 8 bits (labelled so, their cells
    apart from the float ones), dSGD as floats; the links' setting, the wide MLP, also runs
    both at every rank as floats, on both splits, with the configurations the links run,
    and rank-dAD with its sites' factors concatenated on the downlink (not with one site,
    where there is nothing to concatenate)."""
    from bench import links, matrix, presets

    cells = matrix.cells(presets.INTEGER_FACTORS, matrix.RANKS, exact=False)
    assert {c.setting.key for c in cells} == {"digits-mlp", "digits-cnn", "char-gru", "char-transformer",
                                              "digits-mlp-wide", "char-transformer-3m"}
    ranks = {(c.setting.key, c.strategy.options["rank"]) for c in cells if "rank" in c.strategy.options}
    assert {r for key, r in ranks if key == "char-transformer-3m"} == set(presets.TARGET_RANKS)
    assert {r for key, r in ranks if key == "digits-cnn"} == set(matrix.RANKS)
    for cell in cells:
        coded = cell.strategy.name in ("rankdad", "powersgd")
        width = cell.strategy.options.get("factor_bits")
        assert ("8-bit" in cell.name) == (width == 8), cell.name
        if cell.setting.key != links.WIDE.key:
            assert (width == 8) == coded, cell.name
    wide = {(c.partition, c.strategy.display) for c in cells if c.setting.key == links.WIDE.key}
    compressed = {spec.display for spec in links.STRATEGIES if spec.name in ("rankdad", "powersgd")}
    assert any("8-bit" in label for label in compressed) and any("8-bit" not in label for label in compressed)
    assert {(partition, label) for partition in ("iid", "dirichlet") for label in compressed | {"dsgd"}} == wide
    concatenated = {spec.display: spec.options["rank"] for spec in links.STRATEGIES
                    if spec.options.get("reduce_on_server") is False}
    assert concatenated == {f"rankdad r={r}{bits} concat": r for r in presets.CONCATENATED_RANKS for bits in ("", " 8-bit")}
    assert not concatenated.keys() & {spec.display for spec in links.ONE_SITE}


def test_the_full_matrix_runs_every_configuration_the_links_time():
    """``docs/benchmarks.md``'s seconds to target multiply the links' step times by the full
    matrix's steps to target: its wide MLP runs every configuration the links time, on both
    splits. The integer-factors preset's wide MLP cells are full-matrix cells (the same
    simulation), so the two reports' steps to target agree."""
    from bench import links, matrix, presets
    from bench.execute import simulation_config

    full = {c.name: c for c in matrix.cells(presets.FULL, matrix.RANKS) if c.setting.key == links.WIDE.key}
    timed = {(partition, spec.display) for partition in ("iid", "dirichlet") for spec in links.STRATEGIES}
    assert timed <= {(c.partition, c.strategy.display) for c in full.values()}
    coded = [c for c in matrix.cells(presets.INTEGER_FACTORS, matrix.RANKS, exact=False) if c.setting.key == links.WIDE.key]
    assert len(coded) == 16 * 2 * (1 + 2 * 2 * len(presets.LINK_RANKS) + 2 * len(presets.CONCATENATED_RANKS))
    for cell in coded:
        assert simulation_config(cell) == simulation_config(full[cell.name]), cell.name


@pytest.mark.parametrize("bits", [32, 8])
def test_the_reports_bound_for_a_concatenated_downlink_is_what_it_sends(tmp_path, bits):
    """With ``reduce_on_server=False`` each site receives every site's rank-r factors: S× its
    upload. The report's bound for such a configuration (dSGD's bytes over its bytes per
    step) is the rank-r bound times 2 / (1 + S), and that is the ratio the run measures."""
    from bench.costs import breakdown
    from bench.report import rank_r_bound

    sites, rank, dense = 3, 2, breakdown("digits-mlp", {"hidden": 16, "seed": 0})
    options = {"rank": rank, "raw_input": "low_rank", "reduce_on_server": False, "factor_bits": bits}
    spec = StrategySpec(name="rankdad", options=options)
    # Every site in the aggregate (agreement weights may leave one out, sending less than the bound).
    config = SimulationConfig(workload="digits-mlp", workload_options={"hidden": 16}, sites=sites, batch_size=8, steps=1,
                              eval_every=1, device="cpu", strategies=[spec], agreement=False)
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        sent = simulate(config, spec, metrics)
    assert sent["bytes_up_per_step"] == sites * dense.low_rank_bytes(rank, factor_bits=bits)
    assert sent["bytes_down_per_step"] == sites * sent["bytes_up_per_step"]
    cost = {"bound": {str(rank): dense.bound(rank, factor_bits=bits)}}
    dsgd_per_step = 2 * sites * 4 * dense.dense
    measured = dsgd_per_step / (sent["bytes_up_per_step"] + sent["bytes_down_per_step"])
    assert rank_r_bound(cost, options, sites) == pytest.approx(measured, rel=1e-12)
    assert rank_r_bound(cost, {**options, "reduce_on_server": True}, sites) == cost["bound"][str(rank)]
