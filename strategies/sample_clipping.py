"""``dadfl.strategies.sample_clipping`` — per-sample clipping read off the factors: the site's
half of sample-level DP-SGD. It lives with the strategies, not in ``dadfl.privacy``, because it is
factor math: it reads the captured calls' A and Δ (``capture.py``, ``layout.py``) and changes
the Δ every strategy then carries; the accounting and the noise are ``dadfl.privacy``'s.

DP-SGD bounds what one sample can change: every sample's gradient g_i (all parameters
together) is scaled by c_i = min(1, C/‖g_i‖) before the sum, so one sample moves the sum
by at most C, and the coordinator's Gaussian noise N(0, σ²C²) hides it
(``dadfl.privacy``). What needs computing per sample is only the norm ‖g_i‖; the
clipped sum then follows from one more backward.

**Norms from the factors.** A captured weight's per-sample gradient is a sum of outer
products over the sample's rows: u_t v_tᵀ with u = δ_t, v = a_t for a linear or conv call
(a conv's rows are its output positions, a recurrent cell's its time steps), u = e_{id_t},
v = δ_t for a lookup. So

    ‖g_i‖² = Σ_{t,t' ∈ rows of i} (u_t·u_t')(v_t·v_t')

from the row Grams, without forming any gradient — for one row per sample simply
‖a_i‖²‖δ_i‖². A bias read off Σ δ appends 1 to every linear/conv row's v; groups add up
block by block; for lookups u_t·u_t' = [id_t = id_t'] and, against a tied head's rows,
u_t·e_id = δ_t[id]. A sample of T rows costs T²·(m + k) this way and T·m·k by forming
its gradient Σ_t δ_t a_tᵀ; each layer takes the cheaper (the ghost-clipping trade-off).

Rows are matched to samples by the call's input: when its leading dimension is the batch
B, its R rows are B blocks of R/B (batch-first). A layer whose calls are not laid out so
(time-major inputs, ``nn.MultiheadAttention``'s packed projection, per-sample unbatched
calls) — or whose factor norms did not match autograd's on the example
(``ClipPlan.verify``, once per replica) — gets its per-sample gradients from autograd
instead: one batched backward (``is_grads_batched``) over the same graph, so the same
dropout masks and the same numbers.

**Parameters no layer covers** (norm layers' affine parameters, raw ``nn.Parameter``s,
biases not read off Δ) are followed through their calls (``capture.py``, per-sample calls).
When all of a parameter's uses are ``F.layer_norm`` calls (as weight or bias) or additions
to a batched activation, its per-sample gradient is a reduction of recorded quantities, per
call c and sample i:

    layer_norm weight:  Σ_{rows t of i} δ_t ⊙ x̂_t      layer_norm bias:  Σ_{rows t of i} δ_t
    y = a + p (p broadcast over the batch):  δ_i summed over the dimensions p is broadcast on

summed over the calls (a view such as ``position[:T]`` adds into the elements it reads), so
‖g_i‖² costs B·|p| and no backward. Every step checks Σ_i g_i against the summed backward's
gradient of p, which a use the calls did not see would break. A parameter used any other
way, whose rows do not lead with the batch, whose sum does not match, or whose norms did not
match autograd's on the example (``ClipPlan.verify``) gets its per-sample gradients from
autograd's batched backward, like the layers above.

**The clipped sum.** Backpropagation is linear in the upstream gradient: the backward of
Σ_i c_i ℓ_i gives every captured call's Δ rows of sample i scaled by c_i and every
parameter the clipped sum Σ_i c_i g_i. The second backward re-records Δ through the same
hooks, so every strategy (dsgd, dad, auto, edad, rank-dAD, PowerSGD) carries exactly the
clipped sum: its factors are the clipped factors.

Models that mix the samples of a batch (BatchNorm, running statistics) have no
per-sample gradient and are refused (``refuse_sample_mixing``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .base import LocalResult
from .capture import LAYER_NORM, LOOKUP, Call, CallRecorder, FactorCapture, SampleCall, as_args, forward_losses, local_result
from .layout import CapturedLayer, Layout

log = logging.getLogger("dadfl.privacy")

VERIFY_SEED = 0
VERIFY_RTOL = 1e-4


def refuse_sample_mixing(model: nn.Module) -> None:
    """Refuse modules whose output for one sample depends on the others (or whose buffers
    learn from the batch): per-sample gradients, and so DP-SGD, do not exist for them."""
    for name, module in model.named_modules():
        mixes = isinstance(module, nn.modules.batchnorm._BatchNorm)
        tracks = isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats
        if mixes or tracks:
            what = "normalises over the batch" if mixes else "learns running statistics from the batch"
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) {what}, so a sample's gradient depends on the "
                "other samples and differential privacy cannot bound it; replace it with nn.GroupNorm "
                "(or nn.LayerNorm) for training with [dp]"
            )


def refuse_learning_buffers(model: nn.Module, example_inputs) -> None:
    """Refuse a model whose training forward changes a floating buffer (a statistic learnt
    from the batch): under DP only the noisy parameter update leaves the coordinator, so such
    a buffer would carry unprotected data and drift between replicas."""
    before = {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}
    if not before:
        return
    was_training = model.training
    model.train()
    args = as_args(example_inputs)
    cuda = sorted({t.device.index or 0 for t in args if torch.is_tensor(t) and t.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):  # dropout's draws leave the run's streams alone
            model(*args)
        changed = [name for name, b in model.named_buffers() if name in before and not torch.equal(b, before[name])]
    finally:
        for name, b in model.named_buffers():
            if name in before:
                b.copy_(before[name])
        model.train(was_training)
    if changed:
        raise ValueError(
            f"buffer {changed[0]!r} changes in a training forward pass (a statistic learnt from the batch), which "
            "differential privacy does not cover; compute it outside the model or make it a parameter"
        )


@dataclass(frozen=True)
class ClipPlan:
    """The captured layers whose per-sample norms are read off their factors and the
    uncovered parameters whose norms are read off their per-sample calls; the others get
    theirs from autograd. ``reasons``: why, per layer or parameter."""

    from_factors: tuple[str, ...]
    reasons: tuple[tuple[str, str], ...] = ()
    from_calls: tuple[str, ...] = ()

    @classmethod
    def verify(cls, model: nn.Module, layout: Layout, example_inputs) -> "ClipPlan":
        """Check each layer's factor norms, and each uncovered parameter's call norms, against
        autograd's per-sample gradients on the example (a seeded per-sample functional of the
        output, eval mode)."""
        refuse_sample_mixing(model)
        refuse_learning_buffers(model, example_inputs)
        was_training = model.training
        model.eval()
        try:
            with torch.enable_grad():
                recorder = FactorCapture(model, layout, as_args(example_inputs), per_sample=True)
                with recorder:
                    outputs = model(*as_args(example_inputs))
                batch = _batch_size(example_inputs)
                if not torch.is_tensor(outputs) or outputs.dim() == 0 or outputs.shape[0] != batch or batch < 2:
                    why = "the example's output does not lead with a batch of two or more samples"
                    return cls((), tuple((name, why) for name in [l.module for l in layout.layers] + list(layout.uncovered)))
                generator = torch.Generator().manual_seed(VERIFY_SEED)
                cotangent = torch.randn(outputs.shape, generator=generator, dtype=outputs.dtype).to(outputs.device)
                losses = (outputs * cotangent).reshape(batch, -1).sum(dim=1)
                model.zero_grad(set_to_none=True)  # the call norms are checked against this backward's sum
                losses.sum().backward(retain_graph=True)
                params = dict(model.named_parameters())
                kept, reasons = [], []
                problems = recorder.problems()
                for layer in layout.layers:
                    if layer.module in problems:
                        reasons.append((layer.module, problems[layer.module]))
                        continue
                    factor_sq = factor_sq_norms(layer, recorder.recorder.calls.get(layer.weight, []), batch)
                    if factor_sq is None:
                        reasons.append((layer.module, "its rows cannot be matched to samples (the batch is not their leading dimension)"))
                        continue
                    error = _relative_error(factor_sq, autograd_sq_norms(losses, [params[n] for n in layer.params], recorder))
                    if error > VERIFY_RTOL:
                        reasons.append((layer.module, f"its factor norms differ from autograd's (relative error {error:.2g})"))
                    else:
                        kept.append(layer.module)
                from_calls = call_sq_norms(recorder.recorder, layout.uncovered, batch)
                kept_calls = []
                for name in layout.uncovered:
                    if name not in from_calls:
                        other = recorder.recorder.sample_other_uses.get(name)
                        why = f"it is also read by {other}" if other else "its rows cannot be matched to samples or its calls miss part of its gradient"
                        reasons.append((name, why))
                        continue
                    error = _relative_error(from_calls[name], autograd_sq_norms(losses, [params[name]], recorder))
                    if error > VERIFY_RTOL:
                        reasons.append((name, f"its call norms differ from autograd's (relative error {error:.2g})"))
                    else:
                        kept_calls.append(name)
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)
        for name, why in reasons:
            log.info("%r: per-sample norms by autograd: %s", name, why)
        return cls(tuple(kept), tuple(reasons), tuple(kept_calls))


def _relative_error(sq: torch.Tensor, reference_sq: torch.Tensor) -> float:
    """max_i |√sq_i − √ref_i| / max_i √ref_i (1 where the reference is all zero)."""
    scale = float(reference_sq.max().sqrt()) or 1.0
    return float((sq.sqrt() - reference_sq.sqrt()).abs().max()) / scale


def _batch_size(inputs) -> int:
    first = as_args(inputs)[0]
    return int(first.shape[0]) if torch.is_tensor(first) and first.dim() else 0


def _by_sample(rows: torch.Tensor, call: Call, batch: int) -> torch.Tensor | None:
    """(R, ...) -> (B, R/B, ...) when the call's input leads with the batch, else None."""
    if call.lead != batch or rows.shape[0] % batch:
        return None
    return rows.reshape(batch, rows.shape[0] // batch, *rows.shape[1:])


def factor_sq_norms(layer: CapturedLayer, calls: Sequence[Call], batch: int) -> torch.Tensor | None:
    """‖g_i‖² of the layer's weight (and the bias read off Δ) per sample, from its calls'
    rows (see the module doc); None when some call's rows cannot be matched to samples."""
    calls = [c for c in calls if c.delta is not None]
    if not calls:
        return None
    G, k, m = layer.groups, layer.in_per_group, layer.out_per_group
    A_parts, D_parts, id_parts, row_parts = [], [], [], []
    for call in calls:
        if call.kind == LOOKUP:
            ids, rows = _by_sample(call.inputs, call, batch), _by_sample(call.delta, call, batch)
            if ids is None or rows is None:
                return None
            if call.padding_idx is not None:  # padding rows get no gradient
                rows = rows * (ids != call.padding_idx).unsqueeze(-1).to(rows.dtype)
            id_parts.append(ids.long())
            row_parts.append(rows)
            continue
        delta = call.delta
        if call.row_block is not None:  # a block of the weight's rows: Δ of the others is zero
            padded = delta.new_zeros(delta.shape[0], layer.out_features)
            padded[:, call.row_block[0] : call.row_block[1]] = delta
            delta = padded
        A, D = _by_sample(call.inputs, call, batch), _by_sample(delta, call, batch)
        if A is None or D is None or A.shape[1] != D.shape[1]:
            return None
        A_parts.append(A.reshape(batch, A.shape[1], G, k))
        D_parts.append(D.reshape(batch, D.shape[1], G, m))
    sq = None
    if A_parts:
        A, D = torch.cat(A_parts, dim=1), torch.cat(D_parts, dim=1)
        V = torch.cat([A, A.new_ones(*A.shape[:3], 1)], dim=-1) if layer.bias else A
        rows, width = A.shape[1], V.shape[-1]
        if rows * (m + width) < m * width:  # Grams: T²·(m + k) per sample and group
            sq = (torch.einsum("btgk,bsgk->bgts", V, V) * torch.einsum("btgm,bsgm->bgts", D, D)).sum(dim=(1, 2, 3))
        else:  # the per-sample gradient itself: T·m·k
            sq = torch.einsum("btgm,btgk->bgmk", D, V).pow(2).sum(dim=(1, 2, 3))
    if id_parts:
        ids, R = torch.cat(id_parts, dim=1), torch.cat(row_parts, dim=1)
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(R.dtype)
        lookups = (same * torch.einsum("btd,bsd->bts", R, R)).sum(dim=(1, 2))
        if A_parts:  # a head tied to the table (one group): 2 Σ δ_t[id_s] (a_t·r_s)
            Dt, At = D[:, :, 0, :], A[:, :, 0, :]
            at_ids = torch.gather(Dt, 2, ids.unsqueeze(1).expand(-1, Dt.shape[1], -1))
            lookups = lookups + 2 * (at_ids * torch.einsum("btk,bsk->bts", At, R)).sum(dim=(1, 2))
        sq = lookups if sq is None else sq + lookups
    return sq


def call_sq_norms(recorder: CallRecorder, names: Sequence[str], batch: int) -> dict[str, torch.Tensor]:
    """‖g_i‖² per sample of each named parameter whose every use this step was a per-sample
    call with rows matched to samples (see the module doc); the others are left out. Needs
    the backward of Σ ℓ_i done: Σ_i g_i must equal the parameter's ``.grad``, which catches
    a use the calls did not see (a custom ``autograd.Function``, say)."""
    params = dict(recorder.sample_params.values())
    result = {}
    for name in names:
        if name in recorder.sample_other_uses or name not in params:
            continue
        param = params[name]
        total = param.detach().new_zeros(batch, param.numel())  # a call that never reached the loss adds nothing
        for call in recorder.sample_calls.get(name, []):
            if call.delta is None:
                continue
            if call.lead != batch or call.delta.shape[0] != batch:
                break
            for target, role, index in call.targets:
                if target != name:
                    continue
                grads = _call_grads(call, role, batch)
                if index is None:
                    total = total + grads
                else:  # a view: add into the elements it reads
                    total = total.index_add(1, index, grads)
        else:
            summed = param.grad.detach().reshape(-1) if param.grad is not None else torch.zeros_like(total[0])
            if float((total.sum(dim=0) - summed).norm()) <= VERIFY_RTOL * max(float(summed.norm()), 1e-12):
                result[name] = total.pow(2).sum(dim=1)
    return result


def _call_grads(call: SampleCall, role: str, batch: int) -> torch.Tensor:
    """Each sample's gradient, (B, n), of the target of ``call`` in ``role`` (module doc)."""
    if call.kind == LAYER_NORM:
        width = math.prod(call.shape)
        delta = call.delta.reshape(batch, -1, width)
        per_row = delta if role == "bias" else delta * call.normalized.reshape(batch, -1, width)
        return per_row.sum(dim=1)
    return call.delta.sum_to_size((batch, *call.shape[1:])).reshape(batch, -1)


def autograd_sq_norms(losses: torch.Tensor, tensors: Sequence[torch.Tensor], recorder: FactorCapture) -> torch.Tensor:
    """Σ over ``tensors`` of ‖∂ℓ_i/∂p‖² per sample, by one batched backward through the
    graph (one backward per sample where an op has no batched backward)."""
    batch = losses.shape[0]
    if not tensors:
        return losses.new_zeros(batch)
    recorder.recorder.keep_deltas = False
    try:
        try:
            eye = torch.eye(batch, dtype=losses.dtype, device=losses.device)
            grads = torch.autograd.grad(losses, tensors, eye, retain_graph=True, allow_unused=True, is_grads_batched=True)
            per_sample = [g.reshape(batch, -1) for g in grads if g is not None]
        except RuntimeError:
            per_sample = []
            rows = [torch.autograd.grad(losses[i], tensors, retain_graph=True, allow_unused=True) for i in range(batch)]
            for j in range(len(tensors)):
                if rows[0][j] is not None:
                    per_sample.append(torch.stack([row[j].reshape(-1) for row in rows]))
    finally:
        recorder.recorder.keep_deltas = True
    return sum((g.pow(2).sum(dim=1) for g in per_sample), losses.new_zeros(batch))


def per_sample_norms(model: nn.Module, layout: Layout, plan: ClipPlan, recorder: FactorCapture, losses: torch.Tensor) -> torch.Tensor:
    """‖g_i‖ over every trainable parameter, after a backward of Σ ℓ_i that kept its graph."""
    batch = losses.shape[0]
    params = dict(model.named_parameters())
    problems = recorder.problems()
    sq = losses.detach().new_zeros(batch)
    covered: set[str] = set()
    for layer in layout.layers:
        if layer.module not in plan.from_factors or layer.module in problems:
            continue
        layer_sq = factor_sq_norms(layer, recorder.recorder.calls.get(layer.weight, []), batch)
        if layer_sq is not None:
            sq = sq + layer_sq
            covered.update(layer.params)
        elif not any(c.delta is not None for c in recorder.recorder.calls.get(layer.weight, [])):
            covered.update(layer.params)  # no call reached the loss: zero
    from_calls = call_sq_norms(recorder.recorder, [n for n in plan.from_calls if n not in covered], batch)
    for name, call_sq in from_calls.items():
        sq = sq + call_sq
        covered.add(name)
    rest = [params[name] for name in layout.params if name not in covered]
    sq = sq + autograd_sq_norms(losses, rest, recorder).detach()
    return sq.clamp(min=0).sqrt()


def clipped_local_step(
    model: nn.Module,
    layout: Layout,
    plan: ClipPlan,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs,
    targets: torch.Tensor,
    max_grad_norm: float,
) -> tuple[LocalResult, torch.Tensor]:
    """``local_step`` with every sample's gradient clipped to ``max_grad_norm``: (the
    result, whose gradients and factors carry Σ_i c_i g_i; the unclipped norms ‖g_i‖)."""
    if targets.shape[0] == 0:
        raise ValueError("clipped_local_step needs at least one sample; a site with an empty batch sends nothing")
    recorder, losses = forward_losses(model, layout, loss_fn, inputs, targets, capture=True, per_sample=bool(plan.from_calls))
    losses.sum().backward(retain_graph=True)
    norms = per_sample_norms(model, layout, plan, recorder, losses)
    scale = (max_grad_norm / norms).clamp(max=1.0)  # a zero gradient: C/0 = inf -> 1
    model.zero_grad(set_to_none=True)
    (losses * scale.to(losses.dtype)).sum().backward()  # re-records every Δ, scaled by its sample's c_i
    return local_result(model, layout, recorder, int(targets.shape[0]), float(losses.detach().sum())), norms
