"""``dadfl.client.half_states`` — the site half's saved strategy states, by the step they start, for replays and rejoins.

After applying step t the site saves its half's state as the state at step t + 1 (before it
reports the step done). When the server begins step t and the site's half is elsewhere (a
coordinator that restarted from an older checkpoint, an aborted attempt, a restarted site
process), the site restores the saved state at t. Step 0 is always the fresh half.

States live in memory and, when the site config has a ``state_dir``, in
``<state_dir>/<site id>/run-<run id>/half-<step>.pt``, with only the newest in memory too. Only the states the server may still
ask for are kept: the one at the server's checkpoint step, and the two around the step under
way (the step a site began by itself still needs the state at its start for an abort of the
step before). They are derived from the site's gradients: keep ``state_dir`` as private as
the data.

A state is saved every step, so its file must cost little beside the step's compute. It is
written as a state file (``protos/state_file.py``: a ``PayloadHeader`` naming each
tensor's key, dtype and shape, then the raw bytes a chunk at a time, then the XXH3-128
digest of all of it; read back through the codec's own checks), and written into a state file that
is no longer needed (renamed to ``spare-*`` when it was dropped) instead of a new one: its
pages are already allocated, so a 4 MB state costs about 0.2 ms instead of torch.save's 2 ms
into a fresh file (CRC, page allocation, and the unlink of the old one). A save writes the
recycled file under a temporary name and renames it into place, so a kill leaves the old
state or the new one, never a torn one; a file whose digest or header does not check (a
power cut: nothing here is fsync'd) reads as lost, as does one that names another step.
A stateless half's empty state is an empty file: the empty file of the state the step drops,
renamed to the new step's name (``save`` with ``keep``), so its step costs one rename.

The states are saved every step, not only at the server's checkpoints: a site killed and
restarted rejoins at the step the server is at, which it can restore only from that step's
file (otherwise every replica resets its strategy state, which costs warm start and error
feedback and is no longer bit-identical to an uninterrupted run).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch

from dadfl.protos.state_file import fill, verify, write_state
from dadfl.sanitize import one_line
from dadfl.strategies import Payload

from dadfl.trust.run_checks import RUN_ID

log = logging.getLogger("dadfl.site")

STATE_FILE = re.compile(r"^half-(\d{1,12})\.pt$")
SPARE_PREFIX = "spare-"
RUN_FOLDER = "run-"
MAGIC = b"dadflhs2"  # a half state, version 2: the state file layout

State = dict[str, torch.Tensor]


class HalfStates:
    """Saved half states of one run (see the module doc)."""

    def __init__(self, state_dir: Path | None, site_id: str, run_id: str, device: torch.device):
        self.device = device
        self.memory: dict[int, State] = {}
        self.on_disk: set[int] = set()  # read once: this site is the folder's only writer
        self.spares: list[Path] = []  # dropped state files, written over by the next saves
        self.empty_spares: set[Path] = set()  # those of them known to be empty (dropped empty states)
        self.empty: set[int] = set()  # steps on disk whose state this process saved empty
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
        for path in self.folder.iterdir():
            if match := STATE_FILE.match(path.name):
                self.on_disk.add(int(match.group(1)))
            elif path.is_file():  # a spare or a save a kill interrupted: pages to write over
                self.spares.append(path)

    def steps(self) -> set[int]:
        """Steps whose start this site can restore (0: the fresh half)."""
        return {0} | set(self.memory) | self.on_disk

    def save(self, step: int, state: State, keep: set[int] | None = None) -> None:
        """Save ``state`` as the state at ``step``; with ``keep``, then :meth:`keep_only` ``keep``
        and ``step`` (an empty state takes over the empty file of a state that drops)."""
        if self.folder is not None:
            # The older states stay on disk only: in memory each would keep its own copy of
            # a model-sized state (rank-dAD's error memory) that the half has replaced since.
            self.memory.clear()
        self.memory[step] = state
        if self.folder is None:
            if keep is not None:
                self.keep_only(keep | {step})
            return
        if not state:  # a stateless half, every step: an empty file says it
            dropped = sorted(self.empty - keep - {step, 0}) if keep is not None else []
            if not (dropped and self._rename_empty(dropped[0], step)):
                self._save_empty(self._path(step))
            self.on_disk.add(step)
            self.empty.add(step)
            if keep is not None:
                self.keep_only(keep | {step})
            return
        self.empty.discard(step)
        path = self._path(step)
        tmp = path.with_name(path.name + ".tmp")
        if self.spares:
            spare = self.spares.pop()
            self.empty_spares.discard(spare)
            try:
                os.replace(spare, tmp)
            except FileNotFoundError:  # removed by hand: a new file serves as well
                pass
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)  # no O_TRUNC: keep the spare's pages
        with os.fdopen(descriptor, "wb", buffering=0) as file:
            write_state(file, Payload(step, 0, 0, state), magic=MAGIC)
            file.truncate()
        os.replace(tmp, path)
        self.on_disk.add(step)
        if keep is not None:
            self.keep_only(keep | {step})

    def _rename_empty(self, dropped: int, step: int) -> bool:
        """The empty state at ``dropped`` becomes the one at ``step`` (one rename, so a kill
        leaves either); False when its file is gone (removed by hand)."""
        try:
            os.replace(self._path(dropped), self._path(step))
        except FileNotFoundError:
            return False
        self.on_disk.discard(dropped)
        self.empty.discard(dropped)
        return True

    def _save_empty(self, path: Path) -> None:
        """An empty file at ``path``: a dropped empty one renamed (one system call), else a new one."""
        if self.empty_spares:
            spare = self.empty_spares.pop()
            self.spares.remove(spare)
            try:
                os.replace(spare, path)
                return
            except FileNotFoundError:  # removed by hand: a new file serves as well
                pass
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))

    def load(self, step: int) -> State | None:
        """The state at ``step``; None when it is not saved or unreadable (the caller resets)."""
        if step in self.memory:
            return self.memory[step]
        if self.folder is None or step not in self.on_disk:
            return None
        try:
            return self._read(step)
        except Exception as exc:  # a torn or foreign file: the same as a lost one
            log.warning("strategy state file %s is unreadable (%s)", self._path(step).name, one_line(str(exc), 120))
            return None

    def _read(self, step: int) -> State:
        with self._path(step).open("rb") as file:
            if not os.fstat(file.fileno()).st_size:
                return {}
            _, header = verify(file, MAGIC)
            if header.step != step:
                raise ValueError(f"it holds step {header.step}'s state")
            state: State = {}
            fill(file, lambda key, shape, dtype: state.setdefault(key, torch.empty(shape, dtype=dtype, device=self.device)), MAGIC)
        return state

    def forget(self, step: int) -> None:
        self.memory.pop(step, None)
        if step in self.on_disk:
            self.on_disk.discard(step)
            empty = step in self.empty
            self.empty.discard(step)
            spare = self.folder / f"{SPARE_PREFIX}{step}"
            try:
                os.replace(self._path(step), spare)
            except FileNotFoundError:
                return
            if spare in self.spares:  # a replayed step dropped twice: its old spare was just replaced
                self.spares.remove(spare)
            self.spares.append(spare)
            if empty or not spare.stat().st_size:  # an empty state's file (older states are on disk only)
                self.empty_spares.add(spare)
            else:
                self.empty_spares.discard(spare)

    def keep_only(self, steps: set[int]) -> None:
        """Drop every saved state but those of ``steps``; at most two dropped files stay as spares."""
        for step in self.steps() - steps - {0}:
            self.forget(step)
        while len(self.spares) > 2:
            spare = self.spares.pop(0)
            self.empty_spares.discard(spare)
            spare.unlink(missing_ok=True)

    def _path(self, step: int) -> Path:
        return self.folder / f"half-{step}.pt"
