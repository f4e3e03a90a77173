"""``dadfl.server.evaluation`` — federated evaluation: the sites' held-out metrics, checked, then combined.

Every site evaluates the global model on its own held-out data on evaluation steps and
reports ``loss``, the workload's metric and its sample count in ``StepDone.eval``. A
report is hostile input: it is accepted only with known metric names, finite values and
a sample count between 1 and ``federation.max_eval_samples``; a bad report is left out
(the log names the site and why), it never reaches the metrics. The overall value of a
metric is the sample-weighted mean of the accepted reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class EvalRejected(ValueError):
    """A site's evaluation report failed a check; the message says which."""


# Bounds every report so that the sample-weighted sum over sites stays finite and meaningful.
MAX_METRIC = 1e12


@dataclass(frozen=True)
class SiteEval:
    samples: int
    metrics: dict[str, float]


def check_report(report, known: tuple[str, ...], max_samples: int) -> SiteEval:
    """The report as plain numbers, or :class:`EvalRejected`."""
    samples = int(report.samples)
    if not 1 <= samples <= max_samples:
        raise EvalRejected(f"sample count {samples} outside 1..{max_samples} (federation.max_eval_samples)")
    names = sorted(report.metrics)
    if len(names) > len(known) or set(names) != set(known):
        shown = ", ".join(repr(n[:32]) for n in names[: len(known) + 1])
        raise EvalRejected(f"metrics {shown} are not exactly {', '.join(known)}")
    values = {name: float(report.metrics[name]) for name in known}
    bad = [name for name, value in values.items() if not math.isfinite(value)]
    if bad:
        raise EvalRejected(f"non-finite {', '.join(bad)}")
    huge = [name for name, value in values.items() if abs(value) > MAX_METRIC]
    if huge:
        raise EvalRejected(f"{', '.join(huge)} beyond ±{MAX_METRIC:g}")
    return SiteEval(samples, values)


def combine(evals: dict[str, SiteEval]) -> dict:
    """``eval_<name>`` (sample-weighted over sites), ``eval_samples``, ``eval_by_site``."""
    total = sum(e.samples for e in evals.values())
    record: dict = {"eval_samples": total, "eval_sites": len(evals)}
    for name in next(iter(evals.values())).metrics:
        record[f"eval_{name}"] = sum(e.metrics[name] * e.samples for e in evals.values()) / total
    record["eval_by_site"] = {site: {"samples": e.samples, **e.metrics} for site, e in sorted(evals.items())}
    return record
