"""``dadfl.replica`` — one copy of the shared model: workload, optimizer and the strategy's halves around it.

Every participant holds a replica — each site (with local data) and the coordinator
(without). All of them start from the coordinator's weights (``load_weights_from``, or
the state the coordinator sends) and apply the same decoded update with the same
optimizer, so their weights stay bit-identical; the weights fingerprint checks it after
every step. Decode and optimizer step run in float64 and round once
(``strategies/canonical.py``), so replicas on machines with other float kernels (another
CPU, a BLAS build, a GPU) agree too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

import torch
from pydantic import Field
from torch.utils.data import DataLoader, Dataset

from dadfl.strategies import Payload, Strategy, apply_update, local_step, probe_layout, weights_fingerprint
from dadfl.strategies.base import LocalResult, decode_entries
from dadfl.strategies.precision import check_precision
from dadfl.strategies.canonical import float64_payload
from dadfl.strategies.sample_clipping import ClipPlan, clipped_local_step
from dadfl.workloads import Split, Workload

from .config import StrictModel
from .model_identity import model_probe


class OptimizerConfig(StrictModel):
    name: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.1, gt=0, allow_inf_nan=False)
    momentum: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)

    def build(self, params) -> torch.optim.Optimizer:
        _call_optimizer_methods_directly()
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)


def _call_optimizer_methods_directly() -> None:
    """Let ``torch.optim.Optimizer``'s bookkeeping methods run without importing torch's compiler.

    torch wraps ``add_param_group``, ``state_dict``, ``load_state_dict`` and ``zero_grad`` so
    that its compiler never traces them, and the wrapper imports the compiler
    (``torch._dynamo``: about 1.4 s of CPU, as much as importing torch) the first time one is
    called — in every site and coordinator process, when it builds its optimizer. A replica's
    SGD and Adam step in ``canonical_step``, never compiled, so while the compiler is not
    loaded the wrappers are told (by the attribute they cache their result in) to call the
    methods as they are. Once anything has loaded the compiler, torch's wrappers stay as they
    are; on a torch whose wrappers look otherwise this does nothing.
    """
    if "torch._dynamo" in sys.modules:
        return
    for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad"):
        method = getattr(torch.optim.Optimizer, name, None)
        wrapped = getattr(method, "__wrapped__", None)
        code = getattr(method, "__code__", None)
        if wrapped is not None and code is not None and code.co_filename.endswith("_compile.py"):
            wrapped.__dynamo_disable = wrapped


def resolve_device(device: str) -> torch.device:
    """``"auto"`` picks CUDA when present; an explicit ``"cuda"`` without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but this machine has no CUDA device; use 'cpu' or 'auto'")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s); use 'cuda' or 'auto'")
    return resolved


def check_dp_precision(precision: str) -> str:
    if precision != "fp32":
        raise ValueError(f"precision={precision!r} with [dp]: per-sample clipping runs in fp32; use precision 'fp32' with [dp]")
    return precision


@dataclass(frozen=True)
class Decoded:
    """The update of a step's messages, decoded again one parameter at a time whenever
    ``items()`` is read (``Replica.decode_each``): what a coordinator keeps between checking a
    phase's message and applying the step, instead of the decoded update, which is float64
    and model-sized for the low-rank strategies (800 MB at 100M parameters). Every read
    makes the same bits: the same messages through the same operations."""

    replica: "Replica"
    messages: tuple[Payload, ...]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.replica.decode_each(self.messages)


@dataclass
class Replica:
    workload: Workload
    strategy: Strategy
    optimizer_config: OptimizerConfig
    device: torch.device = torch.device("cpu")
    # Differential privacy ([dp]): every sample's gradient is clipped to this norm, and the
    # step's messages are the coordinator's dense noisy update (``dadfl.privacy``).
    max_grad_norm: float | None = None
    # Whether to note what the freshly built model computes (``model_probe``: dadfl/model_identity.py),
    # for the check that a site runs the coordinator's model: only the runtimes' coordinators and
    # freshly built sites need it (``model_probe`` is None otherwise).
    probe: bool = False
    # "fp32", "bf16" or "fp16": the autocast of the local forward/backward (strategies/precision.py).
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.max_grad_norm is not None:
            check_dp_precision(self.precision)
        if self.precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"precision 'bf16' on {self.device}, which has no bf16 support; use 'fp16' or 'fp32'")
        model = self.workload.build_model()
        # Before any weights are loaded, and where the model was built: the same on every device.
        self.model_probe = model_probe(model, self.workload.example()) if self.probe else None
        self.model = model.to(self.device)
        example = self.workload.example().to(self.device)
        # FedAvg and DiLoCo apply the round's mean delta with their own outer optimizer.
        outer = self.strategy.outer_optimizer(self.model.parameters())
        self.optimizer = outer if outer is not None else self.optimizer_config.build(self.model.parameters())
        self.layout = probe_layout(self.model, example, self.precision)
        self.half = self.strategy.site(self.layout, self.model)
        if self.precision != "fp32" and hasattr(self.half, "train_round"):
            raise ValueError(
                f"precision={self.precision!r} with {self.strategy.name}: its local rounds train in the weights' dtype; "
                "use precision 'fp32'"
            )
        self.clip_plan = ClipPlan.verify(self.model, self.layout, example) if self.max_grad_norm is not None else None

    def work(self, batch_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]], step: int) -> LocalResult:
        """This site's part of ``step``: one forward/backward on batch ``step`` of its stream,
        or, for a site half that trains on a step's batches itself (``TrainsRounds``: FedAvg/DiLoCo's
        H inner steps), its ``train_round`` on them."""
        indices = self.strategy.batch_indices(step)
        train_round = getattr(self.half, "train_round", None)  # a half that consumes the step's batches itself (TrainsRounds)
        if train_round is not None:
            self.model.train()
            batches = (tuple(t.to(self.device) for t in batch_at(i)) for i in indices)  # one batch held at a time
            return train_round(self.model, self.workload.loss, batches, self.optimizer_config.build)
        return self.local(*batch_at(indices[0]))

    def local(self, inputs: torch.Tensor, targets: torch.Tensor) -> LocalResult:
        self.model.train()
        if self.clip_plan is not None:
            return clipped_local_step(
                self.model, self.layout, self.clip_plan, self.workload.loss,
                inputs.to(self.device), targets.to(self.device), self.max_grad_norm,
            )[0]
        return local_step(
            self.model,
            self.layout,
            self.workload.loss,
            inputs.to(self.device),
            targets.to(self.device),
            capture=self.strategy.needs_factors,
            precision=self.precision,
        )

    def apply(self, messages: Sequence[Payload]) -> str:
        """Decode the step's messages and apply the update, one parameter at a time (the whole
        float64 update is never held); return the weights fingerprint."""
        return self.apply_update(Decoded(self, tuple(messages)))

    def decode(self, messages: Sequence[Payload]) -> dict[str, torch.Tensor]:
        """The update the step's messages carry, in float64 on this replica's device
        (``strategies/canonical.py``: replicas on other kernels agree); the weights are not touched."""
        return dict(self.decode_each(messages))

    def decode_each(self, messages: Sequence[Payload]) -> Iterator[tuple[str, torch.Tensor]]:
        """``decode``'s entries one at a time (``Strategy.decode_each``)."""
        messages = [float64_payload(m.to(self.device)) for m in messages]
        if self.max_grad_norm is not None:  # the coordinator's dense noisy update
            return decode_entries(self.layout, messages[-1])
        return self.strategy.decode_each(self.layout, messages, self.model)

    def apply_update(self, update: dict[str, torch.Tensor] | Decoded) -> str:
        """Apply a decoded update (in float64, rounded once: ``canonical_step``), a :class:`Decoded`
        one parameter at a time; return the weights fingerprint."""
        apply_update(self.model, self.optimizer, update)
        return weights_fingerprint(self.model)

    def load_weights_from(self, other: "Replica") -> None:
        """Start from ``other``'s weights and buffers (the coordinator's replica), so a
        workload whose ``build_model`` is not seeded still gives identical replicas."""
        self.model.load_state_dict(other.model.state_dict())

    @torch.no_grad()
    def evaluate(self, data: Split | Dataset | None = None, batch_size: int = 512) -> dict[str, float]:
        """Mean loss and metric on ``data``: a Split, or a map-style Dataset of ``(inputs,
        target)`` items (a site's held-out data); by default the workload's test split."""
        self.model.eval()
        data = self.workload.test if data is None else data
        if isinstance(data, Split):
            batches = ((data.inputs[i : i + batch_size], data.targets[i : i + batch_size]) for i in range(0, len(data), batch_size))
        else:
            batches = DataLoader(data, batch_size=batch_size)
        outputs, targets, losses = [], [], []
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            out = self.model(x)
            outputs.append(out)
            targets.append(y)
            losses.append(self.workload.loss(out, y).reshape(len(y), -1).mean(dim=1))
        out, y = torch.cat(outputs), torch.cat(targets)
        return {"loss": float(torch.cat(losses).mean()), self.workload.metric_name: float(self.workload.metric(out, y))}
