"""``dadfl.server.console`` — the operator's console: what ``dadfl status``, ``dadfl enroll --list``, ``dadfl readmit``
and ``dadfl stop`` read and do, from the server config and its run folder.

Everything here reads files the coordinator writes (``status.json``, ``metrics.jsonl``,
``quarantine.json``, the tokens file) or edits the operator's own switches
(``quarantine.json``); the one signal it sends is SIGTERM to the coordinator whose pid
``status.json`` names, after checking that the process is a dadfl server, so a pid the
system has since given to another program is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from dadfl.metrics import read_metrics

from .checkpoint import CHECKPOINT, FINAL_MODEL
from .config import ServerConfig
from .enrol import read_enrolment
from .progress import STATUS_FILE
from .quarantine import Quarantine

STOP_WAIT_S = 120.0  # `dadfl stop` waits this long for the coordinator to finish or abort its step


def read_status(run_dir: Path) -> dict | None:
    path = Path(run_dir) / STATUS_FILE
    if not path.exists():
        return None
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} does not read ({type(exc).__name__}); the coordinator rewrites it at its next step") from None
    if not isinstance(status, dict):
        raise ValueError(f"{path} is not a status the coordinator writes")
    return status


def server_running(status: dict | None) -> int | None:
    """The pid of the coordinator ``status`` describes when that process still runs, else None."""
    pid = status.get("pid") if status else None
    if type(pid) is not int or pid <= 0 or status.get("phase") in ("finished", "stopped by the operator"):
        return None
    if Path("/proc/self/cmdline").exists():  # Linux: the pid must still be a dadfl server
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        return pid if any(b"dadfl" in word for word in words) and b"server" in words else None
    try:
        os.kill(pid, 0)
    except OSError:
        return None
    return pid


def status_lines(run_dir: Path) -> list[str]:
    """``dadfl status``: the run's phase, step, sites, quarantine and last metrics."""
    status = read_status(run_dir)
    pid = server_running(status)
    lines = [f"run folder {run_dir}"]
    if status is None:
        lines.append("no coordinator has run here yet (no status.json)")
    else:
        phase = status.get("phase", "?") if pid or status.get("phase") in ("finished", "stopped by the operator") else (
            f"not running (the coordinator stopped while '{status.get('phase', '?')}'; see its log)"
        )
        age = time.time() - float(status.get("updated", 0))
        lines.append(f"phase: {phase}" + (f" (pid {pid}, updated {age:.0f} s ago)" if pid else ""))
        lines.append(f"step: {status.get('step', '?')} of {status.get('steps', '?')} (steps count from 0; this is the next to run)")
        if "needed" in status:
            lines.append(f"sites: {status.get('joined', '?')}/{status['needed']} joined")
    metrics = run_dir / "metrics.jsonl"
    records = list(read_metrics(metrics)) if metrics.exists() else []
    if records:
        last = records[-1]
        lines.append(f"last step {last['step']}: {len(last.get('site_ids', []))} sites ({', '.join(last.get('site_ids', []))}), train loss {last['train_loss']:.4f}")
        evaluated = next((r for r in reversed(records) if any(k.startswith(("eval_", "test_")) and k not in ("eval_by_site", "eval_samples") for k in r)), None)
        if evaluated is not None:
            scores = ", ".join(f"{k} {v:.4f}" for k, v in evaluated.items() if k.startswith(("eval_", "test_")) and isinstance(v, (int, float)) and k != "eval_samples")
            lines.append(f"last evaluation (after step {evaluated['step']}): {scores}")
    quarantined = Quarantine(run_dir, after=1).entries()
    lines.append("quarantined: " + (", ".join(f"{site} ({entry.get('refusals', '?')} refusals, step {entry.get('step', '?')})" for site, entry in quarantined.items()) or "none"))
    for name, what in ((CHECKPOINT, "checkpoint"), (FINAL_MODEL, "final model")):
        if (run_dir / name).exists():
            lines.append(f"{what}: {run_dir / name}")
    return lines


def enrolled_lines(config: ServerConfig) -> list[str]:
    """``dadfl enroll --list``: every enrolled site, whether it is quarantined; revoked ones."""
    sites, revoked = read_enrolment(Path(config.listen.tokens))
    quarantined = Quarantine(Path(config.run_dir), after=1).entries()
    lines = [f"{len(sites)} site(s) enrolled in {config.listen.tokens}"]
    for site_id, entry in sorted(sites.items()):
        notes = [f"enrolled {entry.get('enrolled', '?')}"]
        if entry.get("cert_serial"):
            notes.append(f"certificate {entry['cert_serial']}")
        if site_id in quarantined:
            notes.append(f"QUARANTINED in this run (`dadfl readmit {site_id}`)")
        lines.append(f"  {site_id}: {'; '.join(notes)}")
    for entry in revoked:
        lines.append(f"  revoked: {entry.get('site', '?')} on {entry.get('revoked', '?')}")
    return lines


def stop_server(run_dir: Path, wait_s: float = STOP_WAIT_S, before=None) -> str:
    """``dadfl stop``: SIGTERM to the running coordinator (``before()`` first, e.g. the audit
    record), then wait until it says it stopped."""
    status = read_status(run_dir)
    pid = server_running(status)
    if pid is None:
        raise ValueError(f"no coordinator runs for {run_dir} (status: {status.get('phase') if status else 'none'}); nothing to stop")
    if before is not None:
        before()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if server_running(read_status(run_dir)) is None:
            status = read_status(run_dir) or {}
            return f"coordinator {pid} stopped after {status.get('step', '?')} of {status.get('steps', '?')} steps ({status.get('phase', '?')})"
        time.sleep(0.2)
    raise ValueError(f"coordinator {pid} was asked to stop but still runs after {wait_s:.0f} s (its step may be waiting for a site); see its log")
