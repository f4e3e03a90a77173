"""``dadfl.strategies.powersgd`` — powerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), as PyTorch's ``powerSGD_hook`` does it.

Each trainable tensor with more than one dimension is viewed as a matrix
M (n × m) = grad.reshape(shape[0], -1) and compressed if it pays,
r·(n + m)·min_compression_rate < n·m with r = min(rank, n, m); 1-D tensors (biases,
norms), tensors that do not pay, and buffers travel dense. One step, two phases:

    phase 0  site s:   M_s = (summed-loss gradient)/n_s + e_s     (error feedback)
                       P_s = M_s Q                                 (n × r)  up
             server:   P̂ = orth(Σ_s (n_s/N) P_s)                  (n × r)  down
    phase 1  site s:   Q_s = M_sᵀ P̂                               (m × r)  up
                       with every dense tensor (gradient, buffer)
             server:   Q = Σ_s (n_s/N) Q_s, and the dense means    (m × r)  down
    every replica:     update = P̂ Qᵀ   (``decode``, one shared function)
    site s:            e_s ← M_s − P̂ Q_sᵀ (``memory="site"``, the default: M_s minus what
                       its own upload carried) or e_s ← M_s − P̂ Qᵀ (``memory="global"``,
                       the hook's: M_s minus the aggregated approximation)

Q starts identical on every site: from ``seed`` exactly as the hook does it (a
``numpy.random.RandomState(seed)`` draws a torch seed, then one ``randn`` per
compressed matrix), then orthogonalised. With ``warm_start`` the next step starts from
the aggregated Q (identical everywhere), re-orthogonalised; without it every step
draws a fresh Q. Orthogonalisation is the hook's: Gram–Schmidt for r ≤ 2 (``epsilon``
added to each column norm), Householder QR otherwise; a column that is exactly zero
stays zero instead of becoming NaN.

A parameter that no site's batch gives a gradient (and no site's memory holds anything
of) travels in neither phase and gets no update, as under autograd: the optimizer's
momentum and weight decay leave it alone. A site without a gradient for a matrix another
site sends counts it as zero.

Steps with ``step < start_iter`` (the ``step`` given to ``begin``; a rebuilt half
keeps following the coordinator's step numbers) send every gradient dense in one
phase, like the hook's ``start_powerSGD_iter`` — the error memory starts at zero on
the first compressed step.

Alignment with ``powerSGD_hook`` (``batch_tensors_with_same_shape=False``): the hook
compresses per DDP bucket and draws the random Q in bucket order, tensors grouped by
matrix shape (first-appearance order of each shape). Here the whole model is one
bucket in reverse parameter order — DDP's order for a model whose gradients become
ready in reverse (any feed-forward model) and that fits in one bucket (≤ 1 MiB);
within it, the same grouping by shape. With equal site batch sizes the two then
agree to fp32 rounding (``tests/strategies/test_powersgd.py`` runs the hook). Two deliberate
differences: sites are weighted n_s/N (the hook averages ranks; equal for equal
batches), and dense tensors carry no error memory — in the hook their error
e_s = M_s − mean(M) sums to zero over sites, so the mean it sends is unchanged.

The two memories. Both leave the sites' mean memory Σ_s (n_s/N) e_s = M̄ − P̂ Qᵀ the
same (Q = Σ_s (n_s/N) Q_s), and every P̂, Q and update depends on the sites' M_s only
through their mean, so the model follows the same trajectory with either (to rounding;
``tests/strategies/test_powersgd.py``). They differ in what each site keeps of its own
deviation d_s = M_s − M̄: with ``"global"`` every site subtracts the same P̂ Qᵀ, so
d_s ← d_s + (g_s − ḡ) is a random walk of the site's gradient noise that never shrinks
(the deviations cancel only in the sum over sites); with ``"site"``,
d_s ← (I − P̂ P̂ᵀ)(d_s + g_s − ḡ): each step removes the deviation along the basis P̂, so
Q_s = M_sᵀ P̂ carries this step's gradient noise and not the sum of the past ones, and
honest sites' Q_s agree as dSGD's gradients do. That is what lets the coordinator's
robust rule weigh sites by agreement in phase 1, on Q_s and the dense tensors that travel
with it (``uploads_agree``; docs/robustness.md). A site's P_s still carries d_s outside
the basis, so it is never weighed by agreement; P̂ = orth(Σ P_s) is orthonormalised, so the
coordinator clips every P_s to the others' median norm at no cost to the step's size
(``chooses_basis``), and a basis alone cannot turn the update against the honest sites
(P̂ P̂ᵀ M̄ never points against M̄). Costs of ``"site"``: a site's memory does not keep
what the coordinator's robust rule removed from its Q_s (a clipped or zeroed site's part is
dropped, where ``"global"`` would carry it to later steps), nor, with ``factor_bits``, the
rounding of the aggregated Q on its way down (the rounding of its own Q_s it keeps). Use
``"global"`` to keep the hook's memory exactly (its rounding over many steps, every last
rounding carried); the coordinator then clips PowerSGD only, as it did before the site
memory. The option is the coordinator's published strategy config, checked here.

Integer factors (``factor_bits`` 8 or 16, error feedback only): every P and Q, up and
down, travels as integer codes with one float scale per column (``quantize.py``), a
quarter of the bytes at 8 bits; dense tensors stay float. The memory needs no change:
it subtracts P̂ and Q_s (``"site"``) or Q (``"global"``) as the receivers decode them, so
what the rounding changes in the update stays in the memories (with ``"site"``, all but
the downlink rounding of Q: above).

Cost per compressed matrix (floats, r = min(rank, n, m)), two round trips per step:
    up   = r·(n + m)   per site (r·n in phase 0, r·m in phase 1)
    down = r·(n + m)   (P̂, then Q)
Dense tensors: numel both ways, in phase 1 (with Q_s, so that the coordinator weighs them
with it: ``uploads_agree``). Warm-up steps: dSGD's cost, one phase.

Raw input (``raw_input``, the policy rank-dAD follows, ``base.low_rank_allowed``): with
"low_rank" (the default) or "activations" every matrix is compressed as above; with
"dense" the weights of layers that read the model's raw input, and every parameter the
layout cannot place (uncovered), travel dense instead.

Reveals: to the server, each site's projections M_s Q and M_sᵀ P̂ of its gradient
(plus error memory): a rank-r view of its gradient and everything dense (biases)
exactly. Sites see P̂ and the aggregated Q, i.e. the rank-r mean update. Not exact
for r < rank(M): the error memory carries what was left out into later steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .base import (
    BUFFER_ROLE,
    DEFAULT_RAW_INPUT,
    GRAD_ROLE,
    LocalResult,
    Payload,
    StateDict,
    Stateless,
    Strategy,
    check_raw_input,
    check_state_keys,
    dense_aggregate,
    dense_upload,
    low_rank_allowed,
    split_key,
    sum_in_order,
    tensor_key,
    tensors_under,
    with_prefix,
)
from .checks import Form, Spec, Unit
from .gram import Dense
from .layout import Layout
from .power_iteration import thin_product
from .quantize import FULL_PRECISION, check_factor_bits, factor_entries, quantized_specs, unpack

MEMORIES = ("site", "global")  # the error memory's forms (module text)
SEED_RANGE = 1_000_000_000  # the hook draws torch seeds with RandomState.randint(1_000_000_000)


@dataclass(frozen=True)
class Matrix:
    """One compressed parameter viewed as an n × m matrix, approximated at rank r."""

    name: str
    shape: tuple[int, ...]
    n: int
    m: int
    r: int

    @property
    def p_key(self) -> str:
        return tensor_key(self.name, "P")

    @property
    def q_key(self) -> str:
        return tensor_key(self.name, "Q")


@dataclass(frozen=True)
class Plan:
    """Which parameters are compressed (in Q-initialisation order) and which go dense."""

    matrices: tuple[Matrix, ...]
    dense: tuple[str, ...]  # model order


def plan(layout: Layout, rank: int, min_compression_rate: float, raw_input: str = DEFAULT_RAW_INPUT) -> Plan:
    """The hook's choice per tensor, and its order for drawing the random Q; a tensor the
    raw-input policy keeps dense (``low_rank_allowed``, as rank-dAD) is never compressed."""
    allowed = low_rank_allowed(layout, raw_input)
    matrices, dense = [], []
    for name, shape in zip(layout.params, layout.shapes):
        if len(shape) > 1 and name in allowed:
            n = shape[0]
            m = int(np.prod(shape[1:]))
            r = min(rank, n, m)
            if r * (n + m) * min_compression_rate < n * m:
                matrices.append(Matrix(name, tuple(shape), n, m, r))
                continue
        dense.append(name)
    # One DDP bucket: reverse parameter order, grouped by matrix shape (first appearance).
    by_shape: dict[tuple[int, int], list[Matrix]] = {}
    for matrix in reversed(matrices):
        by_shape.setdefault((matrix.n, matrix.m), []).append(matrix)
    ordered = tuple(matrix for group in by_shape.values() for matrix in group)
    return Plan(ordered, tuple(dense))


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormal columns, as the hook computes them: Gram–Schmidt for ≤ 2 columns or
    half precision (``epsilon`` added to each norm), Householder QR otherwise.

    Works on (n, r) or batched (B, n, r) with r ≤ n; returns a new tensor.
    """
    out = matrix.clone()
    batched = out if out.dim() == 3 else out.unsqueeze(0)
    columns = batched.shape[2]
    if columns <= 2 or out.dtype in (torch.float16, torch.bfloat16):
        for i in range(columns):
            col = batched[:, :, i : i + 1]
            norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
            if epsilon == 0:
                # The hook divides by zero here (NaN); an all-zero column stays zero.
                norm = torch.where(norm == 0, torch.ones_like(norm), norm)
                col /= norm
            else:
                col /= norm + epsilon
            if i + 1 < columns:
                rest = batched[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
        return out
    return torch.linalg.qr(matrix).Q


def low_rank_update(p_hat: torch.Tensor, q: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """P̂ Qᵀ in the parameter's shape: the one function every replica decodes with."""
    return (p_hat @ q.transpose(-2, -1)).reshape(tuple(shape))


def decode_powersgd(plan_: Plan, messages: Sequence[Payload]) -> dict[str, torch.Tensor]:
    """The update of one step: the dense means (warm-up: phase 0; compressed: phase 1), P̂
    (phase 0) times Qᵀ (phase 1)."""
    update: dict[str, torch.Tensor] = {}
    for key, tensor in messages[-1].tensors.items():
        name, role = split_key(key)
        if role == GRAD_ROLE:
            update[name] = tensor
        elif role == BUFFER_ROLE:
            update[key] = tensor
    if len(messages) > 1:
        for matrix in plan_.matrices:  # a matrix no site sent gets no update
            if matrix.p_key in messages[0].tensors and matrix.q_key in messages[1].tensors:
                update[matrix.name] = low_rank_update(
                    messages[0].tensors[matrix.p_key], messages[1].tensors[matrix.q_key], matrix.shape
                )
    return update


class _QSource:
    """The hook's random Q: a RandomState(seed) draws one torch seed per initialisation."""

    def __init__(self, seed: int):
        self.rng = np.random.RandomState(seed)

    def draw(self, plan_: Plan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(int(self.rng.randint(SEED_RANGE)))
        return {
            matrix.name: torch.randn((matrix.m, matrix.r), generator=generator, dtype=dtype)
            for matrix in plan_.matrices
        }

    def state_dict(self) -> StateDict:
        """The RandomState's Mersenne Twister state as tensors (key words, position, Gaussian cache)."""
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        assert kind == "MT19937"  # the only bit generator RandomState has
        return {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": torch.tensor(pos, dtype=torch.int64),
            "has_gauss": torch.tensor(has_gauss, dtype=torch.int64),
            "cached_gaussian": torch.tensor(cached, dtype=torch.float64),
        }

    def load_state_dict(self, state: StateDict) -> None:
        keys = state["keys"]
        if keys.shape != (624,) or keys.dtype != torch.int64:
            raise ValueError(f"powersgd: Q random state has keys of shape {tuple(keys.shape)}, expected (624,) int64")
        self.rng.set_state(
            ("MT19937", keys.cpu().numpy().astype(np.uint32), int(state["pos"]), int(state["has_gauss"]), float(state["cached_gaussian"]))
        )


class PowerSGDSite:
    """Site half: M_s Q up, P̂ down; M_sᵀ P̂ up, Q down; error memory and warm start."""

    def __init__(self, layout: Layout, strategy: "PowerSGD"):
        self.layout = layout
        self.options = strategy
        self.plan = plan(layout, strategy.rank, strategy.min_compression_rate, strategy.raw_input)
        self.q_source = _QSource(strategy.seed)
        self.errors: dict[str, torch.Tensor] = {}
        self.q_memory: dict[str, torch.Tensor] = {}
        self.M: dict[str, torch.Tensor] = {}
        self.q_sent: dict[str, torch.Tensor] = {}  # Q_s as the coordinator decodes it (memory "site")
        self.dense: dict[str, torch.Tensor] = {}  # this step's dense uploads, sent in phase 1
        self.p_hat: dict[str, torch.Tensor] = {}
        self.num_samples = 0
        self.step = -1

    def begin(self, local: LocalResult, step: int) -> Payload:
        self.step, self.num_samples = step, local.num_samples
        if not self.options.compresses(step):
            tensors = dense_upload(local, self.layout.params, self.layout.buffers)
            return Payload(step, 0, local.num_samples, tensors)
        self.dense = dense_upload(local, self.plan.dense, self.layout.buffers)  # sent with Q_s
        tensors = {}
        qs = self._start_q(local)
        self.M = {}
        reference = next(iter(local.grads.values()), None)
        for matrix in self.plan.matrices:
            # A matrix no row of this batch reached counts as a zero gradient where another
            # site's P or this site's memory makes it travel; with neither, it sends no P, and
            # a matrix no site sends gets no update (as under autograd: no momentum, no decay).
            grad = local.grads.get(matrix.name)
            memory = self.errors.get(matrix.name) if self.options.use_error_feedback else None
            if grad is None:
                grad = torch.zeros(matrix.shape) if reference is None else reference.new_zeros(matrix.shape)
            M = grad.reshape(matrix.n, matrix.m) / local.num_samples
            self.M[matrix.name] = M if memory is None else M + memory
            if matrix.name in local.grads or memory is not None:
                P = self._product(self.M[matrix.name], qs[matrix.name])
                tensors.update(factor_entries(matrix.p_key, P, self.options.factor_bits))
        return Payload(step, 0, local.num_samples, tensors)

    @staticmethod
    def _product(M: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        """M X in thin_product's operand order (as written, the BLAS packs all of M for r
        columns), returned row-major as the wire delivers it: thin_product may return a
        transposed view, and the server's sums over a view round differently from the same
        sums over a decoded tensor, so in-process and networked replicas would part."""
        return thin_product(M[None], X[None])[0].contiguous()

    def _start_q(self, local: LocalResult) -> dict[str, torch.Tensor]:
        eps = self.options.orthogonalization_epsilon
        warm = self.q_memory if self.options.warm_start else {}
        if warm and all(m.name in warm for m in self.plan.matrices):
            return {name: orthogonalize(q, eps) for name, q in warm.items()}
        reference = next(iter(local.grads.values()), None)
        dtype = reference.dtype if reference is not None else torch.float32
        device = reference.device if reference is not None else torch.device("cpu")
        # Drawn on the CPU (as the hook does) so every device gets the same numbers; a matrix
        # the last update left out has no warm start and takes its fresh draw.
        fresh = self.q_source.draw(self.plan, dtype)
        return {name: orthogonalize(warm[name] if name in warm else q.to(device), eps) for name, q in fresh.items()}

    def receive(self, message: Payload) -> Payload | None:
        if not self.options.compresses(self.step):
            return None
        message = unpack(message)
        if message.phase == 0:
            self.p_hat = {m.name: message.tensors[m.p_key] for m in self.plan.matrices if m.p_key in message.tensors}
            tensors, self.dense = self.dense, {}
            for m in self.plan.matrices:
                if m.name in self.p_hat:
                    Q = self._product(self.M[m.name].transpose(0, 1), self.p_hat[m.name])
                    entries = factor_entries(m.q_key, Q, self.options.factor_bits)
                    if self.options.memory == "site":
                        self.q_sent[m.name] = unpack(Payload(self.step, 1, self.num_samples, entries)).tensors[m.q_key]
                    tensors.update(entries)
            return Payload(self.step, 1, self.num_samples, tensors)
        for matrix in self.plan.matrices:
            if matrix.name not in self.p_hat or matrix.q_key not in message.tensors:
                continue  # no site sent it: no update, nothing to remember
            q = message.tensors[matrix.q_key]
            if self.options.use_error_feedback:
                sent = self.q_sent[matrix.name] if self.options.memory == "site" else q
                approx = low_rank_update(self.p_hat[matrix.name], sent, (matrix.n, matrix.m))
                self.errors[matrix.name] = self.M[matrix.name] - approx
            if self.options.warm_start:
                self.q_memory[matrix.name] = q
        self.M, self.p_hat, self.q_sent = {}, {}, {}
        return None

    def state_dict(self) -> StateDict:
        """Error memory, warm-start Q and the random-Q source, as they stand between steps."""
        return {
            **with_prefix("errors", self.errors),
            **with_prefix("q_memory", self.q_memory),
            **with_prefix("q_rng", self.q_source.state_dict()),
        }

    def load_state_dict(self, state: StateDict) -> None:
        check_state_keys("powersgd site", state, ("errors", "q_memory", "q_rng"))
        names = {matrix.name: matrix for matrix in self.plan.matrices}
        errors, q_memory = tensors_under(state, "errors"), tensors_under(state, "q_memory")
        for kind, tensors, shape_of in (
            ("errors", errors, lambda m: (m.n, m.m)),
            ("q_memory", q_memory, lambda m: (m.m, m.r)),
        ):
            for name, tensor in tensors.items():
                if name not in names or tuple(tensor.shape) != shape_of(names[name]):
                    raise ValueError(
                        f"powersgd site: state {kind}/{name} of shape {tuple(tensor.shape)} does not fit "
                        "this model and rank (saved by another run or configuration?)"
                    )
        self.q_source.load_state_dict(tensors_under(state, "q_rng"))
        self.errors = {name: tensor.clone() for name, tensor in errors.items()}
        self.q_memory = {name: tensor.clone() for name, tensor in q_memory.items()}


class PowerSGDServer(Stateless):
    """Server half: P̂ = orth(Σ (n_s/N) P_s) with the dense means; then Q = Σ (n_s/N) Q_s."""

    def __init__(self, layout: Layout, strategy: "PowerSGD"):
        self.layout = layout
        self.options = strategy
        self.plan = plan(layout, strategy.rank, strategy.min_compression_rate, strategy.raw_input)

    def aggregate(self, payloads: Sequence[Payload]) -> Payload:
        payloads = [unpack(p) for p in payloads]
        first = payloads[0]
        total = sum(p.num_samples for p in payloads)
        if not self.options.compresses(first.step):
            tensors = dense_aggregate(payloads, self.layout.params, self.layout.buffers)
        elif first.phase == 0:
            tensors = {}
            for matrix in self.plan.matrices:
                P = self._weighted_mean(payloads, matrix.p_key, total)
                if P is not None:
                    P = orthogonalize(P, self.options.orthogonalization_epsilon)
                    tensors.update(factor_entries(matrix.p_key, P, self.options.factor_bits))
        else:
            tensors = dense_aggregate(payloads, self.plan.dense, self.layout.buffers)
            for m in self.plan.matrices:
                Q = self._weighted_mean(payloads, m.q_key, total)
                if Q is not None:
                    tensors.update(factor_entries(m.q_key, Q, self.options.factor_bits))
        return Payload(first.step, first.phase, total, tensors)

    @staticmethod
    def _weighted_mean(payloads: Sequence[Payload], key: str, total: int) -> torch.Tensor | None:
        """Σ_s (n_s/N) X_s over the sites that sent ``key`` (a site without it had no
        gradient there: a zero term); None when none did."""
        present = [p.tensors[key] * (p.num_samples / total) for p in payloads if key in p.tensors]
        return sum_in_order(present) if present else None


@dataclass(frozen=True)
class PowerSGD(Strategy):
    """Rank-r PowerSGD with error feedback and warm start; exact only at full rank without EF."""

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0
    factor_bits: int = FULL_PRECISION
    raw_input: str = DEFAULT_RAW_INPUT
    memory: str = "site"  # "site": e_s ← M_s − P̂ Q_sᵀ; "global": e_s ← M_s − P̂ Qᵀ (the hook's); module text
    name = "powersgd"
    needs_factors = False
    phases = 2  # P_s, then Q_s (one on a dense warm-up step)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"powersgd: rank={self.rank} must be at least 1")
        if self.start_iter < 0:
            raise ValueError(f"powersgd: start_iter={self.start_iter} must be >= 0")
        if self.min_compression_rate < 0:
            raise ValueError(f"powersgd: min_compression_rate={self.min_compression_rate} must be >= 0")
        if self.orthogonalization_epsilon < 0:
            raise ValueError(f"powersgd: orthogonalization_epsilon={self.orthogonalization_epsilon} must be >= 0")
        check_factor_bits("powersgd", self.factor_bits, self.use_error_feedback)
        check_raw_input(self.raw_input)
        if self.memory not in MEMORIES:
            raise ValueError(f"powersgd: memory={self.memory!r} must be one of {', '.join(map(repr, MEMORIES))}")

    def compresses(self, step: int) -> bool:
        """Whether ``step`` is compressed (two phases) or a dense warm-up step (one)."""
        return step >= self.start_iter

    def site(self, layout: Layout, model=None) -> PowerSGDSite:
        return PowerSGDSite(layout, self)

    def server(self, layout: Layout, model=None) -> PowerSGDServer:
        return PowerSGDServer(layout, self)

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model=None) -> list | None:
        """Warm-up steps: dSGD's phase 0. Compressed steps: phase 0 P (n × r) per matrix,
        phase 1 Q (m × r) per matrix and the dense tensors, r the plan's rank exactly; a
        matrix the site's batch gave no gradient (and its memory nothing) may be absent."""
        if not self.compresses(step):
            return facts.dense_units(layout.params) + facts.buffer_units(layout.buffers) if phase == 0 else None
        plan_ = plan(layout, self.rank, self.min_compression_rate, self.raw_input)
        if phase == 0:
            units, role, rows = [], "P", lambda m: m.n
        elif phase == 1:
            units = facts.dense_units(plan_.dense) + facts.buffer_units(layout.buffers)
            role, rows = "Q", lambda m: m.m
        else:
            return None
        for matrix in plan_.matrices:
            key = tensor_key(matrix.name, role)
            specs = quantized_specs({key: Spec((rows(matrix), matrix.r), facts.params[matrix.name][1])}, self.factor_bits)
            units.append(Unit(matrix.name, (Form(f"{role} factor", specs),), optional=True))
        return units

    def terms(self, layout: Layout, payload: Payload, messages_so_far, model=None) -> tuple[dict, dict]:
        """Mean units: P_s (phase 0); Q_s and dense gradients / n_s (phase 1; warm-up steps:
        phase 0). P_s = M_s Q and Q_s = M_sᵀ P̂ project on one orthonormal basis shared by
        every site, so inner products of the projected updates are those of P_s (of Q_s): Dense terms."""
        payload = unpack(payload)
        w = 1.0 / payload.num_samples
        update, buffers = {}, {}
        for key, tensor in payload.tensors.items():
            name, role = split_key(key)
            if role == GRAD_ROLE:
                update[name] = [Dense(tensor, w)]
            elif role == BUFFER_ROLE and tensor.is_floating_point():
                buffers[name] = [Dense(tensor, w)]
            elif role in ("P", "Q"):
                update[name] = [Dense(tensor)]
        return update, buffers

    def uploads_agree(self, step: int, phase: int) -> bool:
        """Dense warm-up steps and steps without error feedback: yes (no memory). With error
        feedback, never P_s = M_s Q (phase 0): it carries the site's deviation
        d_s = M_s − M̄, which with either memory accumulates gradient noise outside the basis,
        so honest sites push back on each other's P_s (docs/robustness.md). Phase 1 with
        ``memory="site"``: Q_s = M_sᵀ P̂, which then carries no past noise along P̂ (module
        text), and the dense gradients that travel with it. With ``"global"`` the random walk
        is in Q_s too, and the biases alone disagree too often to be weighed apart (honest
        sites zeroed in a quarter of clean steps): clipped only."""
        if not self.use_error_feedback or not self.compresses(step):
            return True
        return phase == 1 and self.memory == "site"

    def momenta_agree(self, step: int, phase: int) -> bool:
        """Never: P_s and Q_s are coordinates in each step's basis, and a momentum of the dense
        warm-up steps alone would leave the standings on another scale than the steps after."""
        return False

    def chooses_basis(self, step: int, phase: int) -> bool:
        """Phase 0 of a compressed step with the site memory: P̂ = orth(Σ_s (n_s/N) P_s) is
        orthonormalised, so a site's factor there sets its share of the basis, not the step's
        size (the coordinator clips every P_s to the others' median norm, docs/robustness.md).
        Without error feedback or with ``"global"``, P_s is weighed as any phase (its factor
        binds Q_s), as measured there."""
        return phase == 0 and self.compresses(step) and self.use_error_feedback and self.memory == "site"

    # P_s in phase 0, Q_s in phase 1: the update P̂ Qᵀ is linear in each site's Q_s.
    SCALED_ROLES = frozenset({GRAD_ROLE, "P", "P_scale", "Q", "Q_scale"})

    def decode(self, layout: Layout, messages: Sequence[Payload], model=None) -> dict[str, torch.Tensor]:
        return decode_powersgd(plan(layout, self.rank, self.min_compression_rate, self.raw_input), [unpack(m) for m in messages])
