"""``dadfl.report`` — tables and plots from a run folder's ``metrics.jsonl`` (any runtime writes the same keys)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from .metrics import human_bytes, read_metrics  # noqa: F401 (human_bytes: the tables' import)


def pyplot():
    """matplotlib's pyplot drawing to files only (no display on sites or CI), imported on the
    first plot: every ``dadfl`` process imports this module, few of them plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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


def bytes_axis(axis) -> None:
    """A log-scale bytes axis labelled "10 KB", "1.0 MB": ticks at 1, 2, 5 × 10^k over a span
    of under two decades, else at the powers of ten (at most 8); minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # pyplot() was imported first

    axis.set_xscale("log")
    low, high = axis.get_xlim()
    decades = math.log10(high / low) if low > 0 and high > low else 1.0
    subs = (1.0, 2.0, 5.0) if decades < 2 else (1.0,)
    axis.xaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=8))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value)))
    axis.xaxis.set_minor_formatter(NullFormatter())


def cumulative_bytes(records: list[dict]) -> list[int]:
    cumulative, total = [], 0
    for r in records:
        total += r["bytes_up"] + r["bytes_down"]
        cumulative.append(total)
    return cumulative


def write_plots(run_dir: Path) -> list[Path]:
    """loss vs step and vs cumulative bytes; held-out metrics (the sites' ``eval_*`` per
    site and overall, a coordinator ``test_*``) vs step and vs bytes; per strategy, the
    gradients' effective rank per layer (when logged: ``rank90/…``, ``introspect.py``)."""
    runs = by_strategy(run_dir / "metrics.jsonl")
    written = []

    figure, (by_step, by_bytes) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for index, (label, records) in enumerate(runs.items()):
        steps = [r["step"] for r in records]
        losses = [r["train_loss"] for r in records]
        by_step.plot(steps, losses, label=label, **style(index, len(steps)))
        by_bytes.plot(cumulative_bytes(records), losses, label=label, **style(index, len(steps)))
    by_step.set(xlabel="step", ylabel="train loss", title="loss vs step")
    by_bytes.set(xlabel="cumulative bytes (up + down, all sites)", ylabel="train loss", title="loss vs communication")
    bytes_axis(by_bytes)
    for axis in (by_step, by_bytes):
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    figure.tight_layout()
    written.append(run_dir / "loss.png")
    figure.savefig(written[-1], dpi=110)
    pyplot().close(figure)

    held_out = _held_out_plot(runs, run_dir / "eval.png")
    if held_out:
        written.append(held_out)

    for label, records in runs.items():
        path = run_dir / f"rank_{''.join(c if c.isalnum() or c in '-_' else '_' for c in label)}.png"
        if _rank_plot(label, records, path):
            written.append(path)
    return written


# Curves of the rank plot: (key suffix, fraction, what it is, line style).
RANK_CURVES = (
    ("sum", 90, "sum over sites, 90%", {"color": "C0", "linewidth": 2}),
    ("sum", 99, "sum over sites, 99%", {"color": "C0", "linewidth": 2, "linestyle": "--"}),
    ("update", 90, "update sent, 90%", {"color": "C3", "linewidth": 1.5}),
    ("update", 99, "update sent, 99%", {"color": "C3", "linewidth": 1.5, "linestyle": "--"}),
)


def suggested_ranks(records: list[dict], percent: int = 90) -> dict[str, int]:
    """Per layer, the median over the logged steps of the components holding ``percent``% of
    the energy of the sites' summed gradient: a rank a rank-r strategy could start from."""
    series: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for key, value in record.items():
            if key.startswith(f"rank{percent}/") and key.endswith("/sum"):
                series[key.split("/")[1]].append(value)
    return {layer: int(statistics.median_low(values)) for layer, values in series.items()}


RANK_POINTS = 60  # a rank curve with more readings shows a rolling median over readings // this


def _rolling_median(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Past ``RANK_POINTS`` readings, each value replaced by the median of the readings // 60
    ending at it (ranks read every step jump by a component or two; the median keeps
    integers and the trend)."""
    window = len(points) // RANK_POINTS
    if window <= 1:
        return points
    values = [value for _, value in points]
    return [(step, statistics.median_low(values[max(0, i - window + 1) : i + 1])) for i, (step, _) in enumerate(points)]


def _rank_plot(label: str, records: list[dict], path: Path) -> Path | None:
    """One panel per layer: the rank holding 90% and 99% of the energy of the sites' summed
    gradient, of each site's (thin, 90%) and, for rank-dAD, of the update it sent, per step."""
    layers = sorted({key.split("/")[1] for r in records for key in r if key.startswith(("rank90/", "rank99/"))})
    if not layers:
        return None
    columns = min(3, len(layers))
    rows = -(-len(layers) // columns)
    figure, axes = pyplot().subplots(rows, columns, figsize=(4.5 * columns, 3.4 * rows), squeeze=False)
    for axis, layer in zip(axes.flat, layers):
        sites = sorted({key.rsplit("/", 1)[1] for r in records for key in r if key.startswith(f"rank90/{layer}/site")})
        for index, site in enumerate(sites):
            points = _rolling_median([(r["step"], r[f"rank90/{layer}/{site}"]) for r in records if f"rank90/{layer}/{site}" in r])
            axis.plot(*zip(*points), color="0.6", linewidth=0.7, alpha=0.8, label="each site, 90%" if index == 0 else None)
        for suffix, percent, name, line in RANK_CURVES:
            key = f"rank{percent}/{layer}/{suffix}"
            points = _rolling_median([(r["step"], r[key]) for r in records if key in r])
            if points:
                axis.plot(*zip(*points), label=name, **line)
        axis.set(title=f"layer {layer}", xlabel="step", ylabel="components")
        axis.set_ylim(bottom=0)
        axis.yaxis.get_major_locator().set_params(integer=True)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(layers):]:
        axis.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    figure.suptitle(f"{label}: gradient components holding 90% / 99% of the energy, per layer "
                    f"(over {RANK_POINTS} readings: a rolling median)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
    return path


def _held_out_plot(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """Every held-out metric against step and cumulative bytes: the sites' overall
    (sample-weighted) value, each site's own (thin), the coordinator's test set."""
    names = sorted({key[5:] for records in runs.values() for r in records for key in r
                    if key.startswith(("eval_", "test_")) and key not in ("eval_samples", "eval_sites", "eval_by_site")})
    if not names:
        return None
    figure, axes = pyplot().subplots(len(names), 2, figsize=(12, 4 * len(names)), squeeze=False)
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
        by_bytes.set(xlabel="cumulative bytes (up + down, all sites)", ylabel=f"held-out {name}",
                     title=f"held-out {name} vs communication")
        bytes_axis(by_bytes)
        for axis in (by_step, by_bytes):
            axis.grid(alpha=0.3)
        by_step.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
    return path
