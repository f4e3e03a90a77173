"""Tables and plots from a run folder's ``metrics.jsonl`` (any runtime writes the same keys)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on sites or CI
import matplotlib.pyplot as plt  # noqa: E402

from .metrics import human_bytes, read_metrics  # noqa: E402, F401 (human_bytes: the tables' import)


def by_strategy(path: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = defaultdict(list)
    for record in read_metrics(path):
        runs[record["strategy"]].append(record)
    return runs


# Exact strategies draw the same curve: a marker and a line style of their own keep each visible.
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*")


def style(index: int, points: int) -> dict:
    every = max(1, points // 8)
    return {"linestyle": LINE_STYLES[index % len(LINE_STYLES)], "marker": MARKERS[index % len(MARKERS)], "markevery": every}


def cumulative_bytes(records: list[dict]) -> list[int]:
    cumulative, total = [], 0
    for r in records:
        total += r["bytes_up"] + r["bytes_down"]
        cumulative.append(total)
    return cumulative


def write_plots(run_dir: Path) -> list[Path]:
    """loss vs step and vs cumulative bytes; held-out metrics (the sites' ``eval_*`` per
    site and overall, a coordinator ``test_*``) vs step and vs bytes; effective rank per
    layer (when logged)."""
    runs = by_strategy(run_dir / "metrics.jsonl")
    written = []

    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (label, records) in enumerate(runs.items()):
        steps = [r["step"] for r in records]
        losses = [r["train_loss"] for r in records]
        by_step.plot(steps, losses, label=label, **style(index, len(steps)))
        by_bytes.plot(cumulative_bytes(records), losses, label=label, **style(index, len(steps)))
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

    held_out = _held_out_plot(runs, run_dir / "eval.png")
    if held_out:
        written.append(held_out)

    for label, records in runs.items():
        layers = sorted({key for r in records for key in r if key.startswith("rank/")})
        if not layers:
            continue
        figure, axis = plt.subplots(figsize=(7, 4))
        for index, key in enumerate(layers):
            points = [(r["step"], r[key]) for r in records if key in r]
            axis.plot(*zip(*points), label=f"layer {key[5:]}", **style(index, len(points)))
        axis.set(xlabel="step", ylabel="effective rank of the update", title=f"{label}: effective rank per layer")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, title="layer (module name)")
        figure.tight_layout()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)
        written.append(run_dir / f"rank_{safe}.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written


def _held_out_plot(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """Every held-out metric against step and cumulative bytes: the sites' overall
    (sample-weighted) value, each site's own (thin), the coordinator's test set."""
    names = sorted({key[5:] for records in runs.values() for r in records for key in r
                    if key.startswith(("eval_", "test_")) and key not in ("eval_samples", "eval_sites", "eval_by_site")})
    if not names:
        return None
    figure, axes = plt.subplots(len(names), 2, figsize=(12, 4 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        by_step, by_bytes = axes[row]
        curve = 0
        for label, records in runs.items():
            cumulative = cumulative_bytes(records)
            series = [  # (curve name, points, one site's curve)
                (f"{label}: sites (overall)", [(r["step"], c, r[f"eval_{name}"]) for r, c in zip(records, cumulative) if f"eval_{name}" in r], False),
                (f"{label}: coordinator test set", [(r["step"], c, r[f"test_{name}"]) for r, c in zip(records, cumulative) if f"test_{name}" in r], False),
            ]
            sites = sorted({site for r in records for site in r.get("eval_by_site", {})})
            for site in sites if len(sites) > 1 else ():
                points = [(r["step"], c, r["eval_by_site"][site][name]) for r, c in zip(records, cumulative)
                          if name in r.get("eval_by_site", {}).get(site, {})]
                series.append((f"{label}: {site}", points, True))
            for key, points, one_site in series:
                if not points:
                    continue
                steps, spent, values = zip(*points)
                thin = {"linewidth": 0.8, "alpha": 0.7} if one_site else {}
                by_step.plot(steps, values, label=key, **style(curve, len(points)), **thin)
                by_bytes.plot(spent, values, label=key, **style(curve, len(points)), **thin)
                curve += 1
        by_step.set(xlabel="step", ylabel=f"held-out {name}", title=f"held-out {name} vs step")
        by_bytes.set(xlabel="cumulative bytes (up + down, all sites)", ylabel=f"held-out {name}", xscale="log",
                     title=f"held-out {name} vs communication")
        for axis in (by_step, by_bytes):
            axis.grid(alpha=0.3)
        by_step.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
