"""The site half's saved strategy states, by the step they start, for replays and rejoins.

After applying step t the site saves its half's state as the state at step t + 1 (before it
reports the step done). When the server begins step t and the site's half is elsewhere (a
coordinator that restarted from an older checkpoint, an aborted attempt, a restarted site
process), the site restores the saved state at t. Step 0 is always the fresh half.

States live in memory and, when the site config has a ``state_dir``, in
``<state_dir>/<site id>/run-<run id>/half-<step>.pt`` (written to a temporary name, then renamed:
a kill leaves the old file or the new one); a stateless half's empty state is an empty
file. Only the states the server may still ask for are kept: the one at the server's
checkpoint step, and the two around the step under way (the step a site began by itself
still needs the state at its start for an abort of the step before).
They are derived from the site's gradients: keep ``state_dir`` as private as the data.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch

from .run_checks import RUN_ID

log = logging.getLogger("dadfl.site")

STATE_FILE = re.compile(r"^half-(\d{1,12})\.pt$")
RUN_FOLDER = "run-"

State = dict[str, torch.Tensor]


class HalfStates:
    """Saved half states of one run (see the module doc)."""

    def __init__(self, state_dir: Path | None, site_id: str, run_id: str, device: torch.device):
        self.device = device
        self.memory: dict[int, State] = {}
        self.on_disk: set[int] = set()  # read once: this site is the folder's only writer
        self.folder: Path | None = None
        if state_dir is None:
            return
        if not re.fullmatch(RUN_ID, run_id):
            log.warning("run id from the server is not a plain name: strategy state is kept in memory only")
            return
        site_folder = state_dir / site_id  # site ids are plain names (SiteConfig.site_id)
        self.folder = site_folder / f"{RUN_FOLDER}{run_id}"
        self.folder.mkdir(parents=True, exist_ok=True)
        for other in site_folder.glob(f"{RUN_FOLDER}*"):
            if other != self.folder and other.is_dir():
                shutil.rmtree(other, ignore_errors=True)  # a site takes part in one run at a time
        self.on_disk = {int(m.group(1)) for p in self.folder.iterdir() if (m := STATE_FILE.match(p.name))}

    def steps(self) -> set[int]:
        """Steps whose start this site can restore (0: the fresh half)."""
        return {0} | set(self.memory) | self.on_disk

    def save(self, step: int, state: State) -> None:
        self.memory[step] = state
        if self.folder is not None:
            path = self._path(step)
            if not state:  # a stateless half, every step: no serialiser, an empty file says it
                path.touch()
            else:
                tmp = path.with_name(path.name + ".tmp")
                torch.save(state, tmp)
                os.replace(tmp, path)
            self.on_disk.add(step)

    def load(self, step: int) -> State | None:
        """The state at ``step``; None when it is not saved or unreadable (the caller resets)."""
        if step in self.memory:
            return self.memory[step]
        if self.folder is None or not self._path(step).exists():
            return None
        try:
            if self._path(step).stat().st_size == 0:
                return {}
            return torch.load(self._path(step), map_location=self.device, weights_only=True)
        except Exception as exc:  # a torn or foreign file: the same as a lost one
            log.warning("strategy state file %s is unreadable (%s)", self._path(step).name, type(exc).__name__)
            return None

    def forget(self, step: int) -> None:
        self.memory.pop(step, None)
        self.on_disk.discard(step)
        if self.folder is not None:
            self._path(step).unlink(missing_ok=True)

    def keep_only(self, steps: set[int]) -> None:
        """Delete every saved state but those of ``steps``."""
        for step in self.steps() - steps - {0}:
            self.forget(step)

    def _path(self, step: int) -> Path:
        return self.folder / f"half-{step}.pt"
