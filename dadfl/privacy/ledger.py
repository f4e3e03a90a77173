"""``dadfl.privacy.ledger`` — the site's own ledger of the differential privacy its records have spent, over every run.

The coordinator counts the releases of one run (``dadfl.privacy.coordinator``) and a site checks a
run's plan against its ``[privacy]`` floor before joining (``dadfl.trust.run_checks``). Neither
bounds what the site's records spend in all: a coordinator that restarts replays steps,
each a new release with fresh noise, and a coordinator may start one run after another on
the same data. So the site counts for itself: before every upload it makes under [dp] it
adds one step of (σ, q_s) to its ledger, on disk before the upload goes out, and with
``privacy.max_epsilon`` it refuses the upload that would take its records' ε above it.

- **What counts:** every upload, released or not (an aborted attempt and a replayed step
  count again): an upper bound, as the site cannot see which uploads the coordinator
  released. q_s is this site's own Poisson rate (each of its records is in a step's batch
  with that probability), at most the run's ``max_sample_rate``.
- **ε:** Rényi-DP composition of every entry (Opacus's RDP analysis, the orders of its
  accountant): ε(δ) of Σ_entries steps · RDP_(σ, q)(α), at the δ of the site's budget
  (``privacy.max_delta``), whatever δ a run states. Each upload is a fresh Poisson sample
  (``dadfl.privacy``), so each is one independent step of the mechanism. The ledger
  keeps that sum per order α as it counts (derived from the entries once, at the first
  upload), so the check before an upload adds one step's curve and converts: O(orders),
  whatever the number of entries (writing the file still takes every entry: they are the
  audit record). Adding step by step instead of multiplying by the count changes the
  sum in its last bits only (relative 1e-16 per step).
- **Admission:** a run is refused when what the other runs spent plus this run's planned
  steps exceed ``max_epsilon``; its own steps count as they happen, so a resumed site
  does not count a run twice before it restarts.
- **File:** ``<state_dir>/<site id>/privacy_ledger.json``, written to a temporary name,
  flushed to disk, then renamed (a kill leaves the old ledger or the new one), and held
  with an exclusive lock by one site process at a time. Deleting it forgets what was
  spent: keep it with the site's audit records. An unreadable ledger, or one that cannot
  be written, refuses every [dp] upload rather than start again from zero.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, ValidationError

from dadfl.config import StrictModel
from .accounting import SitePrivacy

log = logging.getLogger("dadfl.site")

LEDGER_FILE = "privacy_ledger.json"
LEDGER_VERSION = 1
MAX_ENTRIES = 100_000  # one per (run, σ, q): far beyond any site's history, bounds what a file can make us hold


class BudgetSpent(RuntimeError):
    """The next upload would take this site's ε above ``privacy.max_epsilon``."""


class LedgerEntry(StrictModel):
    run_id: str = Field(max_length=256)
    noise_multiplier: float = Field(gt=0, allow_inf_nan=False)
    sample_rate: float = Field(gt=0, le=1, allow_inf_nan=False)
    steps: int = Field(ge=0)


class LedgerFile(StrictModel):
    version: int = Field(ge=LEDGER_VERSION, le=LEDGER_VERSION)
    site_id: str
    entries: list[LedgerEntry] = Field(max_length=MAX_ENTRIES)


def _orders() -> list[float]:
    from opacus.accountants import RDPAccountant  # the [dp] extra

    return RDPAccountant.DEFAULT_ALPHAS


@functools.lru_cache(maxsize=256)
def _rdp_per_step(noise_multiplier: float, sample_rate: float) -> tuple[float, ...]:
    """One step's RDP at every order; infinite where the analysis divides by zero (σ ≈ 0)."""
    from opacus.accountants.analysis.rdp import compute_rdp  # the [dp] extra

    try:
        return tuple(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=_orders()))
    except ArithmeticError:
        return (math.inf,) * len(_orders())


def composed_rdp(entries: list[tuple[float, float, int]]) -> list[float]:
    """RDP at every order of the sampled Gaussian mechanisms (σ, q, steps) run one after
    another: Σ steps · RDP_(σ, q)(α), as Opacus's ``RDPAccountant`` sums its history, with each
    (σ, q)'s per-step curve computed once."""
    curves = [(steps, _rdp_per_step(sigma, q)) for sigma, q, steps in entries if steps > 0]
    return [sum(steps * curve[i] for steps, curve in curves) for i in range(len(_orders()))]


def rdp_epsilon(rdp: list[float], delta: float) -> float:
    """ε at ``delta`` of an RDP curve over the accountant's orders (Opacus's conversion)."""
    from opacus.accountants.analysis.rdp import get_privacy_spent  # the [dp] extra

    return float(get_privacy_spent(orders=_orders(), rdp=rdp, delta=delta)[0])


def composed_epsilon(entries: list[tuple[float, float, int]], delta: float) -> float:
    """ε at ``delta`` of ``entries`` (σ, q, steps) run one after another (0 before any step)."""
    if not any(steps > 0 for _, _, steps in entries):
        return 0.0
    return rdp_epsilon(composed_rdp(entries), delta)


class PrivacyLedger:
    """What this site's records have spent (module doc); ``path`` None keeps it in memory.
    ``budget`` is (max_epsilon, δ) from the site's ``[privacy]``; None counts without a limit.
    A ledger on disk is held with an exclusive lock until :meth:`close`."""

    def __init__(self, path: Path | None, site_id: str, budget: tuple[float, float] | None = None):
        self.path, self.site_id, self.budget = path, site_id, budget
        self.steps: dict[tuple[str, float, float], int] = {}  # (run id, σ, q) -> steps counted
        self.rdp: list[float] | None = None  # the RDP of every step counted, per order: from the entries at the first charge, then kept
        self._lock: int | None = None
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.close()
            raise BudgetSpent(
                f"another process holds the privacy ledger {path}: two site processes with the same site id and "
                "state_dir would each count only their own uploads; run one"
            ) from None
        if path.exists():
            try:
                ledger = LedgerFile.model_validate_json(path.read_bytes())
            except (OSError, ValidationError, ValueError) as exc:
                self.close()
                first = exc.errors()[0] if isinstance(exc, ValidationError) else None
                where = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else type(exc).__name__
                raise BudgetSpent(
                    f"the privacy ledger {path} cannot be read ({where}); restore it from a backup: starting a new "
                    "one would forget what this site's records have spent"
                ) from None
            if ledger.site_id != site_id:
                self.close()
                raise BudgetSpent(f"the privacy ledger {path} belongs to site {ledger.site_id!r}, not {site_id!r}")
            for e in ledger.entries:
                key = (e.run_id, e.noise_multiplier, e.sample_rate)
                self.steps[key] = self.steps.get(key, 0) + e.steps

    @classmethod
    def of_site(cls, state_dir: Path | None, site_id: str, budget: tuple[float, float] | None = None) -> "PrivacyLedger":
        return cls(None if state_dir is None else state_dir / site_id / LEDGER_FILE, site_id, budget)

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None

    def epsilon(self, history: list[tuple[float, float, int]]) -> float:
        """ε of ``history`` at the budget's δ; ∞ where the accountant cannot bound it (σ ≈ 0).
        A δ so large that the conversion goes negative never counts as spent."""
        return max(composed_epsilon(history, self.budget[1]), 0.0)  # NaN stays NaN: refused, never 0

    def _history(self, leave_out_run: str | None = None) -> list[tuple[float, float, int]]:
        return [(sigma, q, count) for (run_id, sigma, q), count in self.steps.items() if run_id != leave_out_run]

    def admit(self, run_id: str, noise_multiplier: float, sample_rate: float, steps: int) -> None:
        """Refuse a run whose planned steps, on top of what the other runs spent, pass the budget."""
        if self.budget is None:
            return
        limit, delta = self.budget
        history = self._history(leave_out_run=run_id)
        earlier = self.epsilon(history)
        planned = self.epsilon(history + [(noise_multiplier, sample_rate, steps)])
        log.info("privacy ledger: this site's records have spent ε = %.4g (δ = %g) in earlier runs", earlier, delta)
        if not planned <= limit:
            raise BudgetSpent(
                f"this site's records have spent ε = {earlier:.4g} in earlier runs (privacy ledger, δ = {delta:g}); "
                f"with this run's {steps} steps at σ = {noise_multiplier:.4g}, q = {sample_rate:.4g} they would "
                f"reach ε = {planned:.4g}, above privacy.max_epsilon = {limit:g}"
            )

    def charge(self, run_id: str, noise_multiplier: float, sample_rate: float) -> None:
        """Count one more step of (σ, q) for ``run_id``, on disk before it returns; refuse it,
        counting nothing, if it would pass the budget or cannot be written."""
        if self.path is not None and self._lock is None:
            raise BudgetSpent(f"the privacy ledger {self.path} was closed: the site sends nothing it cannot count")
        key = (run_id, noise_multiplier, sample_rate)
        if key not in self.steps and len(self.steps) >= MAX_ENTRIES:
            raise BudgetSpent(f"the privacy ledger holds {MAX_ENTRIES} entries already; archive it and start a new one deliberately")
        counted = {**self.steps, key: self.steps.get(key, 0) + 1}
        rdp = None
        if self.budget is not None:
            limit, delta = self.budget
            if self.rdp is None:
                self.rdp = composed_rdp(self._history())
            rdp = [spent + step for spent, step in zip(self.rdp, _rdp_per_step(noise_multiplier, sample_rate))]
            total = max(rdp_epsilon(rdp, delta), 0.0)  # NaN stays NaN: refused
            if not total <= limit:
                raise BudgetSpent(
                    f"one more step would take this site's records to ε = {total:.4g} (δ = {delta:g}, every upload "
                    f"under [dp] counted, replays included), above privacy.max_epsilon = {limit:g}: the site sends no more"
                )
        try:
            self._write(counted)
        except OSError as exc:
            raise BudgetSpent(f"the privacy ledger {self.path} cannot be written ({exc.strerror}): the site sends nothing it cannot count") from None
        self.steps, self.rdp = counted, rdp

    def _write(self, steps: dict) -> None:
        if self.path is None:
            return
        entries = [
            LedgerEntry(run_id=run_id, noise_multiplier=sigma, sample_rate=q, steps=count)
            for (run_id, sigma, q), count in steps.items()
        ]
        text = LedgerFile(version=LEDGER_VERSION, site_id=self.site_id, entries=entries).model_dump_json(indent=1)
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


@dataclass(frozen=True)
class RunReleases:
    """One [dp] run's charge to the ledger: every upload of this site is one step of (σ, q_s)."""

    ledger: PrivacyLedger
    run_id: str
    noise_multiplier: float
    sample_rate: float

    @classmethod
    def admit(cls, ledger: PrivacyLedger, run_id: str, privacy: SitePrivacy, sample_rate: float, steps: int) -> "RunReleases":
        ledger.admit(run_id, privacy.noise_multiplier, sample_rate, steps)
        return cls(ledger, run_id, privacy.noise_multiplier, sample_rate)

    def charge(self) -> None:
        self.ledger.charge(self.run_id, self.noise_multiplier, self.sample_rate)

    def spent(self) -> dict:
        """For the audit trail: σ, the sampling rate, the uploads of this run counted, and with a
        budget the ε this site's records have spent over every run."""
        ledger = self.ledger
        spent = {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                 "uploads_counted": ledger.steps.get((self.run_id, self.noise_multiplier, self.sample_rate), 0)}
        if ledger.budget is not None and ledger.rdp is not None:
            spent |= {"epsilon": max(rdp_epsilon(ledger.rdp, ledger.budget[1]), 0.0), "delta": ledger.budget[1]}
        return spent
