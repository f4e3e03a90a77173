"""Results carried between invocations, for a preset too long for one sitting.

The full matrix and the links take longer than a sitting of a 2-core machine (the links
alone about 70 minutes, which nothing else may share), and the per-step records under
``bench/results/`` stay on the machine that ran them. ``python -m bench.run --carry FILE``
measures part of a preset (``--workloads``, ``--parts``) and merges what it analysed with
what FILE holds from earlier invocations: every group of the settings it did not run, the
links' and the peers' results. It writes the union back to FILE (gzipped JSON, to commit
beside the code) and reports on the union, so the preset's report can be completed over
several sittings or machines.

A part is carried only while the code and the settings that measured it are those now.
FILE records, for the matrix, the links and the peers apart, a hash of every source that
decides their figures (the project's packages, and the benchmark's modules that part runs;
not the report's rendering, nor ``bench/presets.py``), and refuses to keep a part whose
sources changed, rather than mix two versions' figures. Settings are checked one group at a
time: each carried group holds a hash of its cells (setting, steps, seeds, strategies), so
changing one setting in ``bench/presets.py`` asks for that setting to be measured again and
keeps the others; the links' hash covers the setting and the strategies they run. The
report names the machines each setting ran on, since approximate strategies follow
different rounding on different float kernels.

The per-step records of a results folder (``--out``) are carried between invocations too:
an interrupted suite resumes by skipping the cells already finished there. The folder's
``measured.json`` records, for every run, a hash of the code and of the simulation that
measured it, so a run that the code and settings now would not produce is measured again
(or, with ``--report-only``, refused), never analysed as if it were theirs.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .analysis import matrix_order, totals
from .execute import cell_paths, simulation_config
from .links import STRATEGIES as LINK_STRATEGIES
from .matrix import Cell
from .presets import WIDE

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("dadfl", "strategies", "workloads", "protos")  # every .py file below these folders
RUNTIME = ("server", "client")  # the coordinator and site processes the links and the peer start
BENCH = ("__init__", "matrix", "execute", "workloads")  # bench/ modules every part imports
# Sources that decide each part's figures. The matrix runs the in-process simulation only.
PART_SOURCES = {
    "matrix": (PROJECT, BENCH + ("analysis", "costs")),
    "links": (PROJECT + RUNTIME, BENCH + ("links", "delay_relay", "coordinator_process")),
    "peers": (PROJECT + RUNTIME, BENCH + ("peers", "ddp_worker")),
}


def code_versions(root: Path = ROOT) -> dict[str, str]:
    """Per part, sha256 over the path and bytes of each of its source files, in path order."""
    versions = {}
    for part, (folders, modules) in PART_SOURCES.items():
        files = sorted(
            [path for folder in folders for path in (root / folder).rglob("*.py")]
            + [root / "bench" / f"{module}.py" for module in modules]
        )
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
        if part == "links":  # what the links run is chosen in bench/presets.py, which no part hashes
            digest.update(repr((WIDE, LINK_STRATEGIES)).encode())
        versions[part] = digest.hexdigest()
    return versions


def configurations(cells: list[Cell]) -> dict[str, str]:
    """Per group, sha256 over what each of its cells runs: its name, steps, setting (less its
    note, which only the report shows) and strategy."""
    runs = defaultdict(list)
    for cell in cells:
        setting = dataclasses.replace(cell.setting, note="")
        runs[cell.group].append(repr((cell.name, cell.steps, setting, cell.strategy)))
    return {group: hashlib.sha256("\n".join(sorted(found)).encode()).hexdigest() for group, found in runs.items()}


RECORD = "measured.json"  # in a results folder: per run, what measured it


def run_digests(cells: list[Cell], code: str) -> dict[str, str]:
    """Per cell, sha256 over the matrix's code (``code_versions()["matrix"]``) and the simulation
    the cell runs."""
    return {cell.name: hashlib.sha256((code + simulation_config(cell).model_dump_json()).encode()).hexdigest()
            for cell in cells}


def runs_of_others(out: Path, cells: list[Cell], digests: dict[str, str]) -> list[Cell]:
    """Cells with a finished run in ``out`` that the code and settings now (``digests``) did not
    measure: recorded with another hash, or not recorded (a folder written before the record)."""
    record = out / RECORD
    recorded = json.loads(record.read_text()) if record.exists() else {}
    return [cell for cell in cells if cell_paths(out, cell)[1].exists() and recorded.get(cell.name) != digests[cell.name]]


def record_runs(out: Path, digests: dict[str, str]) -> None:
    """Record what measures these cells in ``out`` now (before they run: a run's summary is written
    only once it finished, by this code)."""
    record = out / RECORD
    recorded = json.loads(record.read_text()) if record.exists() else {}
    record.write_text(json.dumps({**recorded, **digests}, indent=0, sort_keys=True))


CARRIED_KEYS = {"preset", "versions", "groups", "failed", "links", "peers"}


class CarryError(ValueError):
    """A carried file that cannot be merged with this invocation."""


def load(path: Path, preset: str) -> dict[str, Any] | None:
    """The results carried in ``path`` for ``preset``, or None when there is no such file."""
    if not path.exists():
        return None
    try:
        carried = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, ValueError) as exc:
        raise CarryError(f"{path} is not a carried-results file ({exc.__class__.__name__}); name another file") from None
    missing = CARRIED_KEYS - set(carried) if isinstance(carried, dict) else CARRIED_KEYS
    if missing:
        raise CarryError(f"{path} is not a carried-results file (it lacks {', '.join(sorted(missing))}); name another file")
    if carried.get("preset") != preset:
        raise CarryError(f"{path} carries the {carried.get('preset')!r} preset's results, not {preset!r}'s; name another file")
    return carried


def merge(
    path: Path, preset: str, measured: dict[str, Any], links: dict | None, peers: dict | None,
    configured: dict[str, str],
) -> tuple[dict[str, Any], dict | None, dict | None]:
    """Union of this invocation's ``measured`` results (links and peers where it has them) and
    those carried in ``path``; write it back to ``path`` and return (results, links, peers).
    A setting with groups in ``measured`` replaces its carried groups and failures.
    ``configured``: ``configurations`` of every cell of the preset now."""
    versions = code_versions()
    carried = load(path, preset) or {"groups": {}, "failed": [], "links": None, "peers": None, "versions": versions}
    ran = {group["setting"] for group in measured["groups"].values()}
    kept = {name: group for name, group in carried["groups"].items() if group["setting"] not in ran}
    kept_failed = {name for name in carried["failed"] if name.split("/", 1)[0] not in ran}
    keeps = {"matrix": bool(kept or kept_failed), "links": links is None and carried["links"] is not None,
             "peers": peers is None and carried["peers"] is not None}
    stale = [part for part, kept_part in keeps.items() if kept_part and carried["versions"].get(part) != versions[part]]
    if stale:
        raise CarryError(
            f"{path} holds {' and '.join(stale)} results measured with other code (their sources changed since): "
            "measure them again into it (every setting for the matrix, --parts links, --parts peers) with the "
            "code now, or name a new file"
        )
    changed = sorted({group["setting"] for name, group in kept.items() if group.get("configuration") != configured.get(name)})
    if changed:
        raise CarryError(
            f"{path} holds {', '.join(changed)} results measured with other settings (bench/presets.py changed their "
            f"cells since): measure them again into it (--workloads {','.join(changed)}), or name a new file"
        )
    measured_groups = {name: {**group, "configuration": configured[name]} for name, group in measured["groups"].items()}
    # The file is written with sorted keys: tables list each group's strategies in the matrix's order,
    # whether the group was measured now or carried.
    groups = {name: {**group, "strategies": dict(sorted(group["strategies"].items(), key=lambda item: matrix_order(item[1])))}
              for name, group in sorted({**kept, **measured_groups}.items())}
    failed = sorted(kept_failed | set(measured["failed"]))
    links = links if links is not None else carried["links"]
    peers = peers if peers is not None else carried["peers"]
    union = {"preset": preset, "versions": versions, "groups": groups, "failed": failed, "links": links, "peers": peers}
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime 0: the same results give the same bytes, so an unchanged file shows no diff.
    path.write_bytes(gzip.compress(json.dumps(union, sort_keys=True).encode(), mtime=0))
    return {**measured, "groups": groups, "failed": failed, **totals(groups), "carried": True}, links, peers
