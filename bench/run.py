"""``python -m bench.run``: run the benchmark matrix, analyse it, write the report.

    python -m bench.run                    # reduced smoke matrix, < 2 min on 2 cores
    python -m bench.run --full --jobs 2    # the whole matrix, real links, DDP peer;
                                           # publishes docs/benchmarks.md
    python -m bench.run --preset rankdad-ef --jobs 2
                                           # rank-dAD with error feedback against PowerSGD
                                           # (~1 h on 2 cores); publishes docs/rankdad-ef/
    python -m bench.run --preset integer-factors --jobs 2
                                           # the same with 8-bit factors (~2 h on 2
                                           # cores; --parts matrix,links adds the links,
                                           # ~50 min); publishes docs/integer-factors/

Finished cells are kept under ``--out`` and skipped when the command runs again, so an
interrupted suite resumes; ``--report-only`` re-analyses what is there. A preset longer
than one sitting is measured in parts that ``--carry FILE`` merges (``bench/carry.py``),
each part by the same code, on any machine; the published report is written once the
parts cover every setting:

    python -m bench.run --full --jobs 2 --parts matrix --workloads char-transformer-3m --carry bench/carried/full.json.gz
    python -m bench.run --full --parts links --carry bench/carried/full.json.gz
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import carry, links, matrix, peers, presets
from .analysis import analyse, write_results
from .execute import cell_paths, run_cells
from .report import write_report

SMOKE_OUT = Path("bench/results/smoke")
FULL_OUT = Path("bench/results/full")
DOCS = Path("docs")
# preset -> (settings, ranks, exact strategies too, results folder, published docs folder or None)
PRESETS = {
    "smoke": (presets.SMOKE, presets.SMOKE_RANKS, True, SMOKE_OUT, None),
    "full": (presets.FULL, matrix.RANKS, True, FULL_OUT, DOCS),
    "rankdad-ef": (presets.RANKDAD_EF, presets.EF_RANKS, False, Path("bench/results/rankdad-ef"), DOCS / "rankdad-ef"),
    "dominance": (presets.DOMINANCE, matrix.RANKS, False, Path("bench/results/dominance"), DOCS / "dominance"),
    "integer-factors": (
        presets.INTEGER_FACTORS, matrix.RANKS, False, Path("bench/results/integer-factors"),
        DOCS / "integer-factors",
    ),
}
LINKS, PEERS = "links.json", "peers.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole matrix (same as --preset full)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="which matrix (default: smoke, or full with --full)")
    parser.add_argument("--out", type=Path, help=f"results folder (default {SMOKE_OUT}, or {FULL_OUT} with --full)")
    parser.add_argument("--docs", type=Path, help="where benchmarks.md and img/ go (default: the preset's published folder, "
                        f"{DOCS} with --full, when the report covers every setting; else --out)")
    parser.add_argument("--workloads", help="comma-separated setting keys to run (default: all of the preset)")
    parser.add_argument("--seeds", help="comma-separated seeds replacing the preset's, e.g. 0,1,2")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes, one torch thread each (default 1)")
    parser.add_argument("--report-only", action="store_true", help="analyse the results already in --out; run nothing")
    parser.add_argument(
        "--parts", help="comma-separated parts to run: matrix, links, peers (default: all with --full, matrix otherwise)"
    )
    parser.add_argument(
        "--carry", type=Path,
        help="gzipped JSON of this preset's results from earlier invocations (same code): merged with this one's, "
        "written back, and the report covers the union",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.preset or ("full" if args.full else "smoke")
    preset, ranks, exact, default_out, published = PRESETS[name]
    out = args.out or default_out
    if args.carry is not None and args.seeds:
        print("error: --carry merges runs of the preset's own seeds; leave out --seeds", file=sys.stderr)
        return 2
    try:
        keys = args.workloads.split(",") if args.workloads else None
        seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None
        settings = matrix.select(preset, keys, seeds)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parts = set(args.parts.split(",")) if args.parts else ({"matrix", "links", "peers"} if name == "full" else {"matrix"})
    unknown = parts - {"matrix", "links", "peers"}
    if unknown:
        print(f"error: unknown part(s) {', '.join(sorted(unknown))}; choose from matrix, links, peers", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cells = matrix.cells(settings, ranks, exact)
    versions = carry.code_versions()  # once: every check below compares against the code now
    digests = carry.run_digests(cells, versions["matrix"])
    others = carry.runs_of_others(out, cells, digests)
    measuring = "matrix" in parts and not args.report_only
    # the folder's runs are analysed unless only carried parts other than the matrix are reported
    if others and not measuring and ("matrix" in parts or args.carry is None):
        print(f"error: {out} holds {len(others)} finished run(s) that the code and settings now did not measure (e.g. "
              f"{others[0].name}): measure them again (--parts matrix, without --report-only), or name another --out",
              file=sys.stderr)
        return 2
    if measuring:
        for cell in others:
            for path in cell_paths(out, cell):
                path.unlink(missing_ok=True)
        if others:
            print(f"{len(others)} finished run(s) in {out} were measured by other code or settings: measuring them again")
        carry.record_runs(out, digests)
        run_cells(cells, out, args.jobs)
    if not args.report_only:
        if "links" in parts:
            (out / LINKS).write_text(json.dumps(stamped(links.measure(), versions["links"]), indent=1))
        if "peers" in parts:
            (out / PEERS).write_text(json.dumps(stamped(peers.compare(), versions["peers"]), indent=1))
    # A union of carried parts took several invocations: no one wall time is its.
    minutes = None if args.report_only or args.carry else (time.perf_counter() - started) / 60
    try:
        if args.carry is None:
            results = analyse(out, settings, cells, size_sweep=name == "full")
            link_results, peer_results = load(out / LINKS, "links", versions), load(out / PEERS, "peers", versions)
            measured = {s.key for s in settings}
        else:
            # Costs for every setting of the preset; groups, links and peers from this invocation's parts only.
            analysed = analyse(out, preset, cells if "matrix" in parts else [], size_sweep=name == "full")
            results, link_results, peer_results = carry.merge(
                args.carry, name, analysed, *(load(out / file, part, versions) if part in parts else None
                                              for part, file in (("links", LINKS), ("peers", PEERS))),
                carry.configurations(matrix.cells(preset, ranks, exact)),
            )
            measured = {group["setting"] for group in results["groups"].values()}
    except carry.CarryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    json_path, csv_path = write_results(results, out)
    left_out = [s.key for s in preset if s.key not in measured]
    # Only a report on every setting replaces the published one; a partial report goes beside the results.
    docs = args.docs or (published if published and not left_out else out)
    held = {"links": link_results is not None, "peers": peer_results is not None}
    selection = ",".join(s.key for s in preset if s.key in measured) if left_out else None
    command = reproduce_command(name, selection, args.seeds, held)
    report = write_report(results, docs, command, minutes, links=link_results, peers=peer_results, left_out=left_out)
    print(f"results: {json_path}, {csv_path}; report: {report}")
    if results["failed"]:
        print(f"{len(results['failed'])} cell(s) failed: see {report}", file=sys.stderr)
        return 1
    return 0


def reproduce_command(preset: str, workloads: str | None, seeds: str | None, held: dict[str, bool]) -> str:
    """The one command that measures what the report holds: the preset, its selection, and the
    parts whose results are there (``held``: links, peers), whichever invocation measured them."""
    command = "python -m bench.run" + {"smoke": "", "full": " --full --jobs 2"}.get(preset, f" --preset {preset} --jobs 2")
    command += "".join(f" --{flag} {value}" for flag, value in (("workloads", workloads), ("seeds", seeds)) if value)
    parts = ["matrix"] + [part for part in ("links", "peers") if held[part]]
    if parts != (["matrix", "links", "peers"] if preset == "full" else ["matrix"]):
        command += f" --parts {','.join(parts)}"
    return command


def stamped(measured: dict, code: str) -> dict:
    """A part's results with the hash of the code that measured them (its ``carry.code_versions``)."""
    return {**measured, "code": code}


def load(path: Path, part: str, versions: dict[str, str]) -> dict | None:
    """A part's results in the results folder, or None; refused unless the code now (``versions``)
    measured them."""
    if not path.exists():
        return None
    measured = json.loads(path.read_text())
    if measured.get("code") != versions[part]:
        raise carry.CarryError(f"{path} was measured by other code: measure it again (--parts {part}) or remove it")
    return measured


if __name__ == "__main__":
    sys.exit(main())
