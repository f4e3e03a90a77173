"""Factor capture: the inputs A and output deltas Δ of every call of every captured layer.

For y = x Wᵀ + b the summed loss has ∂L/∂W = Δᵀ A, with A the rows of x and Δ the rows of
∂L/∂y. Leading dimensions (batch × time) flatten to rows. A convolution is the same
map applied to unfolded patches: A has one row per (sample, output position) and, for
``groups=G``, splits into G independent blocks (G, n, k). A module called T times in
one forward (recurrent cells, reuse) contributes the rows of all T calls.

Capture uses a forward hook on the module (to read its input) and a tensor hook on the
call's output (to read ∂L/∂y) — no module backward hooks, so in-place ops and reuse
are safe.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Factors, LocalResult
from .layout import CapturedLayer, Layout


def unfold_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Rows of A for one call, shape (n, G·k) with group g in columns [g·k, (g+1)·k)."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1])
    pad_mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=pad_mode)
    if isinstance(module, nn.Conv1d):
        patches = F.unfold(
            x.unsqueeze(2),
            kernel_size=(1, module.kernel_size[0]),
            dilation=(1, module.dilation[0]),
            stride=(1, module.stride[0]),
        )
    else:
        patches = F.unfold(x, kernel_size=module.kernel_size, dilation=module.dilation, stride=module.stride)
    # (B, C·kh·kw, L) -> (B·L, C·kh·kw): one row per sample and output position.
    return patches.transpose(1, 2).reshape(-1, patches.shape[1])


def output_rows(grad: torch.Tensor, linear: bool) -> torch.Tensor:
    """Rows of Δ for one call, shape (n, out)."""
    if linear:
        return grad.reshape(-1, grad.shape[-1])
    return grad.flatten(2).transpose(1, 2).reshape(-1, grad.shape[1])


def by_group(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """(n, G·k) -> (G, n, k)."""
    return rows.reshape(rows.shape[0], groups, -1).transpose(0, 1).contiguous()


class FactorCapture:
    """Context manager recording A and Δ of every call of the layout's layers."""

    def __init__(self, model: nn.Module, layout: Layout):
        modules = dict(model.named_modules())
        self._layers = [(layer, modules[layer.module]) for layer in layout.layers]
        self._inputs: dict[str, list[torch.Tensor]] = {}
        self._deltas: dict[str, dict[int, torch.Tensor]] = {}
        self._handles: list = []

    def __enter__(self) -> "FactorCapture":
        for layer, module in self._layers:
            self._inputs[layer.module] = []
            self._deltas[layer.module] = {}
            self._handles.append(module.register_forward_hook(self._forward_hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, layer: CapturedLayer) -> Callable:
        inputs, deltas = self._inputs[layer.module], self._deltas[layer.module]

        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            call = len(inputs)
            inputs.append(unfold_input(module, args[0].detach()))
            linear = isinstance(module, nn.Linear)

            def record(grad: torch.Tensor) -> None:
                deltas[call] = output_rows(grad.detach(), linear)

            output.register_hook(record)

        return hook

    def factors(self) -> dict[str, Factors]:
        """Rows of all calls per layer (calls in forward order); missing deltas are zero."""
        result = {}
        for layer, _ in self._layers:
            calls = self._inputs[layer.module]
            if not calls:
                continue
            deltas = self._deltas[layer.module]
            D = [
                deltas.get(i, calls[i].new_zeros(calls[i].shape[0], layer.out_features))
                for i in range(len(calls))
            ]
            result[layer.module] = Factors(
                A=by_group(torch.cat(calls), layer.groups), D=by_group(torch.cat(D), layer.groups)
            )
        return result


def per_sample_losses(losses: torch.Tensor) -> torch.Tensor:
    """Reduce a loss with leading batch dimension to one value per sample."""
    return losses.reshape(losses.shape[0], -1).mean(dim=1) if losses.dim() > 1 else losses


def local_step(
    model: nn.Module,
    layout: Layout,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor,
    capture: bool = True,
) -> LocalResult:
    """Forward and backward of the **summed** per-sample loss on one site's batch."""
    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    recorder = FactorCapture(model, layout if capture else Layout((), (), (), ()))
    with recorder:
        outputs = model(*args)
        losses = per_sample_losses(loss_fn(outputs, targets))
        if losses.shape[0] != targets.shape[0]:
            raise ValueError(
                f"loss returned {losses.shape[0]} values for a batch of {targets.shape[0]} samples; "
                "the workload loss must return one loss per sample (reduction='none')"
            )
        total = losses.sum()
        total.backward()
    grads = {
        name: params[name].grad.detach() if params[name].grad is not None else torch.zeros_like(params[name])
        for name in layout.params
    }
    buffers = dict(model.named_buffers())
    return LocalResult(
        num_samples=int(targets.shape[0]),
        loss_sum=float(total.detach()),
        grads=grads,
        factors=recorder.factors(),
        buffers={name: buffers[name].detach().clone() for name in layout.buffers},
    )
