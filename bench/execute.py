"""Run benchmark cells through the in-process simulation, in one or more worker processes.

Each cell writes ``<out>/runs/<cell name>.jsonl`` (one record per step, the keys of
``dadfl.metrics``) and, once finished, ``<cell name>.json`` (the simulation's summary
plus the cell's coordinates). A cell with its ``.json`` is done and is skipped on the
next run, so an interrupted suite resumes where it stopped. Every worker uses one
torch thread: on a shared machine, ``--jobs`` is the number of cores the suite takes.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import platform
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

import torch

from dadfl.metrics import MetricsWriter
from dadfl.simulation import SimulationConfig, simulate

from .matrix import DIRICHLET_ALPHA, Cell

RUNS = "runs"


def cell_paths(out: Path, cell: Cell) -> tuple[Path, Path]:
    base = out / RUNS / cell.name
    return base.with_suffix(".jsonl"), base.with_suffix(".json")


def simulation_config(cell: Cell) -> SimulationConfig:
    setting = cell.setting
    return SimulationConfig(
        workload=setting.workload,
        workload_options={**setting.options, "seed": cell.seed},
        sites=cell.sites,
        partition=cell.partition,
        alpha=DIRICHLET_ALPHA,
        batch_size=setting.batch_size,
        steps=cell.steps,
        eval_every=setting.eval_every,
        seed=cell.seed,
        device="cpu",
        optimizer=setting.optimizer,
        strategies=[cell.strategy],
        rank_every=0,  # the matrix plots the update's rank (``describe``); per-site ranks would cost its larger models seconds per step
    )


@functools.cache  # one machine per worker process: read /proc/cpuinfo once, not per cell
def machine() -> str:
    """The CPU and torch build a cell ran on: float kernels (AVX2 or AVX-512, say) round
    differently, so an approximate strategy's run repeats bit for bit on the same kind of
    machine but can follow another trajectory on a different one."""
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    return f"{model}, {torch.backends.cpu.get_cpu_capability()} kernels, torch {torch.__version__}"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def run_cell(cell: Cell, out: Path) -> tuple[float, bool]:
    """Train one cell; return its wall-clock seconds and whether it finished. A failure is written to
    ``<cell name>.failed`` (the report lists it) and the suite goes on."""
    torch.set_num_threads(1)
    metrics_path, summary_path = cell_paths(out, cell)
    failure_path = metrics_path.with_suffix(".failed")
    metrics_path.unlink(missing_ok=True)  # a partial file from an interrupted run
    failure_path.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        with MetricsWriter(metrics_path) as metrics:
            summary = simulate(simulation_config(cell), cell.strategy, metrics)
    except Exception:  # noqa: BLE001 - recorded, reported, and the other cells still run
        failure_path.write_text(traceback.format_exc())
        return time.perf_counter() - start, False
    summary.update(
        {
            "setting": cell.setting.key,
            "group": cell.group,
            "sites": cell.sites,
            "partition": cell.partition,
            "seed": cell.seed,
            "eval_every": cell.setting.eval_every,
            "spec": cell.strategy.model_dump(),
            "wall_seconds": time.perf_counter() - start,
            "machine": machine(),
        }
    )
    summary_path.write_text(json.dumps(summary, indent=1))
    return summary["wall_seconds"], True


def pending(cells: list[Cell], out: Path) -> list[Cell]:
    """Cells without a finished run of their current length and evaluation grid: a setting
    whose steps or grid changed runs again instead of reusing an older, different run."""
    return [cell for cell in cells if not finished_as_now(cell_paths(out, cell)[1], cell)]


def finished_as_now(summary_path: Path, cell: Cell) -> bool:
    if not summary_path.exists():
        return False
    summary = json.loads(summary_path.read_text())
    return summary["steps"] == cell.steps and summary.get("eval_every") == cell.setting.eval_every


def run_cells(cells: list[Cell], out: Path, jobs: int, log: Callable[[str], None] = print) -> None:
    """Run every cell not yet done; ``jobs`` > 1 uses that many worker processes."""
    todo = pending(cells, out)
    log(f"{len(cells) - len(todo)} of {len(cells)} cells already done; running {len(todo)} with {jobs} job(s)")
    started = time.perf_counter()

    def finished(index: int, cell: Cell, result: tuple[float, bool]) -> None:
        seconds, ok = result
        elapsed = time.perf_counter() - started
        remaining = elapsed / index * (len(todo) - index)
        status = f"{seconds:.1f} s" if ok else f"FAILED after {seconds:.1f} s, see {cell.name}.failed"
        log(f"[{index}/{len(todo)}] {cell.name}: {status} (elapsed {elapsed / 60:.1f} min, ~{remaining / 60:.1f} min left)")

    if jobs <= 1:
        for index, cell in enumerate(todo, start=1):
            finished(index, cell, run_cell(cell, out))
        return
    context = multiprocessing.get_context("spawn")  # no forked torch state
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(run_cell, cell, out): cell for cell in todo}
        for index, future in enumerate(as_completed(futures), start=1):
            finished(index, futures[future], future.result())


def run_part(argv: list[str] | None, prog: str, doc: str, measure: Callable[[int], dict], filename: str, steps: int) -> dict:
    """The command line of one part of the suite (``bench.links``, ``bench.peers``): ``--out``
    and ``--steps``, then ``measure(steps)`` written to ``<out>/<filename>``; returns it."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/full"), help="folder for the JSON result")
    parser.add_argument("--steps", type=int, default=steps)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = measure(args.steps)
    (args.out / filename).write_text(json.dumps(results, indent=1))
    return results
