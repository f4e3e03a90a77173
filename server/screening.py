"""What a coordinator checks between the sites' uploads of a phase and the message it sends
back, whichever runtime moved the bytes (the gRPC coordinator, the Flower ServerApp).

The runtime first checks each upload's protocol header on its own (``validate.check_protocol``:
step, attempt, phase, model version, sample count). Then, over all uploads of the phase:

1. :meth:`Screening.refusals` — the strategy's own rules (``Strategy.check_uploads``: known
   tensors only, shapes, dtypes, finite values) and the influence bound (each upload's
   ``Strategy.contribution`` against ``max_influence_ratio`` × the median of the others'
   and ``max_update_norm``, ``checks.influence_outliers``). When the check itself raises,
   the uploads are checked one by one to find the culprit; when it raises on every upload
   the check is at fault, not the sites, and the exception propagates.
2. :meth:`Screening.message` — the aggregated message as every site will decode it (after
   the wire codec), finite, and the update it decodes to naming the model's parameters with
   their shapes (``checks.check_update``): a server never sends a message that fails at a site.
   :meth:`Screening.breaking` names the uploads that make it fail.

The runtime decides what a refusal costs (the gRPC coordinator drops the site and counts
it towards quarantine; Flower, without dropout tolerance, stops the run). Everything here
is synchronous and pure: a runtime may run it in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import roundtrip
from dadfl.replica import Replica
from dadfl.strategies import Payload
from dadfl.strategies.checks import ModelFacts, all_finite, check_update, influence_outliers


@dataclass
class Screening:
    """The checks of one coordinator replica's strategy, with its federation's influence bounds."""

    replica: Replica
    max_influence_ratio: float
    max_update_norm: float | None
    codec: int = pb.RAW  # what sites decode: the message after this codec's round trip
    facts: ModelFacts = field(init=False)

    def __post_init__(self) -> None:
        self.facts = ModelFacts.from_model(self.replica.model, self.replica.layout)
        try:
            self.strategy.upload_units(self.replica.layout, self.facts, 0, 0, self.replica.model)
        except NotImplementedError:
            raise ValueError(
                f"strategy {self.strategy.name!r} states no upload rules (Strategy.upload_units), so the "
                "coordinator cannot check what sites send; add them (see strategies/checks.py)"
            ) from None

    @property
    def strategy(self):
        return self.replica.strategy

    def max_samples(self, batch_size: int, step: int) -> int:
        """The most samples an upload of ``step`` may claim: a batch per local step it trains on."""
        return batch_size * self.strategy.batches_per_step(step)

    def upload_dtypes(self, step: int, phase: int) -> dict[str, set[torch.dtype]] | None:
        """The tensor keys an upload of this phase may carry, with their dtypes (None: the phase
        takes no upload): what a runtime can check before it decodes any tensor."""
        units = self.strategy.upload_units(self.replica.layout, self.facts, phase, step, self.replica.model)
        if units is None:
            return None
        allowed: dict[str, set[torch.dtype]] = {}
        for unit in units:
            for form in unit.forms:
                for key, spec in form.tensors.items():
                    allowed.setdefault(key, set()).add(spec.dtype)
        return allowed

    def refusals(self, step: int, phase: int, payloads: Sequence[Payload], messages: Sequence[Payload]) -> dict[int, str]:
        """Why each refused upload (by index) breaks the strategy's rules or the influence bound."""
        strategy, layout, model = self.strategy, self.replica.layout, self.replica.model
        try:
            refused = {r.index: r.reason for r in strategy.check_uploads(layout, self.facts, phase, step, payloads, messages, model)}
        except Exception as failure:  # the check itself failed on some upload: find which, one by one
            refused, crashed = {}, 0
            for index, payload in enumerate(payloads):
                try:
                    for r in strategy.check_uploads(layout, self.facts, phase, step, [payload], messages, model):
                        refused[index] = r.reason
                except Exception as exc:
                    refused[index] = f"the {strategy.name} check failed on it ({type(exc).__name__}: {exc})"
                    crashed += 1
            if crashed == len(payloads):  # on every upload: the check is at fault, not the sites
                raise failure
        measures = {}
        for index in range(len(payloads)):
            if index in refused:
                continue
            try:
                measures[index] = strategy.contribution(layout, payloads[index], messages, model)
            except Exception as exc:
                refused[index] = f"its contribution cannot be measured ({type(exc).__name__}: {exc})"
        good = list(measures)
        for j, reason in influence_outliers(list(measures.values()), self.max_influence_ratio, self.max_update_norm).items():
            refused[good[j]] = f"contribution out of bounds: {reason}"
        return refused

    def message(self, half: Any, payloads: Sequence[Payload], messages: Sequence[Payload]) -> tuple[Payload, Payload, dict]:
        """Aggregate, and decode what sites will decode: (message, as sites receive it, update
        after this phase). Raises when the message would fail at a site."""
        message = half.aggregate(list(payloads))
        sent = roundtrip(message, self.codec)
        for key, tensor in sent.tensors.items():
            if not all_finite(tensor):
                raise ValueError(f"the aggregated {key!r} is not finite on the wire")
        update = self.replica.decode([*messages, sent])
        check_update(self.facts, update)
        return message, sent, update

    def passes(self, start: dict, payloads: Sequence[Payload], messages: Sequence[Payload]) -> bool:
        """Whether these uploads alone make a message every site can decode, tried on a fresh
        server half in ``start`` (the phase's start state) so the real one is untouched."""
        half = self.strategy.server(self.replica.layout, self.replica.model)
        half.load_state_dict(start)
        try:
            self.message(half, payloads, messages)
        except Exception:
            return False
        return True

    def breaking(self, start: dict, payloads: Sequence[Payload], messages: Sequence[Payload]) -> list[int]:
        """The uploads (by index) that break the aggregated message: those that break it alone,
        else (with 3 or more, fine alone but not together) those whose absence mends it; each
        try starts from the server half's state ``start``."""
        offenders = [i for i, payload in enumerate(payloads) if not self.passes(start, [payload], messages)]
        if not offenders and len(payloads) >= 3:
            others = lambda i: [p for j, p in enumerate(payloads) if j != i]  # noqa: E731
            offenders = [i for i in range(len(payloads)) if self.passes(start, others(i), messages)]
        return offenders
