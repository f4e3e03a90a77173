"""``dadfl.strategies.edad`` — edAD: dAD that sends the deltas of the output layer only.

In a feed-forward chain y_{l} = W_l a_l + b_l, a_{l+1} = σ_l(y_l) with elementwise σ_l,
the deltas obey

    Δ_l = (Δ_{l+1} W_{l+1}) ⊙ σ_l'(y_l),

and σ_l'(y_l) can be read off the next layer's input a_{l+1} = σ_l(y_l) for ReLU
(a > 0), LeakyReLU (a > 0 ? 1 : slope), Tanh (1 − a²) and Sigmoid (a(1 − a)) —
exactly the expressions autograd itself uses. Each row depends on its own sample
only, so pooling the sites' rows and recomputing is exact. Sites therefore send the
activations A_l of every factored layer and Δ_L of the output layer; the hidden deltas
are recomputed with the current (identical) weights by whoever needs them: the server
for a dense downlink, every replica for a factor downlink.

Cost per step (floats; layers l = 1..L with k_l inputs and m_l outputs, rows n_s):
    up   = n_s·(Σ_l k_l + m_L)                              per site
    down = Σ_l (k_l·m_l + m_l)   with downlink="dense"
         = N·(Σ_l k_l + m_L)     with downlink="factors"
versus dAD's n_s·Σ_l (k_l + m_l): the hidden deltas are free.

Supported models: ``nn.Sequential`` of ``nn.Linear`` and the elementwise activations
above (an ``nn.Flatten`` may come first), with no forward or backward hook on them (a
hook may change a Linear's output or its delta, which the recomputation cannot see);
anything else gets an error naming the module, and ``dad``/``auto`` serve it instead. Reveals what dAD reveals, minus hidden
deltas; the first layer reads the raw input and travels dense unless
``raw_input="activations"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .base import (
    LocalResult,
    Payload,
    Stateless,
    Strategy,
    check_raw_input,
    decode_message,
    dense_aggregate,
    dense_upload,
    group_rows,
    may_share,
    split_key,
    tensor_key,
)
from .canonical import PASSED_THROUGH
from .checks import Unit, layerwise_terms
from .dad import FactorServer
from .layout import CapturedLayer, Layout

Derivative = Callable[[torch.Tensor], torch.Tensor]


def activation_derivative(module: nn.Module) -> Derivative | None:
    """σ'(y) written in terms of a = σ(y); None if the module is not supported."""
    if isinstance(module, nn.ReLU):
        return lambda a: (a > 0).to(a.dtype)
    if isinstance(module, nn.LeakyReLU) and module.negative_slope > 0:
        slope = module.negative_slope
        return lambda a: torch.where(a > 0, torch.ones_like(a), torch.full_like(a, slope))
    if isinstance(module, nn.Tanh):
        return lambda a: 1 - a * a
    if isinstance(module, nn.Sigmoid):
        return lambda a: a * (1 - a)
    if isinstance(module, nn.Identity):
        return torch.ones_like
    return None


@dataclass(frozen=True)
class ChainLink:
    layer: CapturedLayer
    derivative: Derivative | None  # of the activation after this layer; None for the output layer


def feed_forward_chain(model: nn.Module | None, layout: Layout) -> list[ChainLink]:
    """The model as Linear → activation → … → Linear, or a ValueError saying what is not."""
    hint = "edad supports nn.Sequential of nn.Linear and elementwise activations " \
           "(ReLU, LeakyReLU, Tanh, Sigmoid, Identity); use 'dad' or 'auto' for other models"
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"edad: the model is {type(model).__name__}, not nn.Sequential; {hint}")
    by_module = {layer.module: layer for layer in layout.layers}
    # Every position, repeats included (named_children() would hide a module listed twice):
    # a stateless activation may repeat; a Linear listed twice stacks two calls in one layer.
    children = list(model._modules.items())
    if children and isinstance(children[0][1], nn.Flatten):
        children = children[1:]
    hooked = [name for name, module in children if any(_hooks(module))] + (["(every module)"] if any(_global_hooks()) else [])
    if hooked:
        raise ValueError(
            f"edad: module {hooked[0]!r} has a forward or backward hook, which may change what edad's "
            f"recomputed deltas assume (each Linear's output goes unchanged through its activation into the "
            f"next Linear); remove the hook, or use 'dad' or 'auto', whose probe checks every layer's gradient"
        )
    links: list[ChainLink] = []
    pending: CapturedLayer | None = None
    seen_linear: dict[int, str] = {}
    for name, module in children:
        if isinstance(module, nn.Linear):
            if id(module) in seen_linear:
                raise ValueError(
                    f"edad: the Linear {seen_linear[id(module)]!r} appears again at position {name!r}; "
                    f"edad recomputes one layer per position; {hint}"
                )
            seen_linear[id(module)] = name
            layer = by_module.get(name)
            if layer is None or layer.forms != ("linear",) or layer.weight != f"{name}.weight":
                raise ValueError(f"edad: layer {name!r} shares its weight or is used outside its call; {hint}")
            if layer.compute_dtype != layer.weight_dtype:
                raise ValueError(
                    f"edad: layer {name!r} computes in {layer.compute_dtype} (autocast) while its weight is "
                    f"{layer.weight_dtype}: edad recomputes hidden deltas in the weight's dtype, which autocast's "
                    "backward does not; use 'dad' or 'auto' under precision bf16/fp16, or precision 'fp32'"
                )
            if pending is not None:
                links.append(ChainLink(pending, torch.ones_like))
            pending = layer
            continue
        derivative = activation_derivative(module)
        if derivative is None or pending is None:
            raise ValueError(f"edad: module {name!r} ({type(module).__name__}) is not supported here; {hint}")
        links.append(ChainLink(pending, derivative))
        pending = None
    if pending is None:
        raise ValueError(f"edad: the model must end with an nn.Linear output layer; {hint}")
    links.append(ChainLink(pending, None))
    return links


def _hooks(module: nn.Module) -> tuple[dict, ...]:
    return (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)


def _global_hooks() -> tuple[dict, ...]:
    from torch.nn.modules import module as registry  # the hooks registered for every module

    return (registry._global_forward_hooks, registry._global_forward_pre_hooks, registry._global_backward_hooks,
            registry._global_backward_pre_hooks)


def recompute_deltas(chain: Sequence[ChainLink], params: dict[str, torch.Tensor], tensors: dict) -> dict:
    """Add the hidden layers' deltas Δ_l to ``tensors`` (pooled A_l and Δ_L present)."""
    full = dict(tensors)
    with torch.no_grad():
        for link, after in zip(reversed(chain[:-1]), reversed(chain[1:])):
            if tensor_key(link.layer.module, "A") not in full:
                break  # this layer and those below travel dense (privacy guard)
            a_next = full[tensor_key(after.layer.module, "A")]
            d_next = full[tensor_key(after.layer.module, "D")]
            # (1, n, m_{l+1}) @ (m_{l+1}, k_{l+1}) -> (1, n, m_l), times σ' read off a_{l+1}
            full[tensor_key(link.layer.module, "D")] = (d_next @ params[after.layer.weight]) * link.derivative(a_next)
    return full


class EDADSite(Stateless):
    def __init__(self, layout: Layout, chain: Sequence[ChainLink], raw_input: str):
        self.layout = layout
        self.factored = [link.layer for link in chain if may_share(link.layer, raw_input, "activations")]
        self.output = chain[-1].layer
        factored_names = {layer.module for layer in self.factored}
        self.dense = list(layout.uncovered) + [
            name
            for layer in layout.layers
            if layer.module not in factored_names
            for name in layer.params
        ]

    def begin(self, local: LocalResult, step: int) -> Payload:
        tensors = dense_upload(local, self.dense, self.layout.buffers)
        for layer in self.factored:
            if layer.module not in local.factors:
                raise ValueError(
                    f"edad: layer {layer.module!r} was not captured this step (see the log for why), and "
                    "edad cannot recompute the deltas below it; use 'dad' or 'auto' for this model"
                )
            tensors[tensor_key(layer.module, "A")] = local.factors[layer.module].A
        if self.output in self.factored:
            tensors[tensor_key(self.output.module, "D")] = local.factors[self.output.module].D
        return Payload(step, 0, local.num_samples, tensors)

    def receive(self, message: Payload) -> None:
        return None


class EDADServer(Stateless):
    def __init__(self, layout: Layout, chain: Sequence[ChainLink], site: EDADSite, downlink: str, model: nn.Module):
        self.layout, self.chain, self.site, self.downlink = layout, chain, site, downlink
        self.params = dict(model.named_parameters())
        self.factor_server = FactorServer(layout, "dense")

    def aggregate(self, payloads: Sequence[Payload]) -> Payload:
        total = sum(p.num_samples for p in payloads)
        tensors = dense_aggregate(payloads, self.site.dense, self.layout.buffers)
        pooled = {
            key: group_rows([p.tensors[key] for p in payloads])
            for key in payloads[0].tensors
            if key.endswith(":A") or key.endswith(":D")
        }
        if self.downlink == "factors":
            tensors.update(pooled)
        else:
            one_site = Payload(payloads[0].step, 0, total, recompute_deltas(self.chain, self.params, pooled))
            for layer in self.site.factored:
                tensors.update(self.factor_server.aggregate_layer(layer, [one_site], total))
        return Payload(payloads[0].step, payloads[0].phase, total, tensors)


@dataclass(frozen=True)
class EDAD(Strategy):
    downlink: str = "dense"
    raw_input: str = "dense"
    name = "edad"
    exact = True
    supports_dp = True

    def __post_init__(self) -> None:
        if self.downlink not in ("dense", "factors"):
            raise ValueError(f"edad: downlink={self.downlink!r} must be 'dense' or 'factors'")
        check_raw_input(self.raw_input)

    def site(self, layout: Layout, model: nn.Module | None = None) -> EDADSite:
        return EDADSite(layout, feed_forward_chain(model, layout), self.raw_input)

    def server(self, layout: Layout, model: nn.Module | None = None) -> EDADServer:
        chain = feed_forward_chain(model, layout)
        return EDADServer(layout, chain, EDADSite(layout, chain, self.raw_input), self.downlink, model)

    def upload_units(self, layout: Layout, facts, phase: int, step: int, model: nn.Module | None = None) -> list | None:
        """Phase 0: dense parts; activations of every factored layer, deltas of the output
        layer too; every layer the same rows."""
        if phase != 0:
            return None
        site = EDADSite(layout, feed_forward_chain(model, layout), self.raw_input)
        units = facts.dense_units(site.dense) + facts.buffer_units(layout.buffers)
        for layer in site.factored:
            units.append(Unit(layer.module, (facts.layer_factors(layer, "AD" if layer == site.output else "A"),)))
        return units

    def terms(self, layout: Layout, payload: Payload, messages_so_far, model: nn.Module | None = None) -> tuple[dict, dict]:
        """The hidden deltas this site's rows imply, recomputed in float64, then as dAD. They are
        linear in the output deltas, so the default ``scale`` (Δ times the factor) scales them all."""
        chain = feed_forward_chain(model, layout)
        params = {name: p.detach().double() for name, p in model.named_parameters()}
        tensors = {key: t.double() if t.is_floating_point() else t for key, t in payload.tensors.items()}
        full = recompute_deltas(chain, params, tensors)
        return layerwise_terms(layout, Payload(payload.step, payload.phase, payload.num_samples, full))

    def decode(self, layout: Layout, messages: Sequence[Payload], model: nn.Module | None = None) -> dict:
        message = messages[-1]
        if self.downlink == "factors":  # the weights in the factors' dtype (float64 at a replica: canonical.py)
            dtype = next(t.dtype for k, t in message.tensors.items() if t.is_floating_point() and split_key(k)[1] not in PASSED_THROUGH)
            params = {name: p.detach().to(dtype) for name, p in model.named_parameters()}
            full = recompute_deltas(feed_forward_chain(model, layout), params, message.tensors)
            message = Payload(message.step, message.phase, message.num_samples, full)
        return decode_message(layout, message)
