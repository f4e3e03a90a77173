"""Which parameters travel as factors and which travel dense, found once per model.

A ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d`` whose weight belongs to it alone is a
*captured layer*: its weight gradient is Σ_rows Δᵀ A over the rows of every call. Every
other trainable parameter — norm layers, embeddings, raw ``nn.Parameter``s, weights
tied to another module — is *uncovered* and travels dense, as do floating buffers.

The layout also records which captured layers read the model's **raw input** (patient
data): their activations never leave a site unless the configuration allows it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

CAPTURED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


@dataclass(frozen=True)
class CapturedLayer:
    """One captured module: its weight gradient per group g is D[g]ᵀ A[g] (m × k)."""

    module: str
    weight: str
    bias: str | None
    groups: int
    in_per_group: int  # k: input features per group (× kernel positions for convs)
    out_per_group: int  # m: output channels per group
    weight_shape: tuple[int, ...]
    raw_input: bool

    @property
    def in_features(self) -> int:
        return self.groups * self.in_per_group

    @property
    def out_features(self) -> int:
        return self.groups * self.out_per_group

    @property
    def weight_numel(self) -> int:
        return self.groups * self.in_per_group * self.out_per_group


@dataclass(frozen=True)
class Layout:
    layers: tuple[CapturedLayer, ...]
    params: tuple[str, ...]  # every trainable parameter, canonical names, model order
    shapes: tuple[tuple[int, ...], ...]
    buffers: tuple[str, ...]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.params.index(name)]

    @property
    def uncovered(self) -> tuple[str, ...]:
        covered = {layer.weight for layer in self.layers} | {layer.bias for layer in self.layers if layer.bias}
        return tuple(name for name in self.params if name not in covered)

    def fingerprint(self) -> str:
        """Short hash; site and server must agree on it before exchanging payloads."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    @classmethod
    def from_model(cls, model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor]) -> "Layout":
        """Inspect ``model`` with one forward pass on ``example_inputs`` (values unused)."""
        owners: dict[int, list[str]] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), []).append(module_name)
        canonical = {id(p): name for name, p in model.named_parameters() if p.requires_grad}

        raw_storages = {t.untyped_storage().data_ptr() for t in _as_tuple(example_inputs) if torch.is_tensor(t)}
        called: dict[str, bool] = {}  # module name -> reads raw input in some call

        def make_hook(name: str):
            def hook(module, inputs, output):
                x = inputs[0]
                raw = torch.is_tensor(x) and x.untyped_storage().data_ptr() in raw_storages
                called[name] = called.get(name, False) or raw

            return hook

        candidates = {
            name: m
            for name, m in model.named_modules()
            if type(m) in CAPTURED_TYPES
            and id(m.weight) in canonical
            and len(owners[id(m.weight)]) == 1
            and (m.bias is None or len(owners[id(m.bias)]) == 1)
        }
        handles = [m.register_forward_hook(make_hook(name)) for name, m in candidates.items()]
        was_training = model.training
        model.eval()  # no running-statistics update from this inspection pass
        try:
            with torch.no_grad():
                model(*_as_tuple(example_inputs))
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)

        layers = []
        for name, m in candidates.items():
            if name not in called:
                continue  # never called: its (zero) gradient travels dense
            groups = getattr(m, "groups", 1)
            kernel = int(torch.tensor(m.weight.shape[2:]).prod()) if m.weight.dim() > 2 else 1
            layers.append(
                CapturedLayer(
                    module=name,
                    weight=canonical[id(m.weight)],
                    bias=canonical.get(id(m.bias)) if m.bias is not None else None,
                    groups=groups,
                    in_per_group=m.weight.shape[1] * kernel,
                    out_per_group=m.weight.shape[0] // groups,
                    weight_shape=tuple(m.weight.shape),
                    raw_input=called[name],
                )
            )
        params = tuple(canonical[id(p)] for _, p in model.named_parameters() if p.requires_grad)
        shapes = tuple(tuple(p.shape) for _, p in model.named_parameters() if p.requires_grad)
        buffers = tuple(name for name, _ in model.named_buffers())
        return cls(tuple(layers), params, shapes, buffers)


def _as_tuple(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
