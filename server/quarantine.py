"""``dadfl.server.quarantine`` — sites refused too often are quarantined for the run, until the operator re-admits them.

The coordinator counts each site's refused uploads (a check failed, its contribution out
of bounds, bytes that do not decode). At ``federation.quarantine_after`` refusals the site
is written to ``run_dir/quarantine.json`` and refused at every later join with
PERMISSION_DENIED. The file is the operator's switch: ``dadfl readmit SITE`` (or deleting a
site's entry by hand) re-admits it (read at each join, no restart needed), with its count
back at zero.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("dadfl.server")

FILE = "quarantine.json"


class Quarantine:
    def __init__(self, run_dir: Path, after: int):
        self.path = Path(run_dir) / FILE
        self.after = after
        self.refusals: dict[str, int] = {}

    def entries(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path} is not a JSON object of quarantined sites ({exc}); fix or delete it") from None
        if not isinstance(entries, dict) or not all(isinstance(entry, dict) for entry in entries.values()):
            raise ValueError(f"{self.path} is not a JSON object of quarantined sites; fix or delete it")
        return entries

    def refusal(self, site_id: str) -> str | None:
        """Why ``site_id`` may not join, or None. A site the operator removed from the file
        starts again from zero refusals."""
        entry = self.entries().get(site_id)
        if entry is None:
            if self.refusals.get(site_id, 0) >= self.after:
                log.warning("site %s was re-admitted by the operator (removed from %s)", site_id, self.path)
                self.refusals[site_id] = 0
            return None
        return (
            f"site {site_id} is quarantined for this run after {entry.get('refusals', '?')} refused uploads "
            f"(last: {entry.get('reason', '?')}); the operator re-admits it with `dadfl readmit {site_id}`"
        )

    def refuse(self, site_id: str, step: int, reason: str) -> bool:
        """Count one refused upload; True when the site is now quarantined."""
        count = self.refusals[site_id] = self.refusals.get(site_id, 0) + 1
        if count < self.after:
            return False
        entries = self.entries()
        entries[site_id] = {"refusals": count, "step": step, "reason": reason}
        self._write(entries)
        log.warning("site %s quarantined after %d refused uploads; re-admit it with `dadfl readmit %s`", site_id, count, site_id)
        return True

    def readmit(self, site_id: str) -> dict:
        """The operator's re-admission: remove ``site_id``'s entry; returns it. A running
        coordinator admits the site at its next join."""
        entries = self.entries()
        if site_id not in entries:
            raise ValueError(f"site {site_id!r} is not quarantined in {self.path}; quarantined: {', '.join(entries) or 'none'}")
        entry = entries.pop(site_id)
        self._write(entries)
        return entry

    def _write(self, entries: dict[str, dict]) -> None:
        tmp = self.path.with_name(FILE + ".tmp")
        tmp.write_text(json.dumps(entries, indent=2) + "\n")
        os.replace(tmp, self.path)
