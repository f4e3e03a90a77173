"""``dadfl.model_identity`` — does a site run the coordinator's model? Checked by the site before it loads data.

The layout fingerprint covers structure: parameter names and shapes, buffers, which
layers travel as factors. Where it differs, the run config's hashes of the coordinator's
layout lines (``Layout.lines``) let the site name its own parameters and layers that the
coordinator's model lacks. Two models of one structure can still compute different
functions (the site's copy of the model file has ``tanh`` where the coordinator's has
``relu``), and then every update the site sends is wrong while every check passes. So the
run config also carries what the coordinator's model computes, and the site compares:

* the model runs in eval mode on the workload's example (the batch the layout is built
  from), its floating tensors replaced by seeded values in [0, 1) (an example of zeros
  would hide most of the function; token ids stay; a model that refuses such input, say
  categorical codes it checks, is probed on the example as it is), and every parameter
  replaced by the same seeded values on both sides: not the weights, which the site has
  not loaded yet.
  Buffers stay as ``build_model`` made them, so a constant table (positions) counts as
  function; the probe runs on the freshly built model, before a checkpoint is loaded;
* the floating outputs, flattened, are cut into at most ``PROBE_VALUES`` contiguous
  chunks and each sends its mean: a bounded message whatever the output's size;
* the probe runs where ``build_model`` put the model (the CPU, unless the workload's code
  moves it), before the replica moves it to its device, and with the global random state
  seeded (then restored);
* the two probes must agree within a relative distance of ``PROBE_TOLERANCE``, not
  exactly: another kind of CPU rounds differently, and a model built on a GPU more so
  (CUDA's TF32 convolutions by about 1e-3), where a changed activation moves them by 5 to
  25 per cent (an MLP on the digits example, ReLU against tanh 0.22, SiLU 0.11, GELU 0.066).

It does not see what only training mode does (a dropout rate), a different loss, or a
change below the tolerance (LeakyReLU(0.01) for ReLU: 0.003). A model whose output holds
no floating tensor, or whose probe is not finite, is not probed (an empty probe), and the
site says so in its log.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from dadfl.strategies.capture import as_args

PROBE_VALUES = 256
PROBE_TOLERANCE = 1e-2
PROBE_SEED = 20261124
MAX_LAYOUT_LINES = 16384  # a parameter, buffer or captured layer each; a larger layout sends no hashes
MAX_IDENTITY_CHARS = 24 * MAX_LAYOUT_LINES + 32 * PROBE_VALUES  # Flower's header field, as JSON


def _seeded_inputs(example: tuple, generator: torch.Generator) -> tuple:
    """Floating inputs as seeded values in [0, 1): non-negative, so that a model reading a
    float column as an index or a mask still runs."""
    return tuple(
        torch.rand(t.shape, generator=generator, dtype=torch.float64).to(device=t.device, dtype=t.dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in example
    )


def _seeded_parameters(model: nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every parameter replaced by seeded uniform values at the scale of a default init
    (±1/√fan-in for matrices and kernels, ±1 otherwise), identical wherever the layout is."""
    values = {}
    for name, param in model.named_parameters():
        bound = 1.0 / math.sqrt(max(1, param.numel() // param.shape[0])) if param.dim() >= 2 else 1.0
        drawn = torch.rand(param.shape, generator=generator, dtype=torch.float64) * (2 * bound) - bound
        values[name] = drawn.to(device=param.device, dtype=param.dtype)
    return values


@torch.no_grad()
def model_probe(model: nn.Module, example: torch.Tensor | Sequence[torch.Tensor]) -> list[float]:
    """What ``model`` computes on ``example`` with seeded parameters, as at most PROBE_VALUES
    chunk means. Run on the freshly built model, where it was built (the CPU, unless the
    workload's code moves it): a site's GPU then rounds no differently from the coordinator's
    CPU. The global random state is seeded for the probe and restored after it, so a model
    that draws noise even in eval mode (Monte Carlo dropout) probes alike everywhere."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    example = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in as_args(example))
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(PROBE_SEED)
            generator = torch.Generator().manual_seed(PROBE_SEED)
            parameters, inputs = _seeded_parameters(model, generator), _seeded_inputs(example, generator)
            try:
                output = functional_call(model, parameters, inputs)
            except Exception:  # the model refuses such input: the example itself, which the layout's probe runs too
                output = functional_call(model, parameters, example)
    finally:
        for module, training in modes:
            module.training = training
    leaves = [t.detach().reshape(-1).double().cpu() for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        return []
    flat = torch.cat(leaves)
    if not len(flat) or not torch.isfinite(flat).all():
        return []
    return [chunk.mean().item() for chunk in torch.tensor_split(flat, min(PROBE_VALUES, len(flat)))]


def probe_distance(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """‖mine − theirs‖ / max(‖mine‖, ‖theirs‖); infinite when the lengths differ, NaN when
    ``theirs`` (from the wire) is not finite."""
    if len(mine) != len(theirs):
        return math.inf
    a, b = torch.tensor(mine, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    scale = max(a.norm().item(), b.norm().item())
    return (a - b).norm().item() / scale if scale > 0 else 0.0


def line_hash(line: str) -> int:
    """64 bits of SHA-256: the run config carries these for the server's layout lines."""
    return int.from_bytes(hashlib.sha256(line.encode()).digest()[:8], "little")


def line_hashes(lines: Sequence[str]) -> list[int]:
    """What the coordinator sends of its layout lines: their hashes, none beyond MAX_LAYOUT_LINES."""
    return [line_hash(line) for line in lines] if len(lines) <= MAX_LAYOUT_LINES else []


def layout_difference(my_lines: Sequence[str], their_hashes: Sequence[int]) -> str:
    """Name what differs, from this side's layout lines and the other side's line hashes."""
    if not their_hashes:
        return f"the coordinator's layout has more than {MAX_LAYOUT_LINES} lines, too many to name what differs"
    theirs = set(their_hashes)
    mine = {line_hash(line) for line in my_lines}
    only_mine = [line for line in my_lines if line_hash(line) not in theirs]
    only_theirs = len(theirs - mine)
    parts = []
    if only_mine:
        shown = "; ".join(only_mine[:3]) + (f" and {len(only_mine) - 3} more" if len(only_mine) > 3 else "")
        parts.append(f"this site has {shown}, which the coordinator's model does not")
    if only_theirs:
        parts.append(f"the coordinator's model has {only_theirs} parameter(s), buffer(s) or captured layer(s) this site's lacks")
    return ", and ".join(parts) or "the layouts list the same lines in a different order"


def identity_text(lines: Sequence[str], probe: Sequence[float]) -> str:
    """The layout's line hashes and the model probe as one JSON text (a Flower header field;
    the gRPC runtime carries them as fields of the run config)."""
    return json.dumps({"lines": line_hashes(lines), "probe": list(probe)})


def read_identity_text(text: str) -> tuple[list[int], list[float]]:
    """(line hashes, probe) from ``identity_text``; ValueError when it is anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict) and set(value) == {"lines", "probe"}:
        lines, probe = value["lines"], value["probe"]
        if (isinstance(lines, list) and len(lines) <= MAX_LAYOUT_LINES and all(type(h) is int and 0 <= h < 1 << 64 for h in lines)
                and isinstance(probe, list) and len(probe) <= PROBE_VALUES and all(type(v) is float for v in probe)):
            return lines, probe
    raise ValueError(
        f"the model identity is not {{\"lines\": [at most {MAX_LAYOUT_LINES} 64-bit hashes], \"probe\": [at most {PROBE_VALUES} numbers]}}"
    )
