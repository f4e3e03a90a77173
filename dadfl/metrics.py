"""``dadfl.metrics`` — metrics as JSON lines: one record per step, the same keys in every runtime.

Every runtime writes :meth:`dadfl.records.StepRecord.to_json` (``dadfl/records/step.py``
names each key); this module writes and reads the lines and summarises a run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Iterator


RANK_PREFIXES = ("rank90/", "rank99/")  # the effective-rank keys


class MetricsWriter:
    """Append-only JSONL file; each record is flushed so a crash loses at most one line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | Path) -> Iterator[dict]:
    """The complete records of ``path``. A last line without its newline is a record still being
    written, or one a crash cut short (its step has no checkpoint yet and runs again): it is not
    read. Any other line that is not JSON raises."""
    with Path(path).open() as lines:
        for line in lines:
            if line.strip() and line.endswith("\n"):
                yield json.loads(line)


def human_bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def last_value(records: Iterable[dict], key: str) -> float:
    value = math.nan
    for record in records:
        if key in record:
            value = record[key]
    return value


def run_summary(records: list[dict], strategy: str, metric_name: str) -> dict:
    """One strategy's summary (its ``summary.json`` entry) from its step records, at least one,
    in every runtime (simulation, processes, gRPC, Flower): totals and means per step over the
    steps run, and the last held-out evaluation, at the sites (``eval_*``) and on the
    coordinator's test set (``metric``, ``test_loss``)."""
    steps = len(records)
    last_eval = next((r for r in reversed(records) if f"eval_{metric_name}" in r or f"test_{metric_name}" in r), {})
    bytes_up, bytes_down = sum(r["bytes_up"] for r in records), sum(r["bytes_down"] for r in records)
    summary = {
        "strategy": strategy,
        "steps": steps,
        "metric_name": metric_name,
        "eval_metric": last_eval.get(f"eval_{metric_name}", math.nan),
        "eval_loss": last_eval.get("eval_loss", math.nan),
        "eval_samples": last_eval.get("eval_samples", 0),
        "metric": last_eval.get(f"test_{metric_name}", math.nan),
        "test_loss": last_eval.get("test_loss", math.nan),
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "bytes_up_per_step": bytes_up / steps,
        "bytes_down_per_step": bytes_down / steps,
        "seconds_per_step": sum(r["seconds"] for r in records) / steps,
    }
    if all("wire_bytes_up" in r for r in records):  # measured on the network: the networked runtimes
        summary["wire_bytes_up_per_step"] = sum(r["wire_bytes_up"] for r in records) / steps
        summary["wire_bytes_down_per_step"] = sum(r["wire_bytes_down"] for r in records) / steps
    if all("repair_bytes_by_site" in r for r in records):  # the networked runtime: replicas repaired
        summary["repair_bytes"] = sum(sum(r["repair_bytes_by_site"].values()) for r in records)
        summary["full_states"] = sum(sum(r["full_states_by_site"].values()) for r in records)
    return summary


def strict_json(value):
    """``value`` with every NaN or infinite float as None: JSON as strict parsers read it
    (``json.dumps`` would write bare ``NaN``, which is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_summary(path: str | Path, summaries: list[dict]) -> None:
    """``summary.json``: the runs' summaries as strict JSON, a value there is none of (no
    coordinator test set: ``metric`` and ``test_loss``) as ``null``."""
    Path(path).write_text(json.dumps(strict_json(summaries), indent=2, allow_nan=False) + "\n")


def read_summary(path: str | Path) -> list[dict]:
    """The summaries :func:`write_summary` wrote, a ``null`` number as NaN again (as
    :func:`run_summary` returns it), so callers can format and compare every figure."""
    return [{key: math.nan if value is None else value for key, value in summary.items()} for summary in json.loads(Path(path).read_text())]


def is_eval_step(step: int, eval_every: int, steps: int) -> bool:
    """Held-out evaluation after steps t with (t + 1) % eval_every == 0, and after the last;
    the coordinator and every site decide it alike."""
    return (step + 1) % eval_every == 0 or step + 1 == steps
