"""``dadfl.strategies.layout`` — which parameters travel as factors and which travel dense, found and verified once per model.

A *captured layer* is a weight whose every gradient-carrying use is a linear, conv or
embedding call (``capture.py`` follows the calls, wherever they happen): its gradient is
Σ Δᵀ A over the rows of every linear/conv call plus onehot(ids)ᵀ Δ over every lookup.
A probe step (``probe.probe_layout``) checks each one against autograd; a weight that does not
match (used outside those calls, mixed dtypes outside autocast), and every other trainable parameter —
norm layers, raw ``nn.Parameter``s — is *uncovered* and travels dense, as do floating
buffers.

The layout also records which captured layers read the model's **raw input** (patient
data; for an embedding, the token ids are the raw input): their activations never leave
a site unless the configuration allows it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CapturedLayer:
    """One captured weight: its gradient per group g is D[g]ᵀ A[g] (m × k) plus, for
    lookups, onehot(ids)ᵀ rows (m = table size, k = embedding width)."""

    module: str  # the name its payload tensors carry: the weight's name without ".weight"
    weight: str
    bias: str | None  # read off Σ D when every linear/conv call adds this bias; else dense
    groups: int
    in_per_group: int  # k: input features per group (× kernel positions for convs)
    out_per_group: int  # m: output channels per group
    weight_shape: tuple[int, ...]
    raw_input: bool
    forms: tuple[str, ...] = ("linear",)  # the call kinds verified: linear, conv1d, conv2d, embedding
    # Other functions that read the weight on the probe without changing its gradient (their
    # results do not reach the output); a step where something else reads it sends it dense.
    uses: tuple[str, ...] = ()
    # Counted on the probe's example, per sample (None: no such call, or not a whole number
    # per sample): the rows of its linear/conv calls and the ids of its lookups, which bound
    # what a site may send for it (ROWS and LOOKUPS in checks.py).
    rows_per_sample: int | None = None
    lookups_per_sample: int | None = None
    weight_dtype: torch.dtype = torch.float32
    # The dtype its linear/conv calls compute in, and their A and Δ travel in: the weight's
    # own, or autocast's (``precision.py``); lookups compute in the weight's dtype.
    compute_dtype: torch.dtype = torch.float32

    @property
    def in_features(self) -> int:
        return self.groups * self.in_per_group

    @property
    def out_features(self) -> int:
        return self.groups * self.out_per_group

    @property
    def weight_numel(self) -> int:
        return self.groups * self.in_per_group * self.out_per_group

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters its payload covers: the weight, and the bias when read off the deltas."""
        return (self.weight, self.bias) if self.bias else (self.weight,)


@dataclass(frozen=True)
class Layout:
    layers: tuple[CapturedLayer, ...]
    params: tuple[str, ...]  # every trainable parameter, canonical names, model order
    shapes: tuple[tuple[int, ...], ...]
    buffers: tuple[str, ...]
    # Weights the probe found called but could not verify, with why (logged once); not
    # part of the fingerprint, which covers what travels.
    dense_reasons: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.params.index(name)]

    @property
    def uncovered(self) -> tuple[str, ...]:
        covered = {layer.weight for layer in self.layers} | {layer.bias for layer in self.layers if layer.bias}
        return tuple(name for name in self.params if name not in covered)

    def fingerprint(self) -> str:
        """Short hash; site and server must agree on it before exchanging payloads."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def lines(self) -> tuple[str, ...]:
        """The layout as lines, one per parameter (with its shape), buffer and captured layer: a site
        whose fingerprint differs from the server's names the lines the server's lacks."""
        return (
            tuple(f"parameter {name} of shape {tuple(shape)}" for name, shape in zip(self.params, self.shapes))
            + tuple(f"buffer {name}" for name in self.buffers)
            + tuple(f"captured layer {layer!r}" for layer in self.layers)
        )

