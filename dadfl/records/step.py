"""``dadfl.records.step`` — one committed step of a run: a line of ``metrics.jsonl``, the same keys in every runtime.

Every runtime (the in-process simulation, the gRPC coordinator, the Flower server app)
fills one :class:`StepRecord` per step and writes :meth:`StepRecord.to_json`; ``dadfl
report``, :func:`~dadfl.metrics.run_summary`, the operator's view and the benchmarks read
its JSON keys. A field left None is not written: the keys a line has say what its runtime
measures.

Keys: ``strategy``, ``step``, ``sites``, ``samples`` (N), ``train_loss`` (mean over the
step's samples), ``bytes_up`` and ``bytes_down`` (exact payload bytes summed over all
sites; down counts every site's copy), ``seconds``, ``fingerprint`` (weights after the
step). The networked runtimes add ``wire_bytes_up``/``wire_bytes_down`` (bytes measured on
the network, framing included) and the gRPC coordinator their split by site: a step's
``wire_bytes_up_by_site`` is every message the site sent for that step, its ``step_done``
included even when it rides in the next step's first upload chunk (``previous_done``:
those bytes count towards the done's step, the rest of that message towards the next
step); ``wire_messages_up_by_site`` counts that message once, in the next step.

``diagnostics`` are spread in place, keys as their producers name them: the robust
weights (``robust_*``, ``screening.commit``), the strategy's ``describe`` and the
effective ranks (``strategies/introspect.py``): ``rank90/<layer>/<part>`` and
``rank99/…``, the number of leading components holding 90% / 99% of the energy (Σσ²) of
a layer's gradient, ``<part>`` ``site<s>`` (site s's gradient Δ_sᵀA_s), ``sum`` (their
sum) — from the sites' factors, in the in-process simulation with a factor strategy — or
``update`` (the rank-r update rank-dAD sent, in every runtime). ``evaluation`` is spread
likewise: ``eval_*`` (the sites' held-out data, ``server/evaluation.py``) and ``test_*``
(the coordinator's test set), on evaluation steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

SPREAD = ("diagnostics", "evaluation")  # fields whose keys are written in place of the field's name


@dataclass
class StepRecord:
    strategy: str  # the strategy's label in tables and plots
    step: int
    sites: int  # sites the step took
    samples: int  # N, the samples of every site's batch
    train_loss: float  # mean per-sample loss over the step's samples; NaN without samples
    bytes_up: int  # payload bytes, all sites
    bytes_down: int  # payload bytes, every site's copy
    seconds: float  # the step's wall time, evaluation excluded
    fingerprint: str  # the weights after the step
    wire_bytes_up: int | None = None  # measured on the network, framing included
    wire_bytes_down: int | None = None
    wire_bytes_up_by_site: dict[str, int] | None = None
    wire_bytes_down_by_site: dict[str, int] | None = None
    wire_messages_up_by_site: dict[str, int] | None = None  # gRPC messages: one each way per phase and site once steps follow by themselves
    wire_messages_down_by_site: dict[str, int] | None = None
    repair_bytes_by_site: dict[str, int] | None = None  # sent because a site's weights differed (block repairs and full states), within wire_bytes_down
    full_states_by_site: dict[str, int] | None = None
    phase_seconds: list[float] | None = None
    site_ids: list[str] | None = None
    attempt: int | None = None  # the attempt that committed (aborted attempts before it)
    fingerprint_mismatches: list[str] | None = None  # sites whose weights differed after the step (they resync)
    diagnostics: dict[str, Any] = field(default_factory=dict)
    dp_epsilon: float | None = None  # ε spent so far, under [dp], on evaluation steps and the last
    evaluation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this step, keys in field order: None fields left out, the
        ``diagnostics`` and ``evaluation`` keys spread in place."""
        record: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in SPREAD:
                record.update(value)
            elif value is not None:
                record[item.name] = value
        return record
