"""Tables and plots from a run folder's ``metrics.jsonl`` (any runtime writes the same keys)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on sites or CI
import matplotlib.pyplot as plt  # noqa: E402

from .metrics import read_metrics  # noqa: E402


def human_bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def by_strategy(path: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = defaultdict(list)
    for record in read_metrics(path):
        runs[record["strategy"]].append(record)
    return runs


def write_plots(run_dir: Path) -> list[Path]:
    """loss vs step, loss vs cumulative bytes, effective rank per layer (when logged)."""
    runs = by_strategy(run_dir / "metrics.jsonl")
    written = []

    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, records in runs.items():
        steps = [r["step"] for r in records]
        losses = [r["train_loss"] for r in records]
        cumulative, total = [], 0
        for r in records:
            total += r["bytes_up"] + r["bytes_down"]
            cumulative.append(total)
        by_step.plot(steps, losses, label=label)
        by_bytes.plot(cumulative, losses, label=label)
    by_step.set(xlabel="step", ylabel="train loss", title="loss vs step")
    by_bytes.set(xlabel="cumulative bytes (up + down, all sites)", ylabel="train loss", xscale="log",
                 title="loss vs communication")
    for axis in (by_step, by_bytes):
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    figure.tight_layout()
    written.append(run_dir / "loss.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)

    for label, records in runs.items():
        layers = sorted({key for r in records for key in r if key.startswith("rank/")})
        if not layers:
            continue
        figure, axis = plt.subplots(figsize=(7, 4))
        for key in layers:
            axis.plot([r["step"] for r in records if key in r], [r[key] for r in records if key in r], label=key[5:])
        axis.set(xlabel="step", ylabel="effective rank of the update", title=f"{label}: effective rank per layer")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)
        written.append(run_dir / f"rank_{safe}.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written
