"""The workload contract: a model, its data, its loss and its metric.

Workloads are plugged in by import path (``"package.module:factory"``); a factory takes
keyword options and returns a :class:`Workload`. Everything a site or the coordinator
needs to train and evaluate one shared model comes from here.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Split:
    """Inputs and targets of one split, first dimension = samples."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.targets):
            raise ValueError(
                f"split has {len(self.inputs)} inputs but {len(self.targets)} targets; "
                "they must have the same first dimension"
            )

    def __len__(self) -> int:
        return len(self.inputs)

    def subset(self, index: torch.Tensor) -> "Split":
        return Split(self.inputs[index], self.targets[index])


@dataclass(frozen=True)
class Workload:
    """Model factory + data + per-sample loss + metric.

    ``loss(outputs, targets)`` returns one loss per sample (shape ``(n,)``); the global
    objective is the mean over the union of the sites' batches. ``metric(outputs,
    targets)`` returns a float where higher is better unless ``metric_higher_is_better``
    is false. ``labels`` (optional) gives one class label per training sample, used by
    label-skew partitioning.
    """

    name: str
    build_model: Callable[[], nn.Module]
    train: Split
    test: Split
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric: Callable[[torch.Tensor, torch.Tensor], float]
    metric_name: str = "accuracy"
    metric_higher_is_better: bool = True
    labels: torch.Tensor | None = None
    options: dict = field(default_factory=dict)


BUILTIN = {
    "digits-mlp": "dadfl.workloads.digits:mlp",
    "digits-cnn": "dadfl.workloads.digits:cnn",
    "breast-cancer-mlp": "dadfl.workloads.breast_cancer:mlp",
    "char-gru": "dadfl.workloads.text:gru",
    "char-transformer": "dadfl.workloads.text:transformer",
}


def load_workload(spec: str, **options) -> Workload:
    """Build a workload from a built-in name (``digits-mlp``) or ``"module:factory"``."""
    path = BUILTIN.get(spec, spec)
    if ":" not in path:
        raise ValueError(
            f"workload {spec!r} is neither a built-in ({', '.join(BUILTIN)}) "
            "nor an import path of the form 'package.module:factory'"
        )
    module_name, factory_name = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"workload {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ValueError(f"workload {spec!r}: module {module_name!r} has no attribute {factory_name!r}")
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        raise ValueError(
            f"workload {spec!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(accepted) or 'none'}"
        )
    workload = factory(**options)
    if not isinstance(workload, Workload):
        raise TypeError(f"workload factory {path!r} returned {type(workload).__name__}, not a Workload")
    return workload
