"""Checks on every upload before the strategy's server half sees it.

An upload must answer the step, attempt and phase the server is running, be computed
from the server's current weights (the model version, by fingerprint), and carry only
tensors the model's layout knows, with the right dtype and shapes and finite values.
Each failure is a :class:`PayloadError` whose text names the site, the tensor and what
was wrong; the coordinator drops that site from the step and keeps running.
"""

from __future__ import annotations

import torch

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import Assembled
from dadfl.strategies.base import BUFFER_ROLE, GRAD_ROLE, split_key
from dadfl.strategies.layout import Layout

FACTOR_ROLES = ("A", "D")
LOW_RANK_ROLES = ("P", "Q")


class PayloadError(ValueError):
    """An upload the coordinator refuses; the message says what was wrong."""


class UploadCheck:
    """What an upload must look like for one model layout."""

    def __init__(self, layout: Layout, model: torch.nn.Module):
        self.layout = layout
        self.params = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
        self.buffers = {name: (tuple(b.shape), b.dtype) for name, b in model.named_buffers()}
        self.layers = {layer.module: layer for layer in layout.layers}

    def check(self, upload: Assembled, step: int, attempt: int, phase: int, fingerprint: str, max_samples: int) -> None:
        header, payload = upload.header, upload.payload
        if header.kind != pb.PHASE:
            raise PayloadError("expected a phase payload, got a state payload")
        if (header.step, header.attempt) != (step, attempt):
            raise PayloadError(f"payload for step {header.step} (attempt {header.attempt}) while the server runs step {step} (attempt {attempt})")
        if header.phase != phase:
            raise PayloadError(f"payload for phase {header.phase} while the server waits for phase {phase}")
        if header.base_fingerprint != fingerprint:
            raise PayloadError(
                f"payload computed from model version {header.base_fingerprint[:12] or '(none)'} but the current "
                f"model is {fingerprint[:12]}: the site's weights are stale"
            )
        if not 1 <= payload.num_samples <= max_samples:
            raise PayloadError(f"num_samples={payload.num_samples} is outside 1..{max_samples} (the configured batch size)")
        if not payload.tensors:
            raise PayloadError("payload has no tensors")
        for key, tensor in payload.tensors.items():
            self._check_tensor(key, tensor)
        for name, layer in self.layers.items():
            a, d = payload.tensors.get(f"{name}:A"), payload.tensors.get(f"{name}:D")
            if d is not None and a is None:
                raise PayloadError(f"layer {name!r}: deltas without activations")
            # edAD sends hidden layers' activations alone: their deltas are recomputed
            if a is not None and d is not None and a.shape[1] != d.shape[1]:
                raise PayloadError(f"layer {name!r}: {a.shape[1]} activation rows but {d.shape[1]} delta rows")

    def _parameter_factor(self, where: str, name: str, role: str, tensor: torch.Tensor) -> tuple:
        """PowerSGD's factors of a parameter viewed as (n, m): P is (n, r), Q is (m, r)."""
        shape, dtype = self.params[name]
        n = shape[0]
        m = 1
        for size in shape[1:]:
            m *= size
        rows = n if role == "P" else m
        if tensor.dim() != 2 or tensor.shape[0] != rows or not 1 <= tensor.shape[1] <= min(n, m):
            raise PayloadError(f"{where}: shape {tuple(tensor.shape)}, expected ({rows}, rank) with rank <= {min(n, m)}")
        return tuple(tensor.shape), dtype

    def _check_tensor(self, key: str, tensor: torch.Tensor) -> None:
        name, role = split_key(key)
        where = f"tensor {key!r}"
        if role == GRAD_ROLE:
            if name not in self.params:
                raise PayloadError(f"{where}: the model has no parameter {name!r}")
            expected = self.params[name]
        elif role == BUFFER_ROLE:
            if name not in self.buffers:
                raise PayloadError(f"{where}: the model has no buffer {name!r}")
            expected = self.buffers[name]
        elif role in LOW_RANK_ROLES and name in self.params:
            expected = self._parameter_factor(where, name, role, tensor)
        elif role in FACTOR_ROLES or role in LOW_RANK_ROLES:
            if name not in self.layers:
                raise PayloadError(f"{where}: the model has no captured layer {name!r}")
            layer = self.layers[name]
            width = {"A": layer.in_per_group, "D": layer.out_per_group, "P": layer.out_per_group, "Q": layer.in_per_group}[role]
            dtype = self.params[layer.weight][1]
            if tensor.dim() != 3 or tensor.shape[0] != layer.groups:
                raise PayloadError(f"{where}: shape {tuple(tensor.shape)}, expected ({layer.groups}, rows, ...)")
            # A and D are (groups, rows, width); P and Q are (groups, width, rank).
            axis = 2 if role in FACTOR_ROLES else 1
            if tensor.shape[axis] != width:
                raise PayloadError(f"{where}: shape {tuple(tensor.shape)}, expected {width} along dimension {axis}")
            expected = (tuple(tensor.shape), dtype)
        else:
            raise PayloadError(f"{where}: unknown role {role!r}")
        shape, dtype = expected
        if tuple(tensor.shape) != shape:
            raise PayloadError(f"{where}: shape {tuple(tensor.shape)}, expected {shape}")
        if tensor.dtype != dtype:
            raise PayloadError(f"{where}: dtype {tensor.dtype}, expected {dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise PayloadError(f"{where}: contains NaN or Inf")
