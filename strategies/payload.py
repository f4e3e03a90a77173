"""``dadfl.strategies.payload`` — what travels: the payload of one phase, a site's local result, a captured layer's factors.

Every tensor a party sends sits in a :class:`Payload` under the key
``"<parameter or layer name>:<role>"`` (:func:`tensor_key`; roles such as ``grad``,
``buffer``, ``A``, ``D``, ``ids``, ``rows``, ``P``, ``Q``). Gradients and factors are in
"sum" units: a site backpropagates the sum of its per-sample losses and the server divides
by N = Σ n_s (``base.py``). These containers depend on nothing else in the package, so
capture, checks and every strategy build on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROLE_SEPARATOR = ":"
BUFFER_ROLE = "buffer"
GRAD_ROLE = "grad"
IDS_ROLE = "ids"  # an embedding's looked-up ids (int32, or int64 for a table beyond 2³¹ rows)
ROWS_ROLE = "rows"  # the Δ rows of those lookups


def tensor_key(name: str, role: str) -> str:
    """Payload key of one tensor: ``"<parameter or layer name>:<role>"``."""
    return f"{name}{ROLE_SEPARATOR}{role}"


def split_key(key: str) -> tuple[str, str]:
    name, _, role = key.rpartition(ROLE_SEPARATOR)
    return name, role


@dataclass
class Payload:
    """What one party sends in one phase of one step.

    ``tensors`` maps ``"<name>:<role>"`` to a tensor (roles: ``grad``, ``A``, ``D``,
    ``P``, ``Q``, ``buffer`` ...). ``num_samples`` is n_s on the way up and N on the way
    down. Sizes are exact: what the tensors occupy, nothing estimated.
    """

    step: int
    phase: int
    num_samples: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def nbytes_by_layer(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for key, tensor in self.tensors.items():
            name, _ = split_key(key)
            sizes[name] = sizes.get(name, 0) + tensor.numel() * tensor.element_size()
        return sizes

    def to(self, device: torch.device | str) -> "Payload":
        return Payload(
            self.step, self.phase, self.num_samples, {k: v.to(device) for k, v in self.tensors.items()}
        )


@dataclass
class LocalResult:
    """One site's forward/backward: summed-loss gradients, captured factors, buffers."""

    num_samples: int
    loss_sum: float
    grads: dict[str, torch.Tensor]
    factors: dict[str, "Factors"]
    buffers: dict[str, torch.Tensor]


@dataclass
class Factors:
    """One captured layer's rows: ``A`` (G, n, k) inputs and ``D`` (G, n, m) output deltas of
    its linear/conv calls, and ``ids`` (n',) with ``rows`` (n', k) of its lookups.

    G is the number of groups (1 for Linear); the weight gradient of group g is
    ``D[g].T @ A[g]`` (m × k), reshaped to the weight's shape, plus ``rows`` added at the
    table rows ``ids`` (``weight_from_lookups``). Either part may be None.
    """

    A: torch.Tensor | None = None
    D: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        """The payload entries of these factors under layer name ``key``."""
        parts = {"A": self.A, "D": self.D, IDS_ROLE: self.ids, ROWS_ROLE: self.rows}
        return {tensor_key(key, role): t for role, t in parts.items() if t is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.A, self.D, self.ids, self.rows) if t is not None)
