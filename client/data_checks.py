"""``dadfl.client.data_checks`` — a site's data checked against the model before the site joins: dtypes, shapes, label range.

Whatever produces the site's batches (a file, a partition, the site's own Dataset),
:func:`check_batches` plans the dtype conversion from step 0's batch, runs that batch
forward and through the loss (:func:`probe`) and returns the batches converted as planned.
Every mismatch is one :class:`DataMismatch` line naming the data source and the fix; no
message carries a data value (only shapes, dtypes and counts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from dadfl.data_files import DataMismatch
from dadfl.workloads import SplitDataset

log = logging.getLogger("dadfl.site")

ERROR_CHARS = 200  # of a torch error quoted in a message


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating parameters (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@dataclass(frozen=True)
class Conversion:
    """The dtypes a site's batches are put in before the model sees them (None: kept)."""

    inputs: torch.dtype | None = None
    targets: torch.dtype | None = None

    def apply(self, inputs: torch.Tensor, targets: torch.Tensor, source: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inputs is not None:
            if not (inputs.is_floating_point() or inputs.dtype == torch.bool):
                check_exact(inputs, self.inputs, source)
            inputs = inputs.to(self.inputs)
        if self.targets is not None:
            targets = targets.to(self.targets)
        return inputs, targets


def plan_conversion(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, source: str) -> Conversion:
    """The conversion a batch like this one needs, logged in one line.

    Floating and boolean inputs become the model's dtype (float64 to float32 rounds each value
    to the nearest float32, which is what training in float32 does anyway). Integer inputs stay
    (token ids) unless the model takes them only as floats (:func:`takes_integers_as_floats`:
    counts, ages, pixel levels); then they become the model's dtype where every value is exact.
    Integer targets (class labels) become int64, floating targets the model's dtype. Complex
    values are refused.
    """
    dtype = model_dtype(model)
    for name, tensor in (("inputs", inputs), ("targets", targets)):
        if tensor.is_complex():
            raise DataMismatch(f"{source}: {name} are complex ({tensor.dtype}); save real numbers")
    numbers = inputs.is_floating_point() or inputs.dtype == torch.bool
    input_dtype = dtype if (numbers and inputs.dtype != dtype) or takes_integers_as_floats(model, inputs, dtype) else None
    wanted = dtype if targets.is_floating_point() or targets.dtype == torch.bool else torch.int64
    target_dtype = wanted if targets.dtype != wanted else None
    converted = [f"{name} {tensor.dtype} -> {to}" for name, tensor, to in (("inputs", inputs, input_dtype), ("targets", targets, target_dtype)) if to]
    if converted:
        log.info("%s: converted %s (the model's dtype is %s)", source, ", ".join(converted), dtype)
    return Conversion(input_dtype, target_dtype)


def check_exact(inputs: torch.Tensor, dtype: torch.dtype, source: str) -> None:
    """Integer inputs converted to ``dtype`` must keep their values."""
    exact = round(2 / torch.finfo(dtype).eps)  # every integer up to this is exact: 2^24 in float32
    if len(inputs) and bool((inputs.abs() > exact).any()):
        raise DataMismatch(f"{source}: integer inputs beyond ±2^{exact.bit_length() - 1} are not exact in {dtype}; scale them down")


class ConvertedDataset(Dataset):
    """A map-style Dataset whose ``(inputs, target)`` items are converted as planned."""

    def __init__(self, dataset: Dataset, conversion: Conversion, source: str):
        self.dataset, self.conversion, self.source = dataset, conversion, source

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, target = self.dataset[position]
        return self.conversion.apply(torch.as_tensor(inputs), torch.as_tensor(target), self.source)


class CheckedBatches:
    """A site's :class:`~dadfl.workloads.StepBatches` with every batch converted as planned."""

    def __init__(self, batches, conversion: Conversion, source: str):
        self.batches, self.conversion, self.source = batches, conversion, source

    def __len__(self) -> int:
        return len(self.batches)

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conversion.apply(*self.batches.at(step), self.source)


def check_batches(model: nn.Module, loss, batches, source: str, device: torch.device) -> CheckedBatches:
    """Step 0's batch (a pure function of seed and step: drawing it changes no other step's)
    decides the conversion and goes through the model and loss (:func:`checked_conversion`)."""
    conversion = checked_conversion(model, loss, *batches.at(0), getattr(batches, "dataset", None), source, device)
    return CheckedBatches(batches, conversion, source)


def checked_conversion(
    model: nn.Module, loss, inputs: torch.Tensor, targets: torch.Tensor, dataset: Dataset | None, source: str,
    device: torch.device,
) -> Conversion:
    """The conversion a first batch like this one needs, that batch through the model and loss
    (:func:`probe`) and, when ``dataset`` is a :class:`~dadfl.workloads.SplitDataset` (a file
    or a partition, also behind a held-out share), every row's inputs and labels checked, not
    only the batch's."""
    conversion = plan_conversion(model, inputs, targets, source)
    inputs, targets = conversion.apply(inputs, targets, source)
    all_inputs, all_targets = split_rows(dataset)
    if all_inputs is not None and conversion.inputs is not None and not (all_inputs.is_floating_point() or all_inputs.dtype == torch.bool):
        check_exact(all_inputs, conversion.inputs, source)
    probe(model, loss, inputs.to(device), targets.to(device), source, all_inputs, all_targets)
    return conversion


def split_rows(dataset: Dataset | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every row of a file or partition Dataset, also when a held-out share is taken out of
    it (a ``Subset``); (None, None) for a site's own Dataset, which is read item by item."""
    rows = None
    if isinstance(dataset, Subset):
        dataset, rows = dataset.dataset, torch.as_tensor(dataset.indices, dtype=torch.int64)
    if not isinstance(dataset, SplitDataset):
        return None, None
    index = dataset.index if rows is None else dataset.index[rows]
    return dataset.split.inputs[index], dataset.split.targets[index]


def check_dataset(model: nn.Module, loss, dataset: Dataset, source: str, device: torch.device, rows: int = 64) -> Dataset:
    """A held-out Dataset checked as :func:`check_batches` checks training data (its first
    ``rows`` items through the model, every row of a file or partition), converted as its own
    dtypes need."""
    inputs, targets = next(iter(DataLoader(dataset, batch_size=min(rows, len(dataset)))))
    conversion = checked_conversion(model, loss, inputs, targets, dataset, source, device)
    return ConvertedDataset(dataset, conversion, source) if conversion != Conversion() else dataset


def takes_integers_as_floats(model: nn.Module, inputs: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether integer ``inputs`` are numbers to the model rather than ids: it fails on them as
    they are and runs on them as ``dtype`` (one forward pass each, eval mode, no gradients)."""
    if inputs.is_floating_point() or inputs.dtype == torch.bool or inputs.is_complex() or len(inputs) == 0:
        return False
    inputs = inputs.to(next(model.parameters(), torch.empty(0)).device)  # the model may already be on CUDA
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                model(inputs)
                return False
            except Exception:
                pass
            try:
                model(inputs.to(dtype))
                return True
            except Exception:
                return False
    finally:
        model.train(was_training)


def probe(
    model: nn.Module, loss, inputs: torch.Tensor, targets: torch.Tensor, source: str,
    all_inputs: torch.Tensor | None = None, all_targets: torch.Tensor | None = None,
) -> None:
    """One batch through the model and the per-sample loss, in eval mode and without gradients
    (no buffer such as a batch-norm running mean moves). NaN/Inf inputs are looked for in
    ``all_inputs`` and class labels (integer targets shaped like the outputs without their last
    dimension) checked against the model's output width over ``all_targets`` (default: this
    batch's). Raises :class:`DataMismatch` on the first problem."""
    rows = len(inputs)
    if rows == 0:
        raise DataMismatch(f"{source}: holds no samples; give the site a file with at least one row")
    checked = inputs if all_inputs is None else all_inputs
    if checked.is_floating_point():
        bad = int((~torch.isfinite(checked.reshape(len(checked), -1))).any(dim=1).sum())
        if bad:
            raise DataMismatch(f"{source}: {bad} of {len(checked)} rows of inputs hold NaN or Inf; clean or drop them")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                outputs = model(inputs)
            except Exception as exc:
                raise DataMismatch(
                    f"{source}: the model does not take these inputs (per sample {shape(inputs)}, {inputs.dtype}"
                    f"{expected_features(model)}): {first_line(exc)}; give the site data shaped as the coordinator's workload expects"
                ) from None
            check_labels(outputs, targets if all_targets is None else all_targets, source)
            try:
                losses = loss(outputs, targets)
            except Exception as exc:
                raise DataMismatch(
                    f"{source}: the loss does not take these targets (per sample {shape(targets)}, {targets.dtype}; "
                    f"model outputs per sample {shape(outputs)}): {first_line(exc)}"
                ) from None
    finally:
        model.train(was_training)
    if tuple(losses.shape) != (rows,):
        raise DataMismatch(f"{source}: the workload's loss gave shape {tuple(losses.shape)} for {rows} samples; it must give one loss per sample")
    if not bool(torch.isfinite(losses).all()):
        raise DataMismatch(f"{source}: the loss is NaN or Inf on the first {rows} rows; check the targets and inputs for extreme values")


def check_labels(outputs: torch.Tensor, targets: torch.Tensor, source: str) -> None:
    """Integer targets shaped like the outputs without their last dimension are class indices:
    each must lie in 0..C-1 for C outputs. Counts only, never the offending values."""
    if targets.is_floating_point() or outputs.dim() < 2 or tuple(outputs.shape[:-1]) != (len(outputs), *targets.shape[1:]):
        return
    classes = outputs.shape[-1]
    if classes < 2:
        return  # one output: a score, not classes
    outside = (targets < 0) | (targets >= classes)
    if bool(outside.any()):
        rows = int(outside.reshape(len(targets), -1).any(dim=1).sum())
        raise DataMismatch(
            f"{source}: {rows} of {len(targets)} rows hold labels outside 0..{classes - 1} (the model has {classes} outputs); "
            f"relabel the classes as 0..{classes - 1} or drop those rows"
        )


def expected_features(model: nn.Module) -> str:
    """``; the model's first layer takes N features`` when the model starts with a layer that says."""
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding))), None)
    if isinstance(first, nn.Linear):
        return f"; the model's first layer takes {first.in_features} features"
    if isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return f"; the model's first layer takes {first.in_channels} channels"
    if isinstance(first, nn.Embedding):
        return f"; the model's first layer takes token ids below {first.num_embeddings}"
    return ""


def shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape[1:])


def first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:ERROR_CHARS]
