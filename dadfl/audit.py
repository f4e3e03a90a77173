"""``dadfl.audit`` — audit trails: append-only, hash-chained JSON lines at every party.

What a data-protection officer asks of a site — what left it, when, to whom, under what
code and what privacy budget — and of a coordinator — who joined, who was refused or
quarantined, what the operator did — is answered by one file each: the site's
``<state_dir>/<site_id>/audit.jsonl``, the coordinator's ``<run_dir>/audit.jsonl``.

Each line is one JSON object: ``seq`` (0, 1, 2 ...), ``time`` (UTC, ISO 8601), ``event``,
the event's fields, ``prev`` (the previous line's ``hash``; 64 zeros for the first) and
``hash`` = SHA-256 of the line's other keys as canonical JSON (sorted keys, no spaces).
Changing, inserting or deleting any line but the last breaks the chain at that line;
``dadfl audit verify FILE`` recomputes it, names the first line that breaks it and prints
what the file records. Cutting lines off the end leaves a valid shorter chain: the last
hash ``verify`` prints, noted elsewhere (a ticket, an e-mail), anchors everything before it.

Lines hold names, shapes, byte counts, ids and decisions — never a data value, a tensor's
contents, a token or a key. Appends take an exclusive ``flock`` (the coordinator and the
operator's commands write the same file) and are on disk before the call returns
(written through ``O_DSYNC``: each write returns once the line and the file's new length
are on disk, as ``fdatasync`` after it would, in one system call), so what is logged survives a crash;
a file whose last line does not parse is damaged and nothing more is appended to it
(:class:`AuditError`), as nothing should leave a site that its trail cannot record.

A site appends one line per upload, so an append must cost little beside a step: the log
remembers the chain's end it wrote last, with the file's identity, length and change time
as it left them, and reads the file's tail again only when any of those differs (another
writer appended, the file was cut or replaced). The tail is read from the end in growing
pieces until it holds a whole last line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

FILE = "audit.jsonl"
GENESIS = "0" * 64
TAIL_BYTES = 1 << 20  # the last line is found in this much of the file's end
FIRST_TAIL_BYTES = 1 << 12  # the first piece of the tail read: a line is a few hundred bytes
ROLES = {"A": "activations", "D": "deltas", "grad": "gradients", "P": "factors", "Q": "factors", "buffer": "buffers"}


class AuditError(RuntimeError):
    """The audit file cannot be appended to (damaged, or not writable)."""


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def line_hash(record: dict) -> str:
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "hash"})).hexdigest()


class AuditLog:
    """One party's audit file; :meth:`append` adds one chained line, on disk before it returns."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._folder_made = False
        # (file identity, length, change time) as the last append left it, and its chain's end
        self._end: tuple[tuple[int, int, int, int], str, int] | None = None

    def append(self, event: str, **fields) -> dict:
        try:
            if not self._folder_made:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._folder_made = True
            descriptor = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _DSYNC, 0o666)  # as open(path, "a+b")
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)  # released by the close
                if self._end is not None and self._end[0] == _identity(descriptor):
                    prev, seq = self._end[1], self._end[2]
                else:
                    prev, seq = self._tail(descriptor)
                record = {"seq": seq, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields, "prev": prev}
                record["hash"] = line_hash(record)
                line = memoryview(canonical(record) + b"\n")
                while line:
                    line = line[os.write(descriptor, line):]
                if not _DSYNC:
                    _sync(descriptor)
                self._end = (_identity(descriptor), record["hash"], seq + 1)
            finally:
                os.close(descriptor)
        except OSError as exc:
            self._end = None
            raise AuditError(f"the audit file {self.path} cannot be written ({exc.strerror or type(exc).__name__})") from None
        return record

    def _tail(self, descriptor: int) -> tuple[str, int]:
        """(the last line's hash, the next seq)."""
        size = os.fstat(descriptor).st_size
        if size == 0:
            return GENESIS, 0
        piece = FIRST_TAIL_BYTES
        while True:  # from the end, in growing pieces, until the piece holds a whole last line
            start = max(0, size - piece)
            tail = _read_at(descriptor, start, size - start)
            if not tail.endswith(b"\n"):
                raise AuditError(f"the audit file {self.path} ends in a cut line; `dadfl audit verify {self.path}` says where, archive it and start a new one")
            if start == 0 or b"\n" in tail[:-1] or piece >= TAIL_BYTES:
                break
            piece *= 4
        try:
            last = json.loads(tail[:-1].rsplit(b"\n", 1)[-1])
            return last["hash"], last["seq"] + 1
        except (ValueError, KeyError, TypeError):
            raise AuditError(f"the last line of the audit file {self.path} is not an audit record; run `dadfl audit verify {self.path}`") from None


def _identity(descriptor: int) -> tuple[int, int, int, int]:
    """What changes when anyone else writes, cuts or replaces the file: device, inode, length, change time."""
    status = os.fstat(descriptor)
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _read_at(descriptor: int, start: int, size: int) -> bytes:
    pieces = []
    while size > 0 and (piece := os.pread(descriptor, size, start)):
        pieces.append(piece)
        start, size = start + len(piece), size - len(piece)
    return b"".join(pieces)


# O_DSYNC, as fdatasync, puts the appended bytes and the length that makes them readable on
# disk, without the timestamps' write; a system without it syncs after the write (fdatasync,
# or fsync where there is none).
_DSYNC = getattr(os, "O_DSYNC", 0)
_sync = getattr(os, "fdatasync", os.fsync)


def payload_entry(payload) -> dict:
    """What one upload carries, without its values: per tensor the layer, the role in plain
    words (activations, deltas, gradients, factors), shape and bytes."""
    tensors = []
    for key, tensor in payload.tensors.items():
        layer, _, role = key.rpartition(":")
        tensors.append({"layer": layer, "role": ROLES.get(role, role), "shape": list(tensor.shape), "bytes": tensor.numel() * tensor.element_size()})
    return {"step": payload.step, "phase": payload.phase, "samples": payload.num_samples, "bytes": payload.nbytes(), "tensors": tensors}


def code_identity(module_name: str) -> dict:
    """The code a workload spec resolved to: its module's file's SHA-256 and, when the module
    belongs to an installed distribution, that distribution's name and version."""
    import sys
    from importlib import metadata

    module = sys.modules.get(module_name)
    identity: dict = {"module": module_name}
    source = getattr(module, "__file__", None)
    if source:
        identity["file_sha256"] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    top = module_name.split(".")[0]
    distributions = metadata.packages_distributions().get(top, [])
    if distributions:
        identity["distribution"] = distributions[0]
        identity["version"] = metadata.version(distributions[0])
    return identity


# ---------------------------------------------------------------- verifying and summarising


@dataclass
class Verified:
    lines: int = 0
    last_hash: str = GENESIS
    broken: str | None = None  # where and why the chain breaks; None: intact
    events: dict[str, int] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)


def verify(path: str | Path) -> Verified:
    """Recompute the chain of ``path``; stop at the first line that breaks it."""
    result, prev = Verified(), GENESIS
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            where = f"line {number}"
            if not raw.endswith(b"\n"):
                result.broken = f"{where} is cut short (no newline): a write that did not finish, or a cut file"
                break
            try:
                record = json.loads(raw)
                ok = isinstance(record, dict)
            except ValueError:
                ok = False
            if not ok:
                result.broken = f"{where} is not a JSON object"
                break
            if record.get("seq") != number - 1:
                result.broken = f"{where} has seq {record.get('seq')!r}, expected {number - 1}: a line was removed or inserted before it"
                break
            if record.get("prev") != prev:
                result.broken = f"{where} does not follow the line before it (prev differs): a line before it was changed, removed or inserted"
                break
            if record.get("hash") != line_hash(record):
                result.broken = f"{where} was changed after it was written (its hash does not match its contents)"
                break
            prev = record["hash"]
            result.lines, result.last_hash = number, prev
            result.events[record.get("event", "?")] = result.events.get(record.get("event", "?"), 0) + 1
            result.records.append(record)
    return result


def summary_lines(verified: Verified) -> list[str]:
    """What the file records, for a reader who is not an engineer."""
    lines = []
    records = verified.records
    if records:
        lines.append(f"{verified.lines} records from {records[0]['time']} to {records[-1]['time']}")
    for record in records:
        if record["event"] == "workload":
            code = record.get("code", {})
            version = f"{code.get('distribution')} {code.get('version')}" if code.get("version") else f"file sha256 {code.get('file_sha256', '?')[:16]}…"
            lines.append(f"{record['time']} run {record.get('run_id')}: workload {record.get('workload')} {record.get('decision')} "
                         f"({version}; strategy {record.get('strategy')}" + (f"; {record['reason']}" if record.get("reason") else "") + ")")
    runs: dict[str, dict] = {}
    for record in records:
        if record["event"] != "upload":
            continue
        run = runs.setdefault(record.get("run_id", "?"), {"to": record.get("coordinator"), "uploads": 0, "bytes": 0, "steps": set(), "what": {}, "dp": None, "first": record["time"]})
        run["uploads"] += 1
        run["bytes"] += record.get("bytes", 0)
        run["steps"].add(record.get("step"))
        run["last"] = record["time"]
        for tensor in record.get("tensors", []):
            run["what"].setdefault(tensor["role"], set()).add(tensor["layer"])
        if record.get("dp"):
            run["dp"] = record["dp"]
    for run_id, run in runs.items():
        steps = sorted(s for s in run["steps"] if isinstance(s, int))
        what = "; ".join(f"{role} of {len(layers)} layer{'s' if len(layers) > 1 else ''} ({', '.join(sorted(layers))})" for role, layers in run["what"].items())
        lines.append(f"run {run_id}: {run['uploads']} uploads to {run['to']} from {run['first']} to {run['last']}, steps {steps[0]}..{steps[-1]}, "
                     f"{run['bytes']:,} bytes in all")
        lines.append(f"  what left: {what or 'nothing'}; no raw records, labels or data values")
        if run["dp"]:
            dp = run["dp"]
            lines.append(f"  differential privacy: σ = {dp.get('noise_multiplier')}, sampling rate {dp.get('sample_rate')}, "
                         f"{dp.get('uploads_counted')} uploads counted" + (f", ε = {dp['epsilon']:.4g} at δ = {dp.get('delta')}" if dp.get("epsilon") is not None else ""))
        else:
            lines.append("  no differential privacy in this run")
    for event in ("join", "refused", "quarantined", "readmitted", "operator", "run"):
        if event in verified.events:
            lines.append(f"{verified.events[event]} {event} record(s)")
    for record in records:
        if record["event"] in ("quarantined", "readmitted", "operator"):
            detail = record.get("site") or record.get("command")
            lines.append(f"{record['time']} {record['event']}: {detail}" + (f" ({record['reason']})" if record.get("reason") else ""))
    return lines
