"""``dadfl.strategies.checks`` — what an upload may carry, and how far it may move the model: the machinery every
strategy's checks are built from.

A strategy states, per phase, what a site may send as a list of **units** — one per
parameter, buffer or captured layer — each with the **forms** it may travel in (a
captured layer as activations and deltas, or as its dense gradient, ...). A form names
its tensors with their shapes and dtypes; a shape may use two symbols:

- ``ROWS``: the layer's rows, ``num_samples`` × the rows one sample makes in that layer
  (1 for an MLP, positions for a convolution, time steps for a recurrent cell), counted
  by the layout's probe on its example batch (``CapturedLayer.rows_per_sample``); every
  tensor of the form has the same;
- ``RANK``: the same within the form, between 1 and the form's ``max_rank``;
- ``LOOKUPS``: an embedding's looked-up ids (and their delta rows), the same within the
  form, at most ``num_samples`` × the lookups one sample makes (padding ids are not sent);
  the ids must lie in the table (``Spec.bound``).

A unit whose forms include a dense gradient, or marked ``optional``, may be absent: that
site's batch gave it no gradient, and it adds nothing.

An upload must match exactly one form of every unit, carry nothing else, and hold only
finite values (:func:`check_payload`). Then its **contribution** is measured — the norm
of the update it would add, in mean units, computed from the factors without forming
ΔᵀA where that is cheaper (``gram.py``: the same inner products the robust rule reads), in
float64 so finite values near the float32 limit cannot overflow — and a site whose
contribution is non-finite or out of proportion with the others' is refused
(:func:`influence_outliers`). Before the server sends a message, the update every site
will decode from it is checked (:func:`check_update`).
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from dadfl.sanitize import printable

from . import gram
from .capture import LOOKUP, id_dtype
from .layout import CapturedLayer, Layout
from .payload import BUFFER_ROLE, GRAD_ROLE, IDS_ROLE, ROWS_ROLE, Payload, split_key, tensor_key

ROWS = "rows"
RANK = "rank"
LOOKUPS = "lookups"


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. A sum with an Inf or NaN term is never finite, so a
    finite sum settles it in one pass without a mask as large as the tensor (20× faster on
    a million floats); a sum that overflows (large finite values, or half precision) is
    settled by the element-wise test."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


STACKED_ELEMENTS = 1 << 20  # the most elements stacked at once by finite_flags (4 MiB of float32)


def finite_flags(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """:func:`all_finite` of each tensor, with tensors of one shape and dtype (a parameter's
    gradient at every site) summed as one stack, at most ``STACKED_ELEMENTS`` at a time: a
    few tensor calls per group instead of two per tensor (a thousand sites' uploads spent
    more in those calls than in the sums). A sum that is not finite is settled by the
    element-wise test, as in :func:`all_finite`."""
    flags = [True] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.is_floating_point():
            groups.setdefault((tensor.shape, tensor.dtype), []).append(index)
    for (shape, _), members in groups.items():
        size = math.prod(shape)
        if size == 0:
            continue
        per_stack = max(1, STACKED_ELEMENTS // size)
        for start in range(0, len(members), per_stack):
            part = members[start : start + per_stack]
            stacked = torch.stack([tensors[i] for i in part]).reshape(len(part), -1)
            for i, finite in zip(part, torch.isfinite(stacked.sum(dim=1)).tolist()):
                flags[i] = finite or bool(torch.isfinite(tensors[i]).all())
    return flags


@dataclass(frozen=True)
class Spec:
    shape: tuple[int | str, ...]
    dtype: torch.dtype
    bound: int | None = None  # integer values must lie in 0..bound-1


@dataclass(frozen=True)
class Form:
    """One way a unit may travel: these tensors, nothing more, nothing less."""

    name: str
    tensors: dict[str, Spec] = field(hash=False)
    rows_per_sample: int | None = None  # ROWS = num_samples × this (None: any multiple)
    max_rank: int = 0
    lookups_per_sample: int | None = None  # LOOKUPS <= num_samples × this


@dataclass(frozen=True)
class Unit:
    name: str
    forms: tuple[Form, ...]
    optional: bool = False  # may be absent (a low-rank unit of a parameter that got no gradient)


@dataclass(frozen=True)
class PayloadRejection:
    """Upload ``index`` (in the order given to the check) is refused for ``reason``."""

    index: int
    reason: str


@dataclass(frozen=True)
class ModelFacts:
    """What the checks know of the model beyond its layout: shapes and dtypes of every
    parameter and buffer, and the rows one sample makes in each captured layer."""

    params: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]]
    rows_per_sample: dict[str, int]  # a layer not here: any multiple of num_samples
    lookups_per_sample: dict[str, int] = field(default_factory=dict)  # a layer not here: no bound per sample

    @classmethod
    def from_model(cls, model: nn.Module, layout: Layout) -> "ModelFacts":
        """Shapes and dtypes from ``model``; rows and lookups per sample as the layout's probe counted them."""
        return cls(
            params={name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()},
            buffers={name: (tuple(b.shape), b.dtype) for name, b in model.named_buffers()},
            rows_per_sample={l.module: l.rows_per_sample for l in layout.layers if l.rows_per_sample is not None},
            lookups_per_sample={l.module: l.lookups_per_sample for l in layout.layers if l.lookups_per_sample is not None},
        )

    # ------------------------------------------------------------ forms strategies share

    def dense(self, name: str) -> Form:
        shape, dtype = self.params[name]
        return Form("dense gradient", {tensor_key(name, GRAD_ROLE): Spec(shape, dtype)})

    def dense_units(self, names: Sequence[str]) -> list[Unit]:
        return [Unit(name, (self.dense(name),)) for name in names]

    def buffer_units(self, names: Sequence[str]) -> list[Unit]:
        return [
            Unit(name, (Form("buffer", {tensor_key(name, BUFFER_ROLE): Spec(*self.buffers[name])}),)) for name in names
        ]

    def layer_dense(self, layer: CapturedLayer) -> Form:
        tensors = dict(self.dense(layer.weight).tensors)
        if layer.bias:
            tensors.update(self.dense(layer.bias).tensors)
        return Form("dense gradient", tensors)

    def layer_factors(self, layer: CapturedLayer, roles: str = "AD") -> Form:
        """Activations (``A``) and/or deltas (``D``): (groups, ROWS, width), of its linear/conv
        calls, in the dtype those compute in (autocast's under mixed precision); for an embedding,
        its ids (LOOKUPS,) in the table and their delta rows, in the weight's dtype."""
        dtype = self.params[layer.weight][1]
        width = {"A": layer.in_per_group, "D": layer.out_per_group}
        tensors = {}
        if any(form != LOOKUP for form in layer.forms):
            tensors = {tensor_key(layer.module, role): Spec((layer.groups, ROWS, width[role]), layer.compute_dtype) for role in roles}
        if LOOKUP in layer.forms:
            tensors[tensor_key(layer.module, IDS_ROLE)] = Spec((LOOKUPS,), id_dtype(layer.out_features), layer.out_features)
            tensors[tensor_key(layer.module, ROWS_ROLE)] = Spec((LOOKUPS, layer.in_per_group), dtype)
        return Form(
            "factors", tensors, rows_per_sample=self.rows_per_sample.get(layer.module),
            lookups_per_sample=self.lookups_per_sample.get(layer.module),
        )

    def layer_low_rank(self, layer: CapturedLayer, max_rank: int, bias_folded: bool = False,
                       matrices: tuple[int, int] | None = None) -> Form:
        """P (groups, m, RANK) and Q (groups, k, RANK), the bias dense; ``bias_folded``: Q has
        one row more, the bias's, and no bias travels apart; ``matrices``: (how many, rows
        each) the strategy factors the layer's rows as, by default its groups' (groups, m);
        (1, groups·m) stacks them."""
        dtype = self.params[layer.weight][1]
        folded = bool(bias_folded and layer.bias)
        groups, m = matrices or (layer.groups, layer.out_per_group)
        tensors = {
            tensor_key(layer.module, "P"): Spec((groups, m, RANK), dtype),
            tensor_key(layer.module, "Q"): Spec((groups, layer.in_per_group + folded, RANK), dtype),
        }
        if layer.bias and not folded:
            tensors.update(self.dense(layer.bias).tensors)
        return Form("low-rank factors", tensors, max_rank=max_rank)


# ----------------------------------------------------------------------------- form checks


def check_payload(units: Sequence[Unit], payload: Payload, finite: dict[str, bool] | None = None) -> str | None:
    """Why ``payload`` does not match ``units`` (one form per unit, nothing else), or None.
    ``finite``: :func:`all_finite` of its tensors by key, when already known."""
    keys = set(payload.tensors)
    claimed: set[str] = set()
    for unit in units:
        unit_keys = {key for form in unit.forms for key in form.tensors}
        present = keys & unit_keys
        if not present and (unit.optional or any(form.name == "dense gradient" for form in unit.forms)):
            continue  # no gradient at this site
        complete = [form for form in unit.forms if set(form.tensors) == present]
        if not complete:
            return _form_mismatch(unit, present)
        claimed |= present
        reason = _check_form(complete[0], payload, finite or {})
        if reason:
            return f"{unit.name} ({complete[0].name}): {reason}"
    extra = sorted(keys - claimed)
    if extra:
        return f"unexpected tensor {printable(extra[0])}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
    return None


def _form_mismatch(unit: Unit, present: set[str]) -> str:
    expected = " or ".join(f"{form.name} ({', '.join(sorted(form.tensors))})" for form in unit.forms)
    if not present:
        return f"{unit.name}: missing; expected {expected}"
    return f"{unit.name}: got {', '.join(sorted(present))}; expected {expected}"


def _check_form(form: Form, payload: Payload, finite: dict[str, bool]) -> str | None:
    sizes: dict[str, int] = {}  # ROWS, LOOKUPS, RANK: the same in every tensor of the form
    for key, spec in form.tensors.items():
        tensor = payload.tensors[key]
        where = f"tensor {key!r}"
        if tensor.dtype != spec.dtype:
            return f"{where}: dtype {tensor.dtype}, expected {spec.dtype}"
        if tensor.dim() != len(spec.shape):
            return f"{where}: shape {tuple(tensor.shape)}, expected {_show(spec.shape)}"
        for axis, (size, want) in enumerate(zip(tensor.shape, spec.shape)):
            if want in (ROWS, LOOKUPS, RANK):
                seen = sizes.setdefault(want, size)
                if size != seen:
                    count = f"rank {size}" if want == RANK else f"{size} {want}"
                    return f"{where}: {count} along dimension {axis}, but {seen} in the form's other tensors"
            elif size != want:
                return f"{where}: shape {tuple(tensor.shape)}, expected {_show(spec.shape)}"
        if not (finite[key] if key in finite else all_finite(tensor)):
            return f"{where}: contains NaN or Inf"
        if spec.bound is not None and tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= spec.bound):
            return f"{where}: values outside 0..{spec.bound - 1}"
    rows, lookups, rank = sizes.get(ROWS), sizes.get(LOOKUPS), sizes.get(RANK)
    if lookups is not None and form.lookups_per_sample and lookups > payload.num_samples * form.lookups_per_sample:
        return f"{lookups} lookups, but num_samples={payload.num_samples} makes at most {payload.num_samples * form.lookups_per_sample}"
    if rows is not None:
        n, per_sample = payload.num_samples, form.rows_per_sample
        if per_sample and rows != n * per_sample:
            return f"{rows} rows, but num_samples={n} at {per_sample} rows per sample makes {n * per_sample}"
        if not per_sample and rows % n:
            return f"{rows} rows is not a multiple of num_samples={n}"
    if rank is not None and not 1 <= rank <= form.max_rank:
        return f"rank {rank} is outside 1..{form.max_rank}"
    return None


def _show(shape: tuple) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_uploads(units: Sequence[Unit] | None, payloads: Sequence[Payload], what: str, phase: int) -> list[PayloadRejection]:
    """Each payload against the same units; ``units`` None: this phase takes no upload."""
    if units is None:
        return [PayloadRejection(i, f"{what} takes no upload in phase {phase}") for i in range(len(payloads))]
    expected = {key for unit in units for form in unit.forms for key in form.tensors}
    checked = [(index, key, tensor) for index, payload in enumerate(payloads) for key, tensor in payload.tensors.items() if key in expected]
    finite: list[dict[str, bool]] = [{} for _ in payloads]
    for (index, key, _), flag in zip(checked, finite_flags([tensor for _, _, tensor in checked])):
        finite[index][key] = flag
    rejections = []
    for index, payload in enumerate(payloads):
        reason = check_payload(units, payload, finite[index])
        if reason:
            rejections.append(PayloadRejection(index, reason))
    return rejections


# ----------------------------------------------------------------------------- contribution


def sq_norm(tensor: torch.Tensor) -> float:
    return gram.sq_norm({"": [gram.Dense(tensor)]})


def factor_sq_norm(A: torch.Tensor, D: torch.Tensor) -> float:
    """‖DᵀA‖_F² summed over groups, in float64, from the factors (``gram.py``)."""
    return gram.sq_norm({"": [gram.Factors(A, D)]})


def low_rank_sq_norm(P: torch.Tensor, Q: torch.Tensor) -> float:
    """‖PQᵀ‖_F² = Σ (PᵀP) ⊙ (QᵀQ), summed over groups."""
    return gram.sq_norm({"": [gram.LowRank(P, Q)]})


def layerwise_terms(layout: Layout, payload: Payload, low_rank: dict[str, tuple] | None = None) -> tuple[gram.Terms, gram.Terms]:
    """What a one-phase layer-wise payload adds, as ``gram`` terms in mean units: (update,
    floating buffers). Dense gradients, activation/delta pairs with the bias read off Δ,
    lookups, and P/Q pairs (``low_rank``: by name, by default those under captured layers'
    names). Sum-unit tensors carry the weight 1/``num_samples``."""
    tensors, w = payload.tensors, 1.0 / payload.num_samples
    update: gram.Terms = {}
    buffers: gram.Terms = {}
    for key, tensor in tensors.items():
        name, role = split_key(key)
        if role == GRAD_ROLE:
            update.setdefault(name, []).append(gram.Dense(tensor, w))
        elif role == BUFFER_ROLE and tensor.is_floating_point():
            buffers[name] = [gram.Dense(tensor, w)]
    for layer in layout.layers:
        a, d = tensors.get(tensor_key(layer.module, "A")), tensors.get(tensor_key(layer.module, "D"))
        ids, rows = tensors.get(tensor_key(layer.module, IDS_ROLE)), tensors.get(tensor_key(layer.module, ROWS_ROLE))
        if ids is not None and rows is not None:
            update.setdefault(layer.weight, []).append(gram.Lookups.of(ids, rows, w))
        if a is not None and d is not None:
            update.setdefault(layer.weight, []).append(gram.Factors(a, d, w))
            if layer.bias:
                update.setdefault(layer.bias, []).append(gram.Dense(d.sum(dim=1), w))
    if low_rank is None:
        low_rank = {layer.module: (tensors.get(tensor_key(layer.module, "P")), tensors.get(tensor_key(layer.module, "Q")))
                    for layer in layout.layers}
    for name, (p, q) in low_rank.items():
        if p is not None and q is not None:
            update.setdefault(name, []).append(gram.LowRank(p, q, w))
    return update, buffers


def contribution_norms(update: gram.Terms, buffers: gram.Terms) -> dict[str, float]:
    """The norms the influence bound reads: of the update terms and of the buffer terms."""
    return {"update": math.sqrt(gram.sq_norm(update)), "buffers": math.sqrt(gram.sq_norm(buffers))}


def layerwise_contribution(layout: Layout, payload: Payload, low_rank: dict[str, tuple] | None = None) -> dict[str, float]:
    """Norms, in mean units, of the update a one-phase layer-wise payload adds and of its
    floating buffers (``layerwise_terms``)."""
    return contribution_norms(*layerwise_terms(layout, payload, low_rank))


def medians_of_the_others(values: list[float]) -> list[float]:
    """``statistics.median`` of every value but the i-th, for each i: one sort, not one per
    site (with a thousand sites the per-site sorts dominated the step). Values that are not
    all finite take the direct route: NaN has no place in a sorted order."""
    if not all(math.isfinite(v) for v in values):
        return [statistics.median(v for j, v in enumerate(values) if j != i) for i in range(len(values))]
    ordered = sorted(values)
    n = len(ordered) - 1  # the others
    medians = []
    for value in values:
        k = bisect.bisect_left(ordered, value)  # equal values are interchangeable: drop the first of them

        def other(i: int) -> float:  # the i-th smallest of the others
            return ordered[i] if i < k else ordered[i + 1]

        medians.append(other(n // 2) if n % 2 else (other(n // 2 - 1) + other(n // 2)) / 2)
    return medians


def influence_outliers(measures: Sequence[dict[str, float]], max_ratio: float, max_norm: float | None) -> dict[int, str]:
    """Sites (by index) whose contribution is non-finite, above ``max_ratio`` × the median
    of the other sites' (with 3 or more sites; with fewer no site is a majority), or above
    the absolute bound ``max_norm`` when one is set."""
    refused: dict[int, str] = {}
    others = {name: medians_of_the_others([m[name] for m in measures]) for name in measures[0]} if len(measures) >= 3 else {}
    for index, measure in enumerate(measures):
        for name, value in measure.items():
            if not math.isfinite(value):
                refused[index] = f"its {name} norm is not finite"
                break
            if max_norm is not None and value > max_norm:
                refused[index] = f"its {name} norm {value:.3g} exceeds federation.max_update_norm={max_norm:g}"
                break
            if others:
                median = others[name][index]
                if value > max_ratio * median:
                    refused[index] = (
                        f"its {name} norm {value:.3g} is more than {max_ratio:g}× the median {median:.3g} of the "
                        "other sites' (federation.max_influence_ratio)"
                    )
                    break
    return refused


# ----------------------------------------------------------------------------- the message


def check_update(facts: ModelFacts, update: dict[str, torch.Tensor]) -> None:
    """The decoded update must name known parameters and buffers with their shapes, finite,
    each once (entries made one at a time could repeat a key, which a dict cannot); raises
    ValueError saying what is wrong."""
    seen = set()
    for key, tensor in update.items():
        if key in seen:
            raise ValueError(f"the update names {printable(key)} twice")
        seen.add(key)
        name, role = split_key(key)
        known = facts.buffers.get(name) if role == BUFFER_ROLE else facts.params.get(key)
        if known is None:
            raise ValueError(f"the update names {printable(key)}, which the model does not have")
        if tuple(tensor.shape) != known[0]:
            raise ValueError(f"the update of {key!r} has shape {tuple(tensor.shape)}, the model's is {known[0]}")
        if not all_finite(tensor):
            raise ValueError(f"the update of {key!r} is not finite")
