"""``dadfl.workloads.base`` — the workload contract: a model, its loss and its metric (and, optionally, data).

Workloads are plugged in by import path (``"package.module:factory"``); a factory takes
keyword options and returns a :class:`Workload`. What the coordinator names and every
site builds is the model, the per-sample loss and the metric; sites train and evaluate
on their own data, so a workload used in a federation needs no data at all. Training
and test splits serve the simulations and an optional coordinator-side test set.

A workload module outside this project is found after ``pip install -e`` of its own
package, or through ``search_path`` (folders searched for the module's top-level
package, as ``--workload-path`` and the configs' workload path set it).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from dadfl.options import factory_options


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


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Model factory + per-sample loss + metric, and optionally data.

    ``loss(outputs, targets)`` returns one loss per sample (shape ``(n,)``); the global
    objective is the mean over the union of the sites' batches. ``metric(outputs,
    targets)`` returns a float where higher is better unless ``metric_higher_is_better``
    is false. ``example_input`` is a small batch (shape and dtype of the model's input;
    values do not matter) from which every replica derives the same model layout;
    without it the first two training rows serve. ``build_model`` needs no seed: every
    replica starts from the coordinator's weights. ``train`` and ``test`` are optional
    (simulations need ``train``; ``test`` is the coordinator-side test set). ``labels``
    (optional) gives one class label per training sample, used by label-skew partitioning.
    """

    name: str
    build_model: Callable[[], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric: Callable[[torch.Tensor, torch.Tensor], float]
    metric_name: str = "accuracy"
    metric_higher_is_better: bool = True
    example_input: torch.Tensor | None = None
    train: Split | None = None
    test: Split | None = None
    labels: torch.Tensor | None = None
    options: dict = field(default_factory=dict)

    def example(self) -> torch.Tensor:
        """The batch every replica builds its layout from (identical everywhere)."""
        if self.example_input is not None:
            return self.example_input
        if self.train is not None and len(self.train):
            return self.train.inputs[:2]
        raise ValueError(
            f"workload {self.name!r} has neither example_input nor training data: set "
            "Workload(example_input=...) to a small batch shaped like the model's input"
        )

    def training_data(self) -> Split:
        """The training split, for simulations and demo partitions."""
        if self.train is None or not len(self.train):
            raise ValueError(
                f"workload {self.name!r} has no training data: simulations and demo shares need "
                "Workload(train=...); federation sites use their own data (site config [data])"
            )
        return self.train


BUILTIN = {
    "digits-mlp": "dadfl.workloads.digits:mlp",
    "digits-cnn": "dadfl.workloads.digits:cnn",
    "breast-cancer-mlp": "dadfl.workloads.breast_cancer:mlp",
    "char-gru": "dadfl.workloads.text:gru",
    "char-transformer": "dadfl.workloads.text:transformer",
    "char-transformer-100m": "dadfl.workloads.text:transformer_100m",
}
# Built-ins too large to build and train in unit tests (a forward of each takes seconds on a
# CPU): tests count their parameters on the meta device, bench/bench_large.py runs them.
LARGE = ("char-transformer-100m",)


def import_module(module_name: str, search_path: Sequence[Path | str] = ()):
    """Import ``module_name``; its top-level package is looked up in ``search_path``
    first (without touching ``sys.path``), then where Python finds installed packages."""
    top = module_name.split(".", 1)[0]
    if search_path and top not in sys.modules:
        folders = [str(Path(folder).resolve()) for folder in search_path]
        spec = importlib.machinery.PathFinder.find_spec(top, folders)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[top] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[top]
                raise
    return importlib.import_module(module_name)


def import_user_module(module_name: str, search_path: Sequence[Path | str], what: str, not_found: str):
    """:func:`import_module`, its failures as one ValueError that says which: the module not
    found (``not_found`` says where to put it), found but importing something not installed,
    or found but not compiling."""
    try:
        return import_module(module_name, search_path)
    except SyntaxError as exc:
        raise ValueError(
            f"{what}: module {module_name!r} does not compile: {exc.msg} ({Path(exc.filename or '?').name}, "
            f"line {exc.lineno}); fix that file"
        ) from None
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            raise ValueError(
                f"{what}: module {module_name!r} was found, but it imports {missing!r}, which is not installed here; "
                "install it in this environment"
            ) from exc
        raise ValueError(f"{what}: cannot import module {module_name!r} ({exc}); {not_found}") from exc


def load_workload(spec: str, search_path: Sequence[Path | str] = (), **options) -> Workload:
    """Build a workload from a built-in name (``digits-mlp``) or ``"module:factory"``,
    looking for the module in ``search_path`` first."""
    path = BUILTIN.get(spec, spec)
    if ":" not in path:
        raise ValueError(
            f"workload {spec!r} is neither a built-in ({', '.join(BUILTIN)}) "
            "nor an import path of the form 'package.module:factory'"
        )
    module_name, factory_name = path.split(":", 1)
    where = ", ".join(map(str, search_path)) if search_path else "the installed packages"
    module = import_user_module(
        module_name, search_path, f"workload {spec!r}",
        f"it is not in {where}; install the package that holds it (pip install -e PATH) or name its parent folder "
        "as the workload path (--workload-path, or workload path in the config)",
    )
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ValueError(f"workload {spec!r}: module {module_name!r} has no attribute {factory_name!r}")
    # Only a function of the workload's own package (or a built-in one it re-exports) is a
    # factory: a module's other imports (shutil's rmtree, os.remove) must not become callable
    # through a spec that an allowlist prefix admits.
    package = module_name.split(".")[0]
    defined_in = getattr(factory, "__module__", None) or ""
    own = defined_in.split(".")[0] == package or f"{defined_in}.".startswith(f"{__package__}.")
    if not inspect.isfunction(factory) or not own:
        raise ValueError(
            f"workload {spec!r}: {factory_name!r} is not a function defined in package {package!r}; "
            "a workload factory must be a function of the workload's own package"
        )
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        raise ValueError(
            f"workload {spec!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(accepted) or 'none'}"
        )
    factory_options(factory, options, f"workload {spec!r} options")  # strict types, bounded values
    workload = factory(**options)
    if not isinstance(workload, Workload):
        raise TypeError(f"workload factory {path!r} returned {type(workload).__name__}, not a Workload")
    return workload
