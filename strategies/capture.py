"""``dadfl.strategies.capture`` — factor capture: the inputs A and output deltas Δ of every linear, conv and embedding call.

For y = x Wᵀ + b the summed loss has ∂L/∂W = Δᵀ A, with A the rows of x and Δ the rows of
∂L/∂y. Leading dimensions (batch × time) flatten to rows. A convolution is the same
map applied to unfolded patches: A has one row per (sample, output position) and, for
``groups=G``, splits into G independent blocks (G, n, k). An embedding lookup E[ids] is
onehot(ids)·E, so ∂L/∂E = onehot(ids)ᵀ Δ: the ids and the Δ rows are its factors (rows
at ``padding_idx`` get no gradient and are dropped). A weight called T times in one
forward (recurrent cells, reuse, a head tied to an embedding) contributes every call.

Capture follows **calls**, not modules: a ``TorchFunctionMode`` sees every ``F.linear``,
``F.conv1d``, ``F.conv2d`` and ``F.embedding`` whose weight is a parameter (or a block of
its rows, as in ``nn.MultiheadAttention``'s packed projection, whose functional body is
run with the mode active), wherever the call happens. Δ comes from a tensor hook on the
call's own output, so a forward hook that replaces a module's output, in-place ops and
reuse are all seen correctly. Which captures are trustworthy is decided once, by the
probe in ``probe.py``; a step whose calls do not match the layout sends that layer dense.
A call reads the model's **raw input** when its input is that input or anything computed
from it by other functions than a captured call (normalising, scaling, casting, selecting
columns): only a captured call's learned mixing ends the raw input. Raw input taken out of
torch (``x.numpy()``, ``x.tolist()``) cannot be followed back in, so every call after that
counts as reading it.

**Per-sample calls** (only for clipping, ``privacy.py``): the parameters no layer covers are
followed too, with every use of them (and of their views) noted. Two call forms give each
sample's gradient from the call's output gradient δ alone. ``F.layer_norm`` with affine
parameters: y = x̂ ⊙ w + b with x̂ the normalised input, so sample i's gradient is
Σ_{rows of i} δ ⊙ x̂ for w and Σ_{rows of i} δ for b (x̂ is recorded in the forward). An
addition y = a + p of a parameter (or a view of one, such as ``position[:T]``) to a batched
activation: p is broadcast over the batch, so sample i's gradient is δ_i summed down to p's
shape, scattered to the parameter's elements the view reads. Any other use of such a
parameter in a step leaves its per-sample gradient to autograd.
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .layout import CapturedLayer, Layout
from .payload import Factors, LocalResult
from .precision import autocast, autocast_dtype, scaled_backward

log = logging.getLogger("dadfl.capture")

CAPTURED_CALLS = {F.linear: "linear", F.conv1d: "conv1d", F.conv2d: "conv2d", F.embedding: "embedding"}
ARGUMENTS = {
    "linear": ("input", "weight", "bias"),
    "conv1d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "conv2d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "embedding": ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
}
DEFAULTS = {
    "bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1,
    "padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False,
}
LOOKUP = "embedding"
LAYER_NORM = "layer_norm"
ADDITION = "add"
ADDITIONS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)


def _opened(func: Callable) -> Callable:
    """A copy of a ``torch.nn.functional`` composite whose own torch-function check is off.

    A mode's handler runs with the mode popped, so the linear calls inside a composite such
    as ``F.multi_head_attention_forward`` would go unseen; running this copy with the mode
    pushed again lets them through the handler, and the library itself is left untouched.
    """
    namespace = dict(func.__globals__, has_torch_function=lambda *_: False)
    copy = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


OPENED = {F.multi_head_attention_forward: _opened(F.multi_head_attention_forward)}


@dataclass
class Call:
    """One captured call of a weight: its input rows (or ids) now, its Δ rows after backward."""

    kind: str  # "linear", "conv1d", "conv2d" or "embedding"
    weight: str
    row_block: tuple[int, int] | None  # the weight's output rows this call used; None: all
    bias: str | None
    bias_block: tuple[int, int] | None
    groups: int
    inputs: torch.Tensor  # A rows (n, G·k), or ids (n,) for a lookup
    raw: bool  # reads the model's raw input
    padding_idx: int | None = None
    delta: torch.Tensor | None = None  # Δ rows (n, out) once backward has run
    # The input's leading dimension (the batch, when the caller's batch comes first); None for
    # a one-dimensional input. Per-sample clipping (``privacy.py``) maps rows to samples by it.
    lead: int | None = None


@dataclass
class SampleCall:
    """One per-sample call (see the module doc) of parameters no layer covers: its output's
    δ after backward gives each sample's gradient of ``targets``."""

    kind: str  # LAYER_NORM or ADDITION
    # (parameter name, role, flat indices of the parameter's elements it reads; None: all, in order);
    # role: "weight" or "bias" of a layer_norm, "added" for an addition.
    targets: tuple[tuple[str, str, torch.Tensor | None], ...]
    lead: int  # the output's leading dimension (the batch, when batch-first)
    shape: tuple[int, ...]  # layer_norm: normalized_shape; addition: the added tensor's shape, padded to the output's rank
    normalized: torch.Tensor | None = None  # layer_norm's x̂
    delta: torch.Tensor | None = None  # the output's gradient once backward has run


# Functions whose result takes only a shape, dtype and device from their tensor argument,
# none of its values (a recurrent cell's zero state made with ``inputs.new_zeros``).
VALUE_FREE = frozenset({
    torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
})


# Functions that hand a tensor's values to code outside torch, where nothing connects them to
# what comes back (``torch.from_numpy(x.numpy() / 100)``): once raw input leaves this way,
# every captured call after it counts as reading raw input.
LEAVES_TORCH = frozenset({torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.tolist})


def _reads(ids: set[int], values) -> bool:
    """Whether any of ``values``, or of the items of those that are tuples or lists (``torch.cat``'s), is in ``ids``."""
    for value in values:
        if id(value) in ids:
            return True
        if type(value) in (tuple, list):
            for item in value:
                if id(item) in ids:
                    return True
    return False


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of a tensor's storage (shared by its views); None where it has none (sparse)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class CallRecorder(TorchFunctionMode):
    """Records the calls on the given parameters during a forward pass.

    ``refused`` names the parameters called in a form capture cannot reproduce exactly
    (mixed dtypes outside autocast, ``max_norm``/``scale_grad_by_freq``/``sparse`` lookups), with why.
    Under autocast a call's A and Δ are in the dtype it computes in (``precision.py``).
    ``uses`` names, per parameter, the other functions whose differentiable results read it
    (``torch.Tensor.t`` for a decoder's ``F.linear(z, W.t())``); views of a parameter are
    followed to where they are used.

    ``sample_params`` (clipping only): parameters whose per-sample calls are recorded in
    ``sample_calls``; ``sample_other_uses`` names, per such parameter, a function that read it
    (or a view of it) otherwise, so its per-sample gradient is not theirs alone.
    """

    def __init__(
        self,
        params: dict[int, tuple[str, torch.Tensor]],
        raw_inputs: Sequence = (),
        sample_params: dict[int, tuple[str, torch.Tensor]] | None = None,
    ):
        super().__init__()
        self.params = params  # id(parameter) -> (canonical name, parameter)
        # Raw input and what is computed from it (``_follow_raw``): by object, checked on every
        # call, and by storage, checked on captured calls only (a tensor sharing raw memory that
        # no call made, such as ``x.data``).
        self._raw: list[torch.Tensor] = [t for t in raw_inputs if torch.is_tensor(t)]  # kept alive: ids stay theirs
        self.raw_ids = {id(t) for t in self._raw}
        self.raw_storages = {_storage(t) for t in self._raw} - {None, 0}
        self.raw_left_torch = False  # raw input went through LEAVES_TORCH
        self.calls: dict[str, list[Call]] = {}
        self.refused: dict[str, str] = {}
        self.uses: dict[str, set[str]] = {}
        self._views: dict[int, tuple[str, torch.Tensor, str]] = {}  # id -> (parameter, view kept alive, made by)
        # Off while a batched (per-sample) backward runs through the same graph: its
        # cotangents are not this batch's Δ and must not replace it.
        self.keep_deltas = True
        self.sample_params = sample_params or {}
        self.sample_calls: dict[str, list[SampleCall]] = {}
        self.sample_other_uses: dict[str, str] = {}
        self._sample_views: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}  # id -> (parameter, view, flat indices)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opened = OPENED.get(func)
        if opened is not None:
            with self:
                return opened(*args, **kwargs)
        out = func(*args, **kwargs)
        kind = CAPTURED_CALLS.get(func)
        captured = (
            torch.is_grad_enabled() and kind is not None and torch.is_tensor(out) and out.requires_grad
            and self._record(kind, args, kwargs, out)
        )
        if not captured and func not in VALUE_FREE:
            self._follow_raw(func, args, kwargs, out)
        if not torch.is_grad_enabled():
            return out
        if not captured:
            self._note_uses(func, args, kwargs, out)
        if self.sample_params:
            self._follow_sample_params(func, args, kwargs, out)
        return out

    def _sample_source(self, tensor) -> tuple[str, torch.Tensor | None] | None:
        """(parameter name, flat indices read; None: all) for a followed parameter or view of one."""
        if not torch.is_tensor(tensor):
            return None
        if id(tensor) in self.sample_params:
            return self.sample_params[id(tensor)][0], None
        if id(tensor) in self._sample_views:
            name, _, index = self._sample_views[id(tensor)]
            return name, index
        return None

    def _follow_sample_params(self, func, args: tuple, kwargs: dict, out) -> None:
        """Record a per-sample call, follow a view, or note another use (module doc)."""
        recorded = self._record_sample_call(func, args, kwargs, out)
        used = {}
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (tuple, list)) else (value,):
                source = self._sample_source(item)
                if source is not None and id(item) not in recorded:
                    used[source[0]] = item
        if not used:
            return
        results = [r for r in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(r) and r.requires_grad]
        function = torch.overrides.resolve_name(func) or repr(func)
        for result in results:
            base = result._base
            viewed = self.sample_params[id(base)][0] if base is not None and id(base) in self.sample_params else None
            if len(used) == 1 and viewed in used and base.is_contiguous():
                # A view: which of the parameter's elements it reads, in its own order.
                offset = result.storage_offset() - base.storage_offset()
                index = torch.arange(base.numel(), device=base.device).as_strided(result.shape, result.stride(), offset)
                self._sample_views[id(result)] = (self.sample_params[id(base)][0], result, index.reshape(-1))
            else:
                for name in used:
                    self.sample_other_uses.setdefault(name, function)

    def _record_sample_call(self, func, args: tuple, kwargs: dict, out) -> set[int]:
        """The ids of the followed tensors this call records as a per-sample call (module doc)."""
        if not (torch.is_tensor(out) and out.requires_grad and out.dim() >= 1):
            return set()
        if func is F.layer_norm:
            bound = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args), **kwargs)
            shape = tuple(bound["normalized_shape"]) if isinstance(bound["normalized_shape"], (tuple, list)) else (int(bound["normalized_shape"]),)
            x = bound["input"]
            targets = [
                (self.sample_params[id(t)][0], role, None, t)
                for role, t in (("weight", bound.get("weight")), ("bias", bound.get("bias")))
                if torch.is_tensor(t) and id(t) in self.sample_params and t.dtype == out.dtype
            ]
            if not targets or x.dim() <= len(shape):
                return set()
            with torch.no_grad():
                normalized = F.layer_norm(x.detach(), shape, None, None, bound.get("eps", 1e-5))
            call = SampleCall(LAYER_NORM, tuple(t[:3] for t in targets), int(out.shape[0]), shape, normalized)
        elif func in ADDITIONS and len(args) == 2 and kwargs.get("alpha", 1) == 1 and set(kwargs) <= {"alpha"}:
            sources = [self._sample_source(a) for a in args]
            added = [(s, a) for s, a in zip(sources, args) if s is not None]
            if len(added) != 1 or added[0][1].dtype != out.dtype:
                return set()
            (name, index), tensor = added[0]
            shape = (1,) * (out.dim() - tensor.dim()) + tuple(tensor.shape)
            if shape[0] != 1:  # the parameter itself varies along the batch dimension
                return set()
            call = SampleCall(ADDITION, ((name, "added", index),), int(out.shape[0]), shape)
            targets = [(name, "added", index, tensor)]
        else:
            return set()
        for name in dict.fromkeys(t[0] for t in targets):
            self.sample_calls.setdefault(name, []).append(call)

        def record(grad: torch.Tensor) -> None:
            if self.keep_deltas:
                call.delta = grad.detach()

        out.register_hook(record)
        return {id(t[3]) for t in targets}

    def _follow_raw(self, func, args: tuple, kwargs: dict, out) -> None:
        """What anything but a captured call computes from the raw input (a normalisation, a
        scaling, a cast, a selection of columns) is raw input too: a layer reading it reads the
        patient data transformed, often invertibly (BatchNorm's output and its running
        statistics give back the rows). Only a captured call's output (a learned mixing) is not."""
        if not _reads(self.raw_ids, args) and not (kwargs and _reads(self.raw_ids, kwargs.values())):
            return
        if func in LEAVES_TORCH:
            self.raw_left_torch = True
        for result in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(result) and id(result) not in self.raw_ids:
                self._raw.append(result)
                self.raw_ids.add(id(result))
                pointer = _storage(result)
                if pointer:  # not sparse, not empty
                    self.raw_storages.add(pointer)

    def _note_uses(self, func, args: tuple, kwargs: dict, out) -> None:
        sources = {}  # parameter -> the function that made the view it is read through (None: direct)
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if torch.is_tensor(item):
                    if id(item) in self.params:
                        sources[self.params[id(item)][0]] = None
                    elif id(item) in self._views:
                        name, _, made_by = self._views[id(item)]
                        sources[name] = made_by
        if not sources:
            return
        function = torch.overrides.resolve_name(func) or repr(func)
        for result in out if isinstance(out, (tuple, list)) else (out,):
            if not (torch.is_tensor(result) and result.requires_grad):
                continue
            base = result._base
            if base is not None and id(base) in self.params:  # a view: followed to its use
                self._views[id(result)] = (self.params[id(base)][0], result, function)
            else:
                for name, made_by in sources.items():
                    self.uses.setdefault(name, set()).add(function if made_by is None else f"{function} of its {made_by} view")

    def _parameter(self, tensor, whole_only: bool) -> tuple[str, tuple[int, int] | None] | None:
        """(name, row block) when ``tensor`` is a recorded parameter or a block of its rows."""
        if not torch.is_tensor(tensor):
            return None
        if id(tensor) in self.params:
            return self.params[id(tensor)][0], None
        base = tensor._base
        if whole_only or base is None or id(base) not in self.params or id(tensor) not in self._views:
            return None
        # A block of whole rows (what split/chunk of dim 0 gives): same strides, whole rows.
        row_stride = base.stride(0) if base.dim() else 1
        offset = tensor.storage_offset() - base.storage_offset()
        if (
            not base.is_contiguous()
            or tensor.dim() != base.dim()
            or tensor.stride() != base.stride()
            or tensor.shape[1:] != base.shape[1:]
            or offset % row_stride
        ):
            return None
        start = offset // row_stride
        return self.params[id(base)][0], (start, start + tensor.shape[0])

    def _record(self, kind: str, args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
        """Record one call if its weight is a recorded parameter (or a block of its rows)."""
        bound = dict(DEFAULTS)
        bound.update(zip(ARGUMENTS[kind], args))
        bound.update(kwargs)
        found = self._parameter(bound["weight"], whole_only=kind != "linear")
        if found is None:
            return False
        name, rows = found
        weight, x = bound["weight"], bound["input"]
        if kind == LOOKUP:
            if bound["max_norm"] is not None or bound["scale_grad_by_freq"] or bound["sparse"]:
                self.refused[name] = "looked up with max_norm, scale_grad_by_freq or sparse=True"
                return True
        elif (x.dtype != weight.dtype or out.dtype != weight.dtype) and out.dtype != autocast_dtype(out.device):
            self.refused[name] = f"a {kind} call computes in {out.dtype} while the weight is {weight.dtype}, outside autocast"
            return True
        raw = self.raw_left_torch or id(x) in self.raw_ids or _storage(x) in self.raw_storages
        lead = int(x.shape[0]) if x.dim() >= (2 if kind in ("linear", LOOKUP) else {"conv1d": 3, "conv2d": 4}[kind]) else None
        if kind == LOOKUP:
            padding = bound["padding_idx"]
            if padding is not None and padding < 0:
                padding += weight.shape[0]
            call = Call(kind, name, None, None, None, 1, x.detach().reshape(-1), raw, padding, lead=lead)
        else:
            bias = self._parameter(bound["bias"], whole_only=kind != "linear") if bound["bias"] is not None else None
            groups = int(bound["groups"]) if kind != "linear" else 1
            call = Call(
                kind, name, rows, bias[0] if bias else None, bias[1] if bias else None, groups,
                # Under autocast the kernel multiplied x rounded to the output's dtype: so does A.
                _input_rows(kind, x.detach().to(out.dtype), weight, bound), raw, lead=lead,
            )
        self.calls.setdefault(name, []).append(call)
        width = out.shape[-1] if kind in ("linear", LOOKUP) else None
        batched_dims = {"conv1d": 3, "conv2d": 4}.get(kind)

        def record(grad: torch.Tensor) -> None:
            if not self.keep_deltas:
                return
            grad = grad.detach()
            if width is not None:
                call.delta = grad.reshape(-1, width)
            else:
                if grad.dim() < batched_dims:  # an unbatched conv input: one sample
                    grad = grad.unsqueeze(0)
                call.delta = grad.flatten(2).transpose(1, 2).reshape(-1, grad.shape[1])

        out.register_hook(record)
        return True


def _input_rows(kind: str, x: torch.Tensor, weight: torch.Tensor, bound: dict) -> torch.Tensor:
    """Rows of A for one linear or conv call, shape (n, G·k), group g in columns [g·k, (g+1)·k)."""
    if kind == "linear":
        return x.reshape(-1, x.shape[-1])
    dims = 1 if kind == "conv1d" else 2
    if x.dim() == dims + 1:  # unbatched input: one sample
        x = x.unsqueeze(0)
    kernel = tuple(weight.shape[2:])
    stride, dilation = _per_dim(bound["stride"], dims), _per_dim(bound["dilation"], dims)
    padding = bound["padding"]
    if padding == "valid":
        pairs = [(0, 0)] * dims
    elif padding == "same":  # torch pads the odd extra on the right
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        pairs = [(t // 2, t - t // 2) for t in totals]
    else:
        pairs = [(p, p) for p in _per_dim(padding, dims)]
    x = F.pad(x, [side for pair in reversed(pairs) for side in pair])
    if dims == 1:
        patches = F.unfold(x.unsqueeze(2), (1, kernel[0]), dilation=(1, dilation[0]), stride=(1, stride[0]))
    else:
        patches = F.unfold(x, kernel, dilation=dilation, stride=stride)
    # (B, C·kh·kw, L) -> (B·L, C·kh·kw): one row per sample and output position.
    return patches.transpose(1, 2).reshape(-1, patches.shape[1])


def _per_dim(value, dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * dims


def by_group(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """(n, G·k) -> (G, n, k)."""
    return rows.reshape(rows.shape[0], groups, -1).transpose(0, 1).contiguous()


def id_dtype(num_embeddings: int) -> torch.dtype:
    """Ids travel as int32 whenever the table fits (it always does in practice), else int64."""
    return torch.int32 if num_embeddings <= torch.iinfo(torch.int32).max else torch.int64


def layer_factors(layer: CapturedLayer, calls: Sequence[Call]) -> Factors | None:
    """The factors of one layer from its calls (forward order); calls without Δ contribute nothing."""
    matmuls = [c for c in calls if c.kind != LOOKUP and c.delta is not None]
    lookups = [c for c in calls if c.kind == LOOKUP and c.delta is not None]
    if not matmuls and not lookups:
        return None
    A = D = ids = rows = None
    if matmuls:
        deltas = []
        for call in matmuls:
            if call.row_block is None:
                deltas.append(call.delta)
            else:  # a block of the weight's rows: Δ of the others is zero
                padded = call.delta.new_zeros(call.delta.shape[0], layer.out_features)
                padded[:, call.row_block[0] : call.row_block[1]] = call.delta
                deltas.append(padded)
        A = by_group(torch.cat([c.inputs for c in matmuls]), layer.groups)
        D = by_group(torch.cat(deltas), layer.groups)
    if lookups:
        kept_ids, kept_rows = [], []
        for call in lookups:
            keep = call.inputs != call.padding_idx if call.padding_idx is not None else slice(None)
            kept_ids.append(call.inputs[keep])
            kept_rows.append(call.delta[keep])
        ids = torch.cat(kept_ids).to(id_dtype(layer.out_features))
        rows = torch.cat(kept_rows)
    return Factors(A=A, D=D, ids=ids, rows=rows)


def call_forms(calls: Sequence[Call]) -> tuple[str, ...]:
    return tuple(sorted({c.kind for c in calls}))


_REPORTED: set[tuple[str, str]] = set()  # (layer, reason) pairs already logged as travelling dense


class FactorCapture:
    """Context manager recording the calls of the layout's layers during one forward pass."""

    def __init__(self, model: nn.Module, layout: Layout, raw_inputs: Sequence = (), per_sample: bool = False):
        """``per_sample``: also follow the parameters no layer covers (module doc; clipping)."""
        params = dict(model.named_parameters())
        self.layout = layout
        followed = {id(params[n]): (n, params[n]) for n in layout.uncovered} if per_sample else None
        self.recorder = CallRecorder(
            {id(params[l.weight]): (l.weight, params[l.weight]) for l in layout.layers}, raw_inputs, followed
        )

    def __enter__(self) -> "FactorCapture":
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.__exit__(*exc)

    def problems(self) -> dict[str, str]:
        """Why each layer whose calls this step differ from the verified layout (another call
        form, another compute dtype, a raw-input read it did not have) travels dense this step, by module."""
        problems = {}
        for layer in self.layout.layers:
            calls = self.recorder.calls.get(layer.weight, [])
            problem = self.recorder.refused.get(layer.weight)
            if problem is None and calls and not set(call_forms(calls)) <= set(layer.forms):
                problem = f"called as {', '.join(call_forms(calls))} where the layout verified {', '.join(layer.forms)}"
            new_uses = self.recorder.uses.get(layer.weight, set()) - set(layer.uses)
            if problem is None and new_uses:
                problem = f"also used by {', '.join(sorted(new_uses))}, which the probe did not see"
            computed = {c.inputs.dtype for c in calls if c.kind != LOOKUP} - {layer.compute_dtype}
            if problem is None and computed:
                problem = f"computes in {', '.join(map(str, computed))} where the layout verified {layer.compute_dtype}"
            if problem is None and any(c.raw for c in calls) and not layer.raw_input:
                problem = "read the raw input this step"
            if problem is not None:
                problems[layer.module] = problem
        return problems

    def factors(self) -> dict[str, Factors]:
        """Factors per layer; a layer with a problem this step (``problems``) is left out: it travels dense."""
        problems = self.problems()
        result = {}
        for layer in self.layout.layers:
            if layer.module in problems:
                reason = (layer.module, problems[layer.module])
                # once per layer and reason: a lasting cause would otherwise fill the log every step
                log.log(logging.DEBUG if reason in _REPORTED else logging.WARNING,
                        "layer %r travels dense this step: %s", *reason)
                _REPORTED.add(reason)
                continue
            factors = layer_factors(layer, self.recorder.calls.get(layer.weight, []))
            if factors is not None:
                result[layer.module] = factors
        return result


def per_sample_losses(losses: torch.Tensor) -> torch.Tensor:
    """Reduce a loss with leading batch dimension to one value per sample."""
    if losses.dim() == 0:
        raise ValueError(
            "the workload loss returned a single value (a mean- or sum-reduced loss); it must return "
            "one loss per sample: use reduction='none' in the workload's loss function"
        )
    return losses.reshape(losses.shape[0], -1).mean(dim=1) if losses.dim() > 1 else losses


def as_args(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def forward_losses(
    model: nn.Module,
    layout: Layout,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor,
    capture: bool = True,
    per_sample: bool = False,
    precision: str = "fp32",
) -> tuple[FactorCapture, torch.Tensor]:
    """The forward pass of one site's batch with the layout's calls recorded: (recorder, one
    loss per sample). Gradients are zeroed; nothing is backpropagated yet. ``per_sample``:
    see ``FactorCapture``; ``precision``: the autocast the forward and the loss run under
    (``precision.py``; the layout must have been probed at the same one)."""
    model.zero_grad(set_to_none=True)
    args = as_args(inputs)
    recorder = FactorCapture(model, layout if capture else Layout((), (), (), ()), args, per_sample)
    # nothing to record: the forward without a handler on every torch call (the same operations)
    recording = recorder if capture or per_sample else contextlib.nullcontext()
    with autocast(precision, args[0].device):
        with recording:
            outputs = model(*args)
        return recorder, sample_losses(loss_fn, outputs, targets)


def sample_losses(loss_fn: Callable, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One loss per sample of the batch, or a ValueError saying how to fix the workload's loss."""
    losses = per_sample_losses(loss_fn(outputs, targets))
    if losses.shape[0] != targets.shape[0]:
        raise ValueError(
            f"loss returned {losses.shape[0]} values for a batch of {targets.shape[0]} samples; "
            "the workload loss must return one loss per sample (reduction='none')"
        )
    return losses


def local_result(model: nn.Module, layout: Layout, recorder: FactorCapture, num_samples: int, loss_sum: float) -> LocalResult:
    """What one backward left in the parameters' ``.grad`` and the recorder, as a LocalResult."""
    params = dict(model.named_parameters())
    grads = {name: params[name].grad.detach() for name in layout.params if params[name].grad is not None}
    buffers = dict(model.named_buffers())
    return LocalResult(
        num_samples=num_samples,
        loss_sum=loss_sum,
        grads=grads,
        factors=recorder.factors(),
        buffers={name: buffers[name].detach().clone() for name in layout.buffers},
    )


def local_step(
    model: nn.Module,
    layout: Layout,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor,
    capture: bool = True,
    precision: str = "fp32",
) -> LocalResult:
    """Forward and backward of the **summed** per-sample loss on one site's batch, the forward
    at ``precision`` (fp16 with loss scaling: ``precision.py``).

    ``grads`` holds the parameters that received a gradient; one that got none (unused by
    this batch) is absent, so it gets no update unless another site's batch reaches it.
    """
    recorder, losses = forward_losses(model, layout, loss_fn, inputs, targets, capture, precision=precision)
    total = losses.sum()
    if precision == "fp16":
        calls = [call for calls in recorder.recorder.calls.values() for call in calls]
        scale = scaled_backward(total, model.parameters(), lambda: [call.delta for call in calls])
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(scale)
        for call in calls:
            if call.delta is not None:
                call.delta = call.delta / scale  # a power of two: exact short of fp16's subnormals
    else:
        total.backward()
    return local_result(model, layout, recorder, int(targets.shape[0]), float(total.detach()))
