"""``dadfl.strategies.base`` — the strategy protocol: the two halves, the ``Strategy`` base class, dense parts.

A strategy has two halves. The **site half** turns one local forward/backward into the
payload of phase 0, and turns each server message into the next phase's payload or,
after the last phase, into the update. The **server half** aggregates the sites'
payloads of one phase into one message that every site receives. Every replica
(sites and server) derives the update from the same messages with the same code, so
replicas stay bit-identical.

Scaling convention: a site backpropagates the **sum** of its per-sample losses, so
every uploaded gradient or factor is in "sum" units; the server divides by
N = Σ n_s. The update is therefore the gradient of the mean loss over the union of
all sites' batches (site weight n_s / N), whatever the batch sizes.

The containers that travel (``Payload``, ``LocalResult``, ``Factors``, tensor keys and
roles) are in ``payload.py``. Imports in ``strategies/`` go one way: ``payload`` and
``layout`` need nothing here, ``capture`` needs them, ``checks`` needs ``capture``, this
module needs ``checks``, and ``probe`` and every strategy need this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Iterator, Protocol, Sequence

import torch
from torch import nn

from .checks import check_uploads, contribution_norms, layerwise_terms
from .layout import CapturedLayer, Layout
from .robust import MAX_UNDILUTED
from .payload import BUFFER_ROLE, GRAD_ROLE, IDS_ROLE, ROWS_ROLE, LocalResult, Payload, split_key, tensor_key

StateDict = dict[str, torch.Tensor]


class HalfState(Protocol):
    """What a half carries from one step to the next, for checkpoints and resume.

    Tensors only (ints as 0-dim int64 tensors, RNG states as uint8 tensors), so a state
    is saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``.
    Contract: between two steps, ``fresh.load_state_dict(half.state_dict())`` makes
    ``fresh`` behave bit-identically to ``half`` from then on. Stateless halves return {}.
    """

    def state_dict(self) -> StateDict:
        """The half's carried state, as tensors (copies: later steps do not change it)."""

    def load_state_dict(self, state: StateDict) -> None:
        """Replace the half's carried state; refuse (ValueError) a state it cannot use."""


class SiteHalf(HalfState, Protocol):
    def begin(self, local: LocalResult, step: int) -> Payload:
        """Payload of phase 0 from one local forward/backward."""

    def receive(self, message: Payload) -> Payload | None:
        """Take the server's message of a phase; return the next phase's payload, or
        None after the last phase."""


Batch = tuple[torch.Tensor, torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class TrainsRounds(Protocol):
    """A site half that consumes a step's batches itself (FedAvg/DiLoCo's H local steps).

    The runtime's replica (``Replica.work``) looks for ``train_round`` on the site half: a half
    with it is handed the step's batches (``Strategy.batch_indices``, one held at a time) and
    returns the step's ``LocalResult``; a half without it gets one forward/backward on the
    step's first batch (``local_step``), as every one-batch strategy. A user strategy's half
    defines ``train_round`` to train on its steps' batches its own way.
    """

    def train_round(self, model: nn.Module, loss_fn: Callable, batches: Iterable[Batch], run_optimizer: OptimizerFactory) -> LocalResult:
        """Train from the model's current weights on ``batches`` and put the weights back (the
        replica applies the step's decoded update from them); ``run_optimizer`` builds the run's
        optimizer over a list of parameters."""


class ServerHalf(HalfState, Protocol):
    def aggregate(self, payloads: Sequence[Payload]) -> Payload:
        """Combine the sites' payloads of one phase (in site order) into the message
        every site receives."""


class Stateless:
    """A half that carries nothing from one step to the next."""

    def state_dict(self) -> StateDict:
        return {}

    def load_state_dict(self, state: StateDict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)[:5]}")


def tensors_under(state: StateDict, prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` whose key starts with ``prefix + '/'``, prefix removed."""
    start = prefix + "/"
    return {key[len(start) :]: value for key, value in state.items() if key.startswith(start)}


def with_prefix(prefix: str, tensors: dict[str, torch.Tensor]) -> StateDict:
    """``tensors`` under ``prefix + '/'``, cloned so later steps do not change them."""
    return {f"{prefix}/{key}": value.detach().clone() for key, value in tensors.items()}


def check_state_keys(owner: str, state: StateDict, prefixes: Sequence[str]) -> None:
    """Refuse a state with keys no prefix of ``owner`` explains (e.g. another strategy's)."""
    unknown = sorted(key for key in state if key.split("/", 1)[0] not in prefixes)
    if unknown:
        raise ValueError(f"{owner}: state has unknown keys {unknown[:5]}; expected keys under {list(prefixes)}")


class LayerwiseServer(Stateless):
    """A one-phase server half: dense means, plus what ``aggregate_layer`` makes of each
    captured layer's entries."""

    layout: Layout

    def aggregate(self, payloads: Sequence[Payload]) -> Payload:
        total = sum(p.num_samples for p in payloads)
        tensors = dense_aggregate(payloads, self.layout.uncovered, self.layout.buffers)
        for layer in self.layout.layers:
            tensors.update(self.aggregate_layer(layer, payloads, total))
        return Payload(payloads[0].step, payloads[0].phase, total, tensors)

    def aggregate_layer(self, layer: CapturedLayer, payloads: Sequence[Payload], total: int) -> dict:
        raise NotImplementedError  # pragma: no cover - every subclass defines it


@dataclass(frozen=True)
class Strategy:
    """Options of one strategy, and the factory of its matching halves.

    ``decode`` turns the server's messages of one step into the update (mean-loss
    gradient by parameter name, averaged buffers under ``"<name>:buffer"``). Every
    replica calls it on the same messages, which keeps replicas bit-identical.
    ``model`` is the caller's replica (current weights, before the update); only
    strategies that recompute through the network (edAD) read it.
    """

    name = "strategy"
    needs_factors = True
    # Capabilities: what a runtime, the config checks and [dp] ask of a strategy class (a
    # user's own strategy states its own).
    # exact: the update is the weighted mean of the sites' gradients (dSGD's), for any model.
    exact: ClassVar[bool] = False
    # supports_dp: the released update is exactly the sum of the sites' clipped per-sample
    # gradients, so the coordinator's noise gives the ε the accountant states (dadfl.privacy).
    supports_dp: ClassVar[bool] = False
    # has_local_steps: a step trains several local batches (``batch_indices``) before it uploads.
    has_local_steps: ClassVar[bool] = False
    # phases: the most upload phases one step takes (PowerSGD: P, then Q).
    phases: ClassVar[int] = 1
    def site(self, layout: Layout, model: nn.Module | None = None) -> SiteHalf:  # pragma: no cover
        raise NotImplementedError

    def server(self, layout: Layout, model: nn.Module | None = None) -> ServerHalf:  # pragma: no cover
        raise NotImplementedError

    def decode(
        self, layout: Layout, messages: Sequence[Payload], model: nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        return decode_message(layout, messages[-1])

    def decode_each(
        self, layout: Layout, messages: Sequence[Payload], model: nn.Module | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``decode``'s entries one at a time (its keys, values and order), for a replica that
        applies each as it comes (``apply_update``): ``decode_entries`` when ``decode`` is this
        class's own; else the whole update is decoded first, unless the strategy overrides this
        too (rank-dAD)."""
        if type(self).decode is Strategy.decode:
            return decode_entries(layout, messages[-1])
        return iter(self.decode(layout, messages, model).items())

    def batch_indices(self, step: int) -> range:
        """The positions in a site's batch stream that ``step`` trains on: one batch, or a
        round's H batches for a strategy with local steps (``local_steps.py``)."""
        return range(step, step + 1)

    def batches_per_step(self, step: int = 0) -> int:
        """How many batches ``step`` trains on (``batch_indices``' length): what a step's sample
        count (× batch size) and its work (× model bytes) are bounded by."""
        return len(self.batch_indices(step))

    def outer_optimizer(self, params) -> "torch.optim.Optimizer | None":
        """The optimizer every replica applies the update with, when the strategy defines
        it (FedAvg, DiLoCo); None: the run's ``[optimizer]``."""
        return None

    def describe(self, layout: Layout, messages: Sequence[Payload]) -> dict[str, float]:
        """Per-step diagnostics for the metrics log (e.g. effective rank per layer)."""
        return {}

    # The server's checks (``checks.py``): every upload is hostile until they pass.

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model: nn.Module | None = None) -> list | None:
        """What a site may send in ``phase`` of ``step``: a list of ``checks.Unit``, or
        None when this phase takes no upload."""
        raise NotImplementedError  # pragma: no cover - every strategy states its own

    def check_uploads(
        self, layout: Layout, facts, phase: int, step: int, payloads: Sequence[Payload],
        messages_so_far: Sequence[Payload], model: nn.Module | None = None,
    ) -> list:
        """The uploads of one phase that break this strategy's rules, as
        ``checks.PayloadRejection`` (index into ``payloads``, reason)."""
        return check_uploads(self.upload_units(layout, facts, phase, step, model), payloads, self.name, phase)

    def terms(
        self, layout: Layout, payload: Payload, messages_so_far: Sequence[Payload], model: nn.Module | None = None
    ) -> tuple[dict, dict]:
        """What one checked upload adds, as ``gram`` terms in mean units: (the update's, the
        floating buffers'). Norms and the inner products between sites (``gram.gram``) are
        computed from them without forming ΔᵀA."""
        return layerwise_terms(layout, payload)

    def uploads_agree(self, step: int, phase: int) -> bool:
        """Whether honest sites' uploads of ``phase`` of ``step`` point the same way, so that the
        robust rule may weigh sites by their agreement with the others (``robust.py``); False
        where they carry per-site memories that pull apart by construction (PowerSGD's P_s):
        that phase is then clipped only."""
        return True

    def momenta_agree(self, step: int, phase: int) -> bool:
        """Whether honest sites' momenta of the updates of ``phase`` (their sum over steps, the
        robust rule's momentum, ``robust.py``) point the same way, so that agreement may read
        them instead of the step alone. It needs update terms in parameter space (``terms``),
        whose sum over steps means something; False where they are coordinates in a basis that
        changes every step (PowerSGD), or where an upload already sums many local steps
        (FedAvg, DiLoCo): agreement then reads each step's updates."""
        return True

    def chooses_basis(self, step: int, phase: int) -> bool:
        """Whether ``phase`` of ``step`` only chooses a basis: its aggregate is orthonormalised
        (PowerSGD's P̂ = orth(Σ P_s)), so scaling a site there changes its share of the
        directions, never the step's size. The robust rule then clips every site to the median
        of the others' norms (``robust.BASIS_CLIP_RATIO``) and those factors bound no later phase."""
        return False

    def contribution(
        self, layout: Layout, payload: Payload, messages_so_far: Sequence[Payload], model: nn.Module | None = None
    ) -> dict[str, float]:
        """Norms (mean units, float64) of what one checked upload adds to the update, by
        kind ("update", "buffers"); the server bounds each against the other sites'."""
        return contribution_norms(*self.terms(layout, payload, messages_so_far, model))

    # Roles whose tensors carry an upload's gradient linearly: Δ (A is the same for any
    # scale), dense gradients, lookups' Δ rows, P (its column scales when sent as codes).
    SCALED_ROLES = frozenset({GRAD_ROLE, "D", ROWS_ROLE, "P", "P_scale"})

    def scale(self, layout: Layout, payload: Payload, factor: float) -> Payload:
        """The same upload with the update it adds multiplied by ``factor`` in [0,
        ``MAX_UNDILUTED``], exactly (the robust rule's clipping, weights and counts,
        ``robust.py``): every floating tensor of a role in ``SCALED_ROLES`` times ``factor``;
        buffers are statistics, not gradients, and stay. Above 1 only where the rule counts a
        weak site less in the mean, which it never does under differential privacy (its
        sensitivity stays valid). A strategy whose gradient travels under other roles overrides
        ``SCALED_ROLES``."""
        if not 0.0 <= factor <= MAX_UNDILUTED:
            raise ValueError(f"{self.name}: scale factor {factor!r} is outside [0, {MAX_UNDILUTED}]")
        tensors = {
            key: tensor * factor if split_key(key)[1] in self.SCALED_ROLES and tensor.is_floating_point() else tensor
            for key, tensor in payload.tensors.items()
        }
        return Payload(payload.step, payload.phase, payload.num_samples, tensors)


RAW_INPUT_POLICIES = ("dense", "low_rank", "activations")
# One policy for every strategy that sends a projection of a raw-input layer's gradient
# (rank-dAD, PowerSGD): a rank-r projection of a gradient reveals no more than the gradient
# itself, which dSGD sends, so it is allowed unless the configuration says "dense";
# raw activations leave a site only with "activations" (docs/privacy.md).
DEFAULT_RAW_INPUT = "low_rank"


def check_raw_input(raw_input: str) -> None:
    if raw_input not in RAW_INPUT_POLICIES:
        raise ValueError(
            f"raw_input={raw_input!r} is not one of {', '.join(RAW_INPUT_POLICIES)}: 'dense' keeps "
            "layers that read the raw input dense, 'low_rank' allows low-rank factors of them, "
            "'activations' allows their raw activations to leave the site"
        )


def may_share(layer: CapturedLayer, raw_input: str, form: str) -> bool:
    """Privacy guard: may this layer leave the site as ``form`` ("activations" or "low_rank")?

    Layers that read the model's raw input (patient data) travel dense unless the
    configuration explicitly allows that form; low-rank factors are allowed by
    ``"low_rank"`` and ``"activations"``, raw activations only by ``"activations"``.
    """
    check_raw_input(raw_input)
    if not layer.raw_input:
        return True
    return raw_input == "activations" or (form == "low_rank" and raw_input == "low_rank")


def low_rank_allowed(layout: Layout, raw_input: str) -> set[str]:
    """The parameters a rank-r strategy may send as a projection of their gradient: the
    weights of captured layers the guard allows as low-rank factors and, unless
    ``raw_input`` is "dense", every uncovered parameter (the layout cannot tell whether one
    reads the raw input). rank-dAD and PowerSGD both plan with it, so one policy governs both."""
    allowed = {layer.weight for layer in layout.layers if may_share(layer, raw_input, "low_rank")}
    if raw_input != "dense":
        allowed.update(layout.uncovered)
    return allowed


# ----------------------------------------------------------------------------- dense parts
# Parameters no factor capture covers, parameters a strategy chooses to send dense, and
# buffers (BatchNorm running statistics, sample-weighted) travel the same way in every
# strategy: up as sums, down as means.



def dense_upload(local: LocalResult, names: Sequence[str], buffers: Sequence[str]) -> dict[str, torch.Tensor]:
    """Gradients (sum units) of ``names`` that received one, and buffers. A parameter with
    no gradient is left out: if no site has one, it gets no update, as in plain autograd."""
    tensors = {tensor_key(name, GRAD_ROLE): local.grads[name] for name in names if name in local.grads}
    for name in buffers:
        value = local.buffers[name]
        # Integer buffers (num_batches_tracked) are identical on every replica: one copy.
        tensors[tensor_key(name, BUFFER_ROLE)] = value * local.num_samples if value.is_floating_point() else value
    return tensors


def dense_aggregate(payloads: Sequence[Payload], names: Sequence[str], buffers: Sequence[str]) -> dict[str, torch.Tensor]:
    total = sum(p.num_samples for p in payloads)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        key = tensor_key(name, GRAD_ROLE)
        present = [p.tensors[key] for p in payloads if key in p.tensors]
        if present:  # a site without it had no gradient: it adds nothing
            out[key] = sum_in_order(present) / total
    for name in buffers:
        key = tensor_key(name, BUFFER_ROLE)
        first = payloads[0].tensors[key]
        if first.is_floating_point():
            out[key] = sum_in_order([p.tensors[key] for p in payloads]) / total
        else:
            out[key] = torch.stack([p.tensors[key] for p in payloads]).max(dim=0).values
    return out


def sum_in_order(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum in the given order: the server sorts payloads by site so sums are reproducible."""
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total += tensor
    return total


def group_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate (G, n_s, k) blocks of every site along the row axis."""
    return torch.cat(list(tensors), dim=1)


def weight_from_factors(A: torch.Tensor, D: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Σ_rows Dᵀ A per group, reshaped to the weight's shape."""
    return torch.bmm(D.transpose(1, 2), A).reshape(shape)


def weight_from_lookups(ids: torch.Tensor, rows: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """onehot(ids)ᵀ rows, by a scatter-add into the table's shape: an embedding's gradient."""
    return rows.new_zeros(tuple(shape)).index_add_(0, ids.long(), rows)


def layer_gradient(layer: CapturedLayer, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) gradients, sum units, from one layer's factor entries in ``tensors``
    (keys ``"<layer>:A"``, ``":D"``, ``":ids"``, ``":rows"``); None where nothing is there.
    Factors narrower than the weight (captured under autocast: bf16, fp16) are widened to its
    dtype first (``precision.py``); wider ones (float64, as every replica decodes:
    ``canonical.py``) are never narrowed, so the products are exact in float64."""
    A, D, ids, rows = (
        tensors.get(tensor_key(layer.module, role)) for role in ("A", "D", IDS_ROLE, ROWS_ROLE)
    )
    A, D, rows = (
        t.to(torch.promote_types(t.dtype, layer.weight_dtype)) if t is not None and t.is_floating_point() else t for t in (A, D, rows)
    )
    weight = bias = None
    if A is not None and D is not None:
        weight = weight_from_factors(A, D, layer.weight_shape)
        bias = bias_from_deltas(D) if layer.bias else None
    if ids is not None and rows is not None:
        lookups = weight_from_lookups(ids, rows, layer.weight_shape)
        weight = lookups if weight is None else weight + lookups
    return weight, bias


def bias_from_deltas(D: torch.Tensor) -> torch.Tensor:
    """Σ_rows D per group, groups concatenated: the bias gradient."""
    return D.sum(dim=1).reshape(-1)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


FACTOR_ROLES = ("A", "D", IDS_ROLE, ROWS_ROLE)
LOW_RANK_ROLES = ("P", "Q")


def decode_message(layout: Layout, message: Payload) -> dict[str, torch.Tensor]:
    """The update carried by one message: dense means, activation factors, low-rank factors.

    Factors arrive in sum units and are divided by N = ``message.num_samples`` here;
    dense entries already are means.
    """
    return dict(decode_entries(layout, message))


def decode_entries(layout: Layout, message: Payload) -> Iterator[tuple[str, torch.Tensor]]:
    """``decode_message``'s entries one at a time, in its order: a caller that applies each
    as it comes never holds the whole update (float64 and model-sized at a replica)."""
    for key, tensor in message.tensors.items():
        name, role = split_key(key)
        if role == GRAD_ROLE:
            yield name, tensor
        elif role == BUFFER_ROLE:
            yield key, tensor
    total = message.num_samples
    for layer in layout.layers:
        p_key = tensor_key(layer.module, "P")
        weight, bias = layer_gradient(layer, message.tensors)
        if weight is not None:
            yield layer.weight, weight / total
            if bias is not None:
                yield layer.bias, bias / total
        elif p_key in message.tensors:
            P, Q = message.tensors[p_key], message.tensors[tensor_key(layer.module, "Q")]
            if layer.bias and Q.shape[1] == layer.in_per_group + 1:  # the bias folded in as Q's last row
                X = torch.bmm(P, Q.transpose(1, 2)).div_(total)
                yield layer.weight, X[..., :-1].reshape(layer.weight_shape)
                yield layer.bias, X[..., -1].reshape(-1)
            else:
                yield layer.weight, torch.bmm(P, Q.transpose(1, 2)).reshape(layer.weight_shape).div_(total)
