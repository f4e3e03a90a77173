"""Metrics as JSON lines: one record per step, the same keys in every runtime.

Keys of a step record: ``strategy``, ``step``, ``sites``, ``samples`` (N),
``train_loss`` (mean over the step's samples), ``bytes_up`` and ``bytes_down`` (exact
payload bytes summed over all sites; down counts every site's copy), ``seconds``,
``fingerprint`` (weights after the step), and optionally ``test_loss``,
``test_<metric>``, ``rank/<layer>`` and ``wire_bytes_up``/``wire_bytes_down``
(bytes measured on the network, framing included).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Iterator


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
    with Path(path).open() as lines:
        for line in lines:
            if line.strip():
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


def is_eval_step(step: int, eval_every: int, steps: int) -> bool:
    """Held-out evaluation after steps t with (t + 1) % eval_every == 0, and after the last;
    the coordinator and every site decide it alike."""
    return (step + 1) % eval_every == 0 or step + 1 == steps
