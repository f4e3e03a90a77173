"""The benchmark suite end to end on a tiny part of its smoke matrix (digits MLP, 2 sites).

Runs ``python -m bench.run`` as a user would and checks that the results and the report
are complete and agree with the strategies' cost formulas.
"""

import contextlib
import csv
import gzip
import io
import json
import math
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOAT = 4
SITES = 2
HIDDEN = 64  # the smoke preset's digits-mlp: 64 -> 64 -> 64 -> 10
LAYERS = [(64, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 10)]  # (in, out) of each Linear
RANK = 2  # the smoke preset's rank
STEPS, CATCH_UP = 30, 2  # the smoke preset's digits-mlp
EXACT = ("dsgd", "dad", "auto", "edad")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--workloads", "digits-mlp", "--out", str(out), "--jobs", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out, json.loads((out / "results.json").read_text())


def strategies(results):
    (group,) = results["groups"].values()
    return group, group["strategies"]


@pytest.mark.slow
@pytest.mark.network
def test_every_strategy_of_the_cell_finished_with_sane_curves(suite):
    out, results = suite
    group, stats = strategies(results)
    assert results["failed"] == []
    assert group["sites"] == SITES and group["partition"] == "iid"
    assert set(stats) == {"dsgd", "dad", "auto", "edad", f"rankdad r={RANK}", f"rankdad r={RANK} no EF", f"powersgd r={RANK}"}
    for label, s in stats.items():
        # The exact strategies run the setting's 30 steps; the others catch up to 2 × 30.
        last = STEPS if label in EXACT else STEPS * CATCH_UP
        assert s["curve_steps"] == list(range(5, last + 1, 5)), label
        assert all(0.0 <= m <= 1.0 for m in s["curve_metric"]), label
        assert all(b2 > b1 for b1, b2 in zip(s["curve_bytes"], s["curve_bytes"][1:])), label
        assert s["seconds_mean"] > 0 and math.isfinite(s["final_mean"]), label
    assert all(len(series) == STEPS * CATCH_UP for series in stats[f"rankdad r={RANK}"]["ranks"].values())
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(stats)
    report = (out / "benchmarks.md").read_text()
    assert "Target (a)" in report and "Target (b)" in report
    left_out = next(line for line in report.splitlines() if line.startswith("Left out of this run"))
    assert all(key in left_out for key in ("digits-cnn", "char-gru", "char-transformer")), left_out
    assert "--workloads digits-mlp" in report, "the command shown reproduces this run"
    assert f"| {STEPS}, others ≤ {STEPS * CATCH_UP} |" in report
    assert (out / "img" / "bench_digits-mlp_metric_vs_bytes.png").stat().st_size > 0


@pytest.mark.network
def test_exact_strategies_reach_the_same_metric(suite):
    _, results = suite
    group, stats = strategies(results)
    one_test_sample = 1 / 450  # float rounding may flip at most a borderline prediction
    for label in ("dad", "auto", "edad"):
        assert stats[label]["final_mean"] == pytest.approx(stats["dsgd"]["final_mean"], abs=one_test_sample), label
    # dSGD reaches its own target (its final metric minus half a point) by the last step.
    assert stats["dsgd"]["steps_to_target"] is not None and stats["dsgd"]["bytes_ratio_vs_dsgd"] == 1.0
    assert group["target"] == pytest.approx(stats["dsgd"]["final_mean"] - 0.005)


@pytest.mark.network
def test_strategies_that_catch_up_are_judged_at_dsgds_last_step_and_reach_the_target_later(suite):
    _, results = suite
    group, stats = strategies(results)
    for label, s in stats.items():
        at_last_dsgd_step = s["curve_metric"][s["curve_steps"].index(STEPS)]
        assert s["final_mean"] == pytest.approx(at_last_dsgd_step, abs=1e-9), label
    # Steps to target may lie past dSGD's last step for a strategy that caught up, never past its own last.
    for label, s in stats.items():
        if s["steps_to_target"] is not None:
            assert s["curve_metric"][s["curve_steps"].index(s["steps_to_target"])] >= group["target"], label
            assert s["steps_to_target"] <= s["curve_steps"][-1], label


@pytest.mark.network
def test_a_finished_cell_runs_again_when_its_setting_changes_length_or_grid(suite):
    """The suite resumes by skipping finished cells; a finished cell of another length or
    evaluation grid is stale and runs again instead of being reused."""
    from bench import matrix, presets
    from bench.analysis import analyse
    from bench.execute import pending

    out, _ = suite
    (setting,) = matrix.select(presets.SMOKE, ["digits-mlp"], None)
    cells = matrix.cells([setting], presets.SMOKE_RANKS)
    assert pending(cells, out) == []
    longer = matrix.cells([replace(setting, catch_up=3)], presets.SMOKE_RANKS)
    assert {c.strategy.display for c in pending(longer, out)} == {c.strategy.display for c in longer} - set(EXACT)
    regridded = matrix.cells([replace(setting, eval_every=10)], presets.SMOKE_RANKS)
    assert len(pending(regridded, out)) == len(regridded)
    # The analysis reads only runs of the matrix as it is now: the stale ones are left out.
    (group,) = analyse(out, [replace(setting, catch_up=3)], longer)["groups"].values()
    assert set(group["strategies"]) == set(EXACT)


def test_a_setting_whose_last_step_is_off_the_grid_of_those_that_catch_up_is_refused():
    from bench import matrix, presets

    (setting,) = matrix.select(presets.SMOKE, ["digits-mlp"], None)
    assert replace(setting, eval_every=10).catch_up == CATCH_UP  # 30 steps, every 10: on the grid
    with pytest.raises(ValueError, match="a multiple of eval_every"):
        replace(setting, eval_every=7)
    with pytest.raises(ValueError, match="catch_up ≥ 1"):
        replace(setting, catch_up=0)


@pytest.mark.slow
@pytest.mark.network
def test_a_finished_run_of_other_code_or_settings_is_measured_again_never_analysed(suite, tmp_path):
    """The results folder records what measured each run: a run recorded otherwise (another
    code version or setting) is refused by ``--report-only`` and measured again by a run; a
    folder without the record (written before it) is refused whole."""
    import shutil

    from bench.carry import RECORD

    source, results = suite
    out = tmp_path / "out"
    shutil.copytree(source, out)
    record = json.loads((out / RECORD).read_text())
    assert len(record) == results["cells"]
    changed = sorted(record)[0]
    (out / RECORD).write_text(json.dumps({**record, changed: "0" * 64}))
    refused = bench_run("--workloads", "digits-mlp", "--out", str(out), "--report-only")
    assert refused.returncode == 2 and f"holds 1 finished run(s) that the code and settings now did not measure (e.g. {changed})" in refused.stderr, refused.stderr
    again = bench_run("--workloads", "digits-mlp", "--out", str(out), "--jobs", "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 finished run(s)" in again.stdout and "running 1 with 1 job(s)" in again.stdout, again.stdout
    assert json.loads((out / RECORD).read_text()) == record
    def curves(groups: dict) -> dict:
        return {(name, label): (s["curve_metric"], s["curve_bytes"]) for name, group in groups.items()
                for label, s in group["strategies"].items()}

    remeasured = json.loads((out / "results.json").read_text())["groups"]
    assert curves(remeasured) == curves(results["groups"]), "the same code and settings measure the same"
    (out / RECORD).unlink()
    legacy = bench_run("--workloads", "digits-mlp", "--out", str(out), "--report-only")
    assert legacy.returncode == 2 and f"holds {results['cells']} finished run(s)" in legacy.stderr, legacy.stderr


def links_results(labels) -> dict:
    """A small ``links.json`` as ``bench.links`` writes it: two links, every label's runs alike."""
    run = {"seconds": 0.1, "wire_bytes_site": 1000, "phases": 1, "bound": 0.1, "over_bound": 1.0}
    return {
        "workload": "digits-mlp", "options": {"hidden": 1024}, "sites": 4, "steps": 6,
        "rates": {"unshaped": {"rtt": 1e-5}, "10 Mbit/s": {"rtt": 2e-5}},
        "strategies": {label: {"unshaped": run, "10 Mbit/s": run} for label in labels},
    }


@pytest.mark.slow
@pytest.mark.network
def test_links_and_peers_results_of_other_code_are_refused_not_reported(suite, tmp_path):
    """``links.json`` and ``peers.json`` in a results folder carry the hash of the code that
    measured them: the report takes them while it is the code now, and refuses them after."""
    import shutil

    from bench.carry import code_versions

    source, _ = suite
    out = tmp_path / "out"
    shutil.copytree(source, out)
    measured = links_results(("dsgd", "rankdad r=1"))
    (out / "links.json").write_text(json.dumps({**measured, "code": code_versions()["links"]}))
    taken = bench_run("--workloads", "digits-mlp", "--out", str(out), "--report-only")
    assert taken.returncode == 0, taken.stderr
    assert "## Real links" in (out / "benchmarks.md").read_text() and "| rankdad r=1 | 1 |" in (out / "benchmarks.md").read_text()
    for code in ("0" * 64, None):  # another version's, or from before the stamp
        (out / "links.json").write_text(json.dumps({**measured, "code": code}))
        refused = bench_run("--workloads", "digits-mlp", "--out", str(out), "--report-only")
        assert refused.returncode == 2 and "links.json was measured by other code: measure it again (--parts links)" in refused.stderr, refused.stderr
    (out / "links.json").unlink()
    (out / "peers.json").write_text(json.dumps({"steps": 100, "code": "0" * 64}))
    refused = bench_run("--workloads", "digits-mlp", "--out", str(out), "--report-only")
    assert refused.returncode == 2 and "(--parts peers)" in refused.stderr, refused.stderr


@pytest.mark.network
def test_bytes_match_the_cost_formulas(suite):
    _, results = suite
    _, stats = strategies(results)
    weights = sum(k * m for k, m in LAYERS)
    biases = sum(m for _, m in LAYERS)
    factors = sum(RANK * (k + m) for k, m in LAYERS)
    assert stats["dsgd"]["up_per_site"] == stats["dsgd"]["down_per_site"] == FLOAT * (weights + biases)
    rankdad, no_ef = stats[f"rankdad r={RANK}"], stats[f"rankdad r={RANK} no EF"]
    # With error feedback each bias is folded into its layer's factors (one more input column);
    # without, biases travel apart. Both re-reduced to rank r.
    folded = sum(RANK * (k + 1 + m) for k, m in LAYERS)
    assert rankdad["up_per_site"] == rankdad["down_per_site"] == FLOAT * folded
    assert no_ef["up_per_site"] == no_ef["down_per_site"] == FLOAT * (factors + biases)
    powersgd = stats[f"powersgd r={RANK}"]
    assert powersgd["up_per_site"] == powersgd["down_per_site"] == FLOAT * (factors + biases)
    assert results["costs"]["digits-mlp"]["low_rank"][str(RANK)] * FLOAT == rankdad["up_per_site"]
    assert [stats[k]["round_trips"] for k in ("dsgd", "dad", f"rankdad r={RANK}", f"powersgd r={RANK}")] == [1, 1, 1, 2]


@pytest.mark.network
def test_time_to_target_is_each_strategys_steps_times_its_step_time_on_the_link(suite, tmp_path):
    """The report's time-to-target tables on the smoke results, with link step times given:
    seconds = steps to target × measured s/step; dad/auto/edad take dSGD's steps; the choice
    table names the fastest."""
    from bench.report import FAMILIES, time_to_target_section

    _, results = suite
    group, stats = strategies(results)
    labels = list(stats)
    # Step times that make the slowest-converging strategy fastest on the link: the choice must follow seconds.
    reached = {label: s["steps_to_target"] for label, s in stats.items() if s["steps_to_target"]}
    assert "dsgd" in reached and len(reached) >= 3
    slowest = max(reached, key=reached.get)
    seconds = {label: (0.001 if label == slowest else 1.0 + i) for i, label in enumerate(labels)}
    links = {
        "setting": group["setting"], "sites": group["sites"],
        "rates": {"unshaped": {}, "1 Mbit/s, 40 ms RTT": {}},
        "strategies": {label: {"1 Mbit/s, 40 ms RTT": {"seconds": seconds[label], "bound": seconds[label] / 2}} for label in labels},
    }
    text = "\n".join(time_to_target_section(links, results, tmp_path, tmp_path))
    for label in labels:
        own = stats["dsgd"] if label in ("dad", "auto", "edad") else stats[label]
        steps = own["steps_to_target"]
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        reached = sorted(s for s in own["steps_to_target_per_seed"] if s is not None)
        spread = (f"{statistics.median(reached):g} ({reached[0]}–{reached[-1]}), {len(reached)}/{own['seeds']}" if reached
                  else f"none, 0/{own['seeds']}")
        if steps:
            assert f"| {steps} | {spread} | {steps * seconds[label]:.1f} ({steps * seconds[label] / 2:.1f}) |" in row, row
        else:
            assert f"| not reached | {spread} |" in row, row
    choice = next(line for line in text.splitlines() if line.startswith("| 1 Mbit/s, 40 ms RTT | IID |"))
    assert choice.endswith(f"**{slowest}** |"), choice
    family = next(name for name, members in FAMILIES.items() if slowest.split()[0] in members)
    pick = next(line for line in text.splitlines() if line.startswith("- Fastest to dSGD's target: "))
    assert pick.startswith(f"- Fastest to dSGD's target: {family} on ") and "1 Mbit/s, 40 ms RTT, IID" in pick, pick
    assert (tmp_path / f"bench_{group['setting']}_metric_vs_seconds.png").stat().st_size > 0


@pytest.mark.network
def test_one_site_step_times_give_their_own_time_to_target_ratio(suite, tmp_path):
    """With one-site step times beside the 4-site ones, the section and the summary state
    PowerSGD's time to target over rank-dAD's for each: fastest of each family, steps × s/step.
    The summary judges the link with the largest added round trip, and dSGD's time too."""
    from bench.report import time_to_target_lines, time_to_target_section

    _, results = suite
    group, stats = strategies(results)
    link = "1 Mbit/s, 40 ms RTT"
    family = {name: [label for label in stats if label.startswith(name) and stats[label]["steps_to_target"]]
              for name in ("rankdad", "powersgd")}
    assert family["rankdad"] and family["powersgd"], "the smoke matrix has compressed runs that reach the target"
    shared = {label: 1.0 for label in stats}  # shared cores: every step takes 1 s
    alone = {label: 0.5 + 0.1 * i for i, label in enumerate(family["rankdad"] + family["powersgd"])}
    # A shorter-delay link listed first, where rank-dAD is 3× slower: the summary must not judge it.
    nearer = "1 Mbit/s, 5 ms RTT"
    links = {
        "setting": group["setting"], "sites": group["sites"],
        "rates": {"unshaped": {}, nearer: {"added_rtt": 0.005}, link: {"added_rtt": 0.04}},
        "strategies": {label: {link: {"seconds": t, "bound": t},
                               nearer: {"seconds": 3 * t if label.startswith("rankdad") else t, "bound": t}}
                       for label, t in shared.items()},
        "one_site": {label: {link: {"seconds": t, "bound": t}} for label, t in alone.items()},
    }

    def fastest(times: dict[str, float], name: str) -> float:
        return min(stats[label]["steps_to_target"] * times[label] for label in family[name])

    expected = {times_name: fastest(times, "powersgd") / fastest(times, "rankdad")
                for times_name, times in (("shared", shared), ("alone", alone))}
    section = "\n".join(time_to_target_section(links, results, tmp_path, tmp_path))
    assert "with one-site step times (a core per process)" in section
    assert f"{fastest(alone, 'powersgd'):.1f} s, {expected['alone']:.2f}× rank-dAD's time" in section
    summary = "\n".join(time_to_target_lines(links, results))
    alone_seconds = {label: stats[label]["steps_to_target"] * alone[label] for label in alone}
    quickest = min(alone_seconds, key=alone_seconds.get)
    choice = next(line for line in section.splitlines() if line.startswith(f"| {link} | IID |"))
    assert choice.endswith(f"| {quickest}: {alone_seconds[quickest]:.1f} s |"), choice
    verdict = "**met**" if expected["shared"] >= 1.5 else "not met"
    assert (f"at {link}, PowerSGD's over rank-dAD's (goal ≥ 1.5×): IID {expected['shared']:.3f}× ({verdict}), "
            f"{expected['alone']:.3f}× with one-site step times (no re-reduction at the server)") in summary
    versus_dsgd = stats["dsgd"]["steps_to_target"] / min(stats[label]["steps_to_target"] for label in family["rankdad"])
    verdict = "**met**" if versus_dsgd >= 20 else "not met"
    assert f"at {link}, dSGD's over rank-dAD's (goal ≥ 20×): IID {versus_dsgd:.3f}× ({verdict})" in summary
    assert nearer not in summary


def test_the_links_section_reads_results_written_before_and_after_the_one_site_runs():
    """A ``links.json`` from before rank-dAD and PowerSGD ran 5× the steps and one site has
    neither ``steps_compressed`` nor ``one_site``: it still renders, saying what was run."""
    from bench.report import links_section

    before = links_results(("dsgd", "rankdad r=1"))
    run = before["strategies"]["dsgd"]["unshaped"]
    text = "\n".join(links_section(before))
    assert "6 steps per run;" in text and "one site" not in text
    after = {**before, "steps_compressed": 30, "one_site": {"rankdad r=1": {"unshaped": run, "10 Mbit/s": run}}}
    text = "\n".join(links_section(after))
    assert "6 steps per run (30 for rank-dAD and PowerSGD" in text
    assert "| rankdad r=1 | 0.100 | 0.100 | 0.100 | 1.000 |" in text  # the one-site table's row
    # what one site leaves out is said: rank-dAD's server has nothing to re-reduce
    assert "rank-dAD's re-reduction altogether" in text and "bench.bench_compute" in text


def test_the_links_tables_list_strategies_in_the_matrix_order():
    """A carried ``links.json`` comes back with its labels sorted: the tables still list exact
    updates, rank-dAD, PowerSGD, local steps, as the matrix's tables do; an unknown label last."""
    from bench.report import links_section

    matrix_order = ["dsgd", "auto", "rankdad r=1", "rankdad r=1 8-bit", "powersgd r=1", "fedavg H=8", "retired"]
    links = links_results(sorted(matrix_order))
    rows = [line.split(" | ")[0].removeprefix("| ") for line in links_section(links) if line.startswith("| ")]
    assert [row for row in rows if row in matrix_order] == matrix_order, rows


def test_compute_benchmark_takes_one_site_and_stays_bit_identical():
    """``bench.bench_compute --sites 1`` trains on the first site's share alone: every
    replica agrees (it raises otherwise), a rerun gives the same weights, and they differ
    from the 4-site run's (another batch mix, and a re-reduction at the server)."""
    from bench.bench_compute import run
    from dadfl.simulation import StrategySpec

    spec = StrategySpec.parse("rankdad:rank=2,raw_input=low_rank")
    one = run(spec, steps=3, warmup=0, sites_count=1)
    assert run(spec, steps=3, warmup=0, sites_count=1)["fingerprint"] == one["fingerprint"]
    assert one["fingerprint"] != run(spec, steps=3, warmup=0, sites_count=4)["fingerprint"]
    assert set(one) == {"strategy", "local_ms", "site_ms", "server_ms", "decode_ms", "apply_ms", "step_ms", "fingerprint"}


def test_dominance_measures_where_powersgd_leads_in_standard_errors():
    """Envelopes over (bytes, seed-mean metric, its standard error): a lead of PowerSGD's within one
    standard error of the difference is noise; a larger one, or one before rank-dAD's first
    evaluation, is not. The strict verdict is unchanged by it."""
    from bench.analysis import dominance

    ours = [([1.0, 2.0, 3.0], [0.50, 0.70, 0.90], [0.05, 0.05, 0.05])]
    assert dominance(ours, [([1.0, 2.0, 3.0], [0.40, 0.60, 0.80], [0.05, 0.05, 0.05])]) | {"range": None} == {
        "dominates": True, "fraction": 1.0, "worst_gap": pytest.approx(0.1), "budgets": 3, "range": None,
        "largest_lead_se": 0.0, "within_noise": True,
    }
    # PowerSGD ahead by 0.02 at budget 2, s.e. 0.05 each: 0.02 / √(0.05² + 0.05²) = 0.28 standard errors.
    close = dominance(ours, [([1.0, 2.0, 3.0], [0.40, 0.72, 0.80], [0.05, 0.05, 0.05])])
    assert not close["dominates"] and close["within_noise"]
    assert close["largest_lead_se"] == pytest.approx(0.02 / math.hypot(0.05, 0.05))
    # Two rank-dAD configurations: the envelope takes the best within each budget, with its own s.e.
    two = [([1.0, 3.0], [0.50, 0.90], [0.05, 0.05]), ([2.0], [0.80], [0.001])]
    far = dominance(two, [([2.0], [0.85], [0.001])])
    assert not far["within_noise"] and far["largest_lead_se"] == pytest.approx(0.05 / math.hypot(0.001, 0.001))
    early = dominance([([2.0], [0.9], [0.0])], [([1.0, 2.0], [0.3, 0.8], [0.1, 0.1])])
    assert not early["dominates"] and math.isinf(early["largest_lead_se"]) and not early["within_noise"]


@pytest.mark.network
def test_the_report_says_which_machines_the_runs_ran_on(suite):
    """Every cell records its CPU and torch build; the report names it, and warns when runs of
    different kinds are mixed (approximate strategies round differently on each)."""
    from bench.execute import machine
    from bench.report import machine_lines

    out, results = suite
    assert results["machines"] == {machine(): results["cells"]}
    report = (out / "benchmarks.md").read_text()
    assert f"Every run ran on: {machine()}." in report
    a, b = "CPU A, AVX512 kernels, torch 2.13.0", "not recorded"
    groups = {"x/2-iid": {"setting": "x", "machines": {a: 3}}, "y/2-iid": {"setting": "y", "machines": {a: 1, b: 2}}}
    mixed = " ".join(machine_lines({"machines": {a: 4, b: 2}, "groups": groups}))
    assert "2 kinds of machine" in mixed and "not bit-comparable" in mixed
    assert f"{a} (4 runs: x, y)" in mixed and f"{b} (2 runs: y)" in mixed, "each kind names the settings it ran"



@pytest.mark.network
def test_the_dominance_table_shows_powersgds_lead_in_standard_errors(suite):
    out, results = suite
    group, _ = strategies(results)
    family = group["dominance"]["family"]
    lead = "∞" if math.isinf(family["largest_lead_se"]) else f"{family['largest_lead_se']:.2f}"
    report = (out / "benchmarks.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith(f"| {group['setting']} | ") and " vs " in line)
    assert f"| {lead} | {'**yes**' if family['within_noise'] else 'no'} |" in row, row


@pytest.mark.network
@pytest.mark.parametrize(
    "preset, workloads, parts, expected",
    [
        ("smoke", "digits-mlp", [], "python -m bench.run --workloads digits-mlp"),
        ("integer-factors", None, ["links"], "python -m bench.run --preset integer-factors --jobs 2 --parts matrix,links"),
        ("full", None, ["links", "peers"], "python -m bench.run --full --jobs 2"),
        ("full", None, ["peers"], "python -m bench.run --full --jobs 2 --parts matrix,peers"),
    ],
)
def test_the_reproduce_command_names_the_parts_whose_results_the_report_holds(preset, workloads, parts, expected):
    from bench.run import reproduce_command

    held = {part: part in parts for part in ("links", "peers")}  # measured by this or an earlier invocation
    assert reproduce_command(preset, workloads, None, held) == expected


def bench_run(*args: str) -> subprocess.CompletedProcess:
    """``python -m bench.run ARGS``: a process of its own when it measures; with ``--report-only``
    its ``main`` in this process (it only reads and writes files: a process would add the
    seconds of its imports and nothing else)."""
    if "--report-only" not in args:
        return subprocess.run([sys.executable, "-m", "bench.run", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    from bench.run import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return subprocess.CompletedProcess(["bench.run", *args], code, stdout.getvalue(), stderr.getvalue())


@pytest.mark.slow
@pytest.mark.network
def test_a_preset_measured_in_two_sittings_reports_as_one(suite, tmp_path):
    """``--carry``: the digits MLP measured by the suite's invocation, the other three settings by
    another into another folder; the second report covers all four, the first's groups unchanged."""
    out, results = suite
    carried = tmp_path / "carried.json.gz"
    first = bench_run("--workloads", "digits-mlp", "--out", str(out), "--report-only", "--carry", str(carried),
                      "--docs", str(tmp_path / "first"))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Left out of this run" in (tmp_path / "first" / "benchmarks.md").read_text()
    second_out = tmp_path / "second"
    second = bench_run("--workloads", "digits-cnn,char-gru,char-transformer", "--out", str(second_out), "--carry", str(carried))
    assert second.returncode == 0, second.stdout + second.stderr
    union = json.loads((second_out / "results.json").read_text())
    assert {g["setting"] for g in union["groups"].values()} == {"digits-mlp", "digits-cnn", "char-gru", "char-transformer"}
    configuration = smoke_configurations()["digits-mlp/2-iid"]  # what each carried group is checked against
    assert union["groups"]["digits-mlp/2-iid"] == {**results["groups"]["digits-mlp/2-iid"], "configuration": configuration}
    assert union["cells"] == sum(g["runs"] for g in union["groups"].values()) > results["cells"]
    report = (second_out / "benchmarks.md").read_text()
    assert "Left out of this run" not in report and "    python -m bench.run\n" in report, "the union is the whole preset"
    # Results of other code are refused, not mixed in.
    stale = json.loads(gzip.decompress(carried.read_bytes()))
    carried.write_bytes(gzip.compress(json.dumps({**stale, "versions": {**stale["versions"], "matrix": "0" * 64}}).encode()))
    refused = bench_run("--workloads", "digits-cnn", "--out", str(second_out), "--report-only", "--carry", str(carried))
    assert refused.returncode == 2 and "holds matrix results measured with other code" in refused.stderr, refused.stderr
    other = bench_run("--preset", "dominance", "--out", str(second_out), "--docs", str(tmp_path / "docs"), "--report-only",
                      "--carry", str(carried))
    assert other.returncode == 2 and "carries the 'smoke' preset's results" in other.stderr, other.stderr


def smoke_configurations(**changes) -> dict[str, str]:
    """The smoke preset's group configurations, with ``changes`` made to its digits MLP setting."""
    from bench import matrix, presets
    from bench.carry import configurations

    settings = [replace(s, **changes) if s.key == "digits-mlp" else s for s in presets.SMOKE]
    return configurations(matrix.cells(settings, presets.SMOKE_RANKS))


def test_carried_links_and_peers_stay_until_a_part_measures_them_again(tmp_path):
    from bench.carry import merge

    configured = smoke_configurations()
    path = tmp_path / "carried.json.gz"
    # In the matrix's order, which is not the alphabetical one the file's sorted keys give back.
    strategies = {label: {"name": label.split()[0], "options": {"rank": 1} if " " in label else {}}
                  for label in ("dsgd", "auto", "rankdad r=1", "powersgd r=1")}
    group = {"setting": "digits-mlp", "runs": 2, "run_seconds": 3.0, "machines": {"CPU A": 2}, "strategies": strategies}
    measured = {"groups": {"digits-mlp/2-iid": group}, "failed": ["digits-mlp/2-iid/seed0/dad"], "costs": {}}
    merge(path, "smoke", measured, {"rates": "first"}, None, configured)
    nothing_run = {"groups": {}, "failed": [], "costs": {}}  # e.g. --report-only over an empty folder, or --parts peers
    results, links, peers = merge(path, "smoke", nothing_run, None, {"steps": 100}, configured)
    assert list(results["groups"]["digits-mlp/2-iid"]["strategies"]) == list(strategies), "carried groups keep the matrix's order"
    assert links == {"rates": "first"} and peers == {"steps": 100}, "each part keeps what the other measured"
    kept = {**group, "configuration": configured["digits-mlp/2-iid"]}
    assert results["groups"] == {"digits-mlp/2-iid": kept} and results["failed"] == ["digits-mlp/2-iid/seed0/dad"]
    assert (results["cells"], results["cell_seconds"], results["machines"]) == (2, 3.0, {"CPU A": 2})
    again = {**group, "runs": 1, "machines": {"CPU B": 1}}
    rerun = {"groups": {"digits-mlp/2-iid": again}, "failed": [], "costs": {}}
    results, links, _ = merge(path, "smoke", rerun, {"rates": "second"}, None, configured)
    assert results["groups"] == {"digits-mlp/2-iid": {**again, "configuration": kept["configuration"]}} and results["failed"] == [], "a setting run again replaces its own"
    assert links == {"rates": "second"} and results["machines"] == {"CPU B": 1}


def test_each_part_is_kept_only_while_its_own_sources_are_unchanged(tmp_path):
    from bench.carry import CarryError, code_versions, merge

    configured = smoke_configurations()
    path = tmp_path / "carried.json.gz"
    group = {"setting": "digits-mlp", "runs": 1, "run_seconds": 1.0, "machines": {"CPU A": 1}, "strategies": {}}
    merge(path, "smoke", {"groups": {"digits-mlp/2-iid": group}, "failed": []}, {"rates": "old"}, None, configured)
    carried = json.loads(gzip.decompress(path.read_bytes()))
    assert carried["versions"] == code_versions() and len(set(code_versions().values())) == 3, "one hash per part"
    # The links' sources changed since they were measured (bench/links.py, say): the matrix groups still count.
    carried["versions"]["links"] = "0" * 64
    path.write_bytes(gzip.compress(json.dumps(carried).encode()))
    with pytest.raises(CarryError, match="holds links results measured with other code"):
        merge(path, "smoke", {"groups": {}, "failed": []}, None, None, configured)
    results, links, _ = merge(path, "smoke", {"groups": {}, "failed": []}, {"rates": "new"}, None, configured)
    assert links == {"rates": "new"} and list(results["groups"]) == ["digits-mlp/2-iid"], "measured again, kept"
    assert json.loads(gzip.decompress(path.read_bytes()))["versions"]["links"] == code_versions()["links"]
    # A gzipped JSON that is not one (hand-edited, truncated to its header) is refused by name, not a KeyError.
    path.write_bytes(gzip.compress(json.dumps({"preset": "smoke", "groups": {}}).encode()))
    with pytest.raises(CarryError, match=r"is not a carried-results file \(it lacks failed, links, peers, versions\)"):
        merge(path, "smoke", {"groups": {}, "failed": []}, None, None, configured)


def test_a_changed_setting_asks_for_that_setting_alone_to_be_measured_again(tmp_path, monkeypatch):
    """Each carried group is checked against its own setting's cells: a longer catch-up for the
    digits MLP refuses its carried groups by name and keeps the CNN's; a new note changes no cell."""
    from bench import carry, presets
    from bench.carry import CarryError, code_versions, merge

    path = tmp_path / "carried.json.gz"
    groups = {name: {"setting": name.split("/")[0], "runs": 1, "run_seconds": 1.0, "machines": {"CPU A": 1}, "strategies": {}}
              for name in ("digits-mlp/2-iid", "digits-cnn/2-dirichlet")}
    merge(path, "smoke", {"groups": groups, "failed": []}, None, None, smoke_configurations())
    assert smoke_configurations(note="reworded") == smoke_configurations(), "the note is the report's, not a cell's"
    longer = smoke_configurations(catch_up=3)
    assert longer["digits-cnn/2-dirichlet"] == smoke_configurations()["digits-cnn/2-dirichlet"]
    with pytest.raises(CarryError, match=r"holds digits-mlp results measured with other settings .*--workloads digits-mlp\)"):
        merge(path, "smoke", {"groups": {}, "failed": []}, None, None, longer)
    again = {**groups["digits-mlp/2-iid"], "runs": 2}
    results, _, _ = merge(path, "smoke", {"groups": {"digits-mlp/2-iid": again}, "failed": []}, None, None, longer)
    assert results["groups"]["digits-mlp/2-iid"]["runs"] == 2 and "digits-cnn/2-dirichlet" in results["groups"]
    # The links run the wide MLP's setting, chosen in bench/presets.py: a change to it is a change to the links' part.
    before = code_versions()
    monkeypatch.setattr(carry, "WIDE", replace(presets.WIDE, batch_size=2 * presets.WIDE.batch_size))
    after = code_versions()
    assert after["links"] != before["links"] and {p: after[p] for p in ("matrix", "peers")} == {p: before[p] for p in ("matrix", "peers")}
