"""``dadfl.trust.screening`` — what a coordinator checks between the sites' uploads of a phase and the message it sends
back, whichever runtime moved the bytes (the gRPC coordinator, the Flower ServerApp).

The runtime first checks each upload's protocol header on its own (``dadfl.trust.protocol.check_protocol``:
step, attempt, phase, model version, sample count). Then, over all uploads of the phase:

1. :meth:`Screening.refusals` — the strategy's own rules (``Strategy.check_uploads``: known
   tensors only, shapes, dtypes, finite values) and the influence bound (each upload's
   ``Strategy.contribution`` against ``max_influence_ratio`` × the median of the others'
   and ``max_update_norm``, ``checks.influence_outliers``). When the check itself raises,
   the uploads are checked one by one to find the culprit; when it raises on every upload
   the check is at fault, not the sites, and the exception propagates.
2. :meth:`Screening.weigh` — bounded influence (``strategies/robust.py``): from the Gram
   matrix of the accepted uploads' updates (inner products from the factors,
   ``strategies/gram.py``) a factor in [0, 1] per site — clipped to ``clip_ratio`` × the
   median of the others' norms or, when larger, of their recent norms' 0.9 quantiles, 0 for a
   site that pushes the model back along the others' sum, on average over its recent steps,
   by ``agreement_margin`` × their median norm more than the other sites do among themselves
   (``agreement``); with ``momentum`` above 0, measured on each site's momentum of its clipped
   updates instead of the step's (kept here by site id, phase and parameter, in float32), and,
   where a kept site keeps less than 2/3 of its peers' pull forward, a factor in [1, 1.5] common
   to the kept sites that gives back the step length it withholds (the mean over the samples
   that count) — and each upload scaled by its factors (``Strategy.scale``). Factors decided in
   a step's earlier phases bound the later ones', except those of a phase that only chooses a basis
   (``Strategy.chooses_basis``, PowerSGD's P_s: clipped to the others' median norm, no
   agreement). A step where every factor is 1 aggregates the uploads untouched.
3. :meth:`Screening.message` — the aggregated message as every site will decode it (after
   the wire codec), finite, and the update it decodes to naming the model's parameters with
   their shapes (``checks.check_update``): a server never sends a message that fails at a site.
   :meth:`Screening.breaking` names the uploads that make it fail.

Never blame the honest (:func:`model_fault`): before step 1 the runtime sets aside the uploads
that hold a non-finite value (:func:`nonfinite_reason`: the loss or a tensor). Every upload was
computed from the coordinator's own weights (the protocol checks the fingerprint), so when a
majority of them are non-finite the model is at fault (its weights, or an update that drove them
where the loss overflows), not the sites: the step is refused as a whole, no site is refused or
counted towards quarantine, and the run stops with one line saying so (the weights it keeps are
the last committed ones, which are finite: a runtime never commits non-finite weights). A
minority of non-finite uploads is the sending sites' fault: they are refused as before.

The runtime decides what a refusal costs (the gRPC coordinator drops the site and counts
it towards quarantine; Flower, without dropout tolerance, stops the run). Everything here
is synchronous and pure: a runtime may run it in a worker thread.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dadfl.protos import tensor_pb2 as pb
from dadfl.protos.codec import roundtrip
from dadfl.replica import Decoded, Replica
from dadfl.sanitize import printable
from dadfl.strategies import Payload
from dadfl.strategies.checks import ModelFacts, all_finite, check_update, finite_flags, influence_outliers
from dadfl.strategies.gram import STACKED_ELEMENTS, UnpairedForms, formed, gram, sq_norm, sq_norms
from dadfl.strategies.robust import (
    BASIS_CLIP_RATIO, DEFAULT_AGREEMENT_MARGIN, DEFAULT_CLIP_RATIO, DEFAULT_MOMENTUM, DEFAULT_STANDING_WEIGHT, FULL_COUNT_SHARE, Momentum,
    Weights, recorded_norms, robust_weights, updated_standing,
)

log = logging.getLogger(__name__)

# The agreement rule needs every pair of sites (S(S-1)/2 inner products, each at most a norm's
# cost); above this many sites a step is clipped only (S norms).
MAX_AGREEMENT_SITES = 32
# A site zeroed by agreement in this share of the last ZEROED_WINDOW committed steps is named to
# the operator (``Screening._watch_zeroed``): in clean IID runs an honest site is zeroed in a few
# percent of steps, with label skew in up to 85% (docs/robustness.md).
ZEROED_WINDOW = 50
ZEROED_WARN_SHARE = 0.3
# The most elements (sites × parameters) of momenta the coordinator keeps, in float32 (256 MiB,
# and each phase forms the sites' updates in float64 beside them: 512 MiB); a federation above
# it is weighed on each step's updates alone (``Screening.momentum``), and told so once.
MAX_MOMENTUM_ELEMENTS = 1 << 26


def nonfinite_reason(loss_sum: float, payload: Payload) -> str | None:
    """Why an upload holds a non-finite value (its reported loss or one of its tensors), or None."""
    return nonfinite_reasons([loss_sum], [payload]).get(0)


def nonfinite_reasons(loss_sums: Sequence[float], payloads: Sequence[Payload]) -> dict[int, str]:
    """:func:`nonfinite_reason` of every upload that has one, by index: the tensors of all of
    them tested together (``checks.finite_flags``)."""
    keyed = [(index, key) for index, payload in enumerate(payloads) for key in payload.tensors]
    finite = finite_flags([payloads[index].tensors[key] for index, key in keyed])
    reasons = {index: f"loss_sum={loss!r} is not finite" for index, loss in enumerate(loss_sums) if not math.isfinite(loss)}
    for (index, key), ok in zip(keyed, finite):
        if not ok and index not in reasons:  # the first of its tensors that is not finite
            reasons[index] = f"tensor {printable(key)}: contains NaN or Inf"
    return dict(sorted(reasons.items()))


def model_fault(nonfinite: int, uploads: int) -> bool:
    """Whether ``nonfinite`` of a phase's ``uploads`` (all computed from the same weights) being
    non-finite is the model's fault rather than the sending sites': a strict majority. So a
    minority of sites can never stop a run this way, and with two sites one non-finite upload is
    that site's fault."""
    return uploads > 0 and 2 * nonfinite > uploads


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every weight and buffer of ``model`` is finite: a runtime checks it after applying
    an update, before it commits the step."""
    return all(all_finite(tensor) for tensor in model.state_dict().values())


WEIGHTS_NOT_FINITE = (
    "its update makes the model's weights non-finite, so the model, not a site, is at fault and no site is refused; "
    "the update overflowed the weights (lower optimizer.lr) or an earlier one poisoned them"
)


def model_fault_reason(step: int, phase: int, reasons: Sequence[str], uploads: int, weights_finite: bool) -> str:
    """The one line a run stopped by :func:`model_fault` ends with."""
    state = "its weights are finite but its loss overflows" if weights_finite else "its weights are not finite"
    return (
        f"step {step} phase {phase}: {len(reasons)} of {uploads} sites computed non-finite values on the model "
        f"(e.g. {reasons[0]}): {state}, so the model, not a site, is at fault and no site is refused; "
        "the model diverged (lower optimizer.lr, or check the workload's loss) or an earlier update poisoned it"
    )


def _positions(earlier: dict, names: list[str] | None, count: int) -> dict[int, int]:
    """Where each upload of a step's earlier phase (by index) is among this phase's ``count``
    uploads: by site id where both phases name them, else by position when no site left between
    them (the same count); otherwise unknown, and the earlier phase binds nothing."""
    if names is not None and earlier.get("sites") is not None:
        index = {name: j for j, name in enumerate(names)}
        return {i: index[name] for i, name in enumerate(earlier["sites"]) if name in index}
    return {i: i for i in range(count)} if len(earlier["factors"]) == count else {}


@dataclass(frozen=True)
class Decision:
    """What the rule decided for one phase's uploads, and what it read to decide it: the
    standings, clip history and momenta before the phase, and each site's update in parameter
    space (None where agreement read no momenta), from which ``Screening`` records the phase."""

    weights: Weights
    factors: list[float]  # the weights' factors bound by the step's earlier phases
    earlier: dict | None  # the step's earlier phases (``Screening.weighed``), None in its first
    here: dict[int, int]  # an earlier phase's index of a site -> this phase's
    basis: bool  # a phase that only chooses a basis
    standing: dict[str, float]
    peer_standing: dict[str, float]
    before: list[float] | None  # the sites' standings, as the rule read them
    peers_before: list[float] | None
    recent: dict[str, dict[int, list[float]]]
    history: list[list[float]] | None  # the sites' clip history, as the rule read it
    updates: list[dict[str, torch.Tensor]] | None


@dataclass
class Screening:
    """The checks of one coordinator replica's strategy, with its federation's influence bounds."""

    replica: Replica
    max_influence_ratio: float
    max_update_norm: float | None
    codec: int = pb.RAW  # what sites decode: the message after this codec's round trip
    clip_ratio: float | None = DEFAULT_CLIP_RATIO  # None or 0: no clipping
    agreement: bool = True
    agreement_margin: float = DEFAULT_AGREEMENT_MARGIN  # β (``robust.py``)
    standing_weight: float = DEFAULT_STANDING_WEIGHT  # λ (``robust.py``)
    momentum: float = DEFAULT_MOMENTUM  # μ (``robust.py``); 0: agreement on each step's updates alone
    full_count_share: float = FULL_COUNT_SHARE  # k (``robust.py``); 0: every kept site counts whole in the mean
    facts: ModelFacts = field(init=False)
    # The step's factors so far (its earlier phases bound the later ones), and what the
    # metrics record of them: reset by each step's (each attempt's) phase 0.
    weighed: dict = field(init=False, default_factory=dict)
    # The update terms of the phase's measured uploads and their squared norm, ``(payload, terms,
    # ‖update‖²)`` by id (the payload kept so that a reused id cannot match another upload):
    # ``refusals`` measures them, ``weigh`` and the trials of ``breaking`` reuse them (edAD
    # recomputes its hidden deltas for them).
    measured: dict = field(init=False, default_factory=dict)
    # Each site's standing and its peers' (``robust.py``), by site id, as of the last committed
    # step: what a checkpoint keeps. Sites are enrolled identities: one float per enrolled site each.
    standing: dict[str, float] = field(init=False, default_factory=dict)
    peer_standing: dict[str, float] = field(init=False, default_factory=dict)
    # Each site's update norms in its last committed steps, by site id and phase (the clip's
    # history, ``robust.py``): also what a checkpoint keeps.
    recent_norms: dict[str, dict[int, list[float]]] = field(init=False, default_factory=dict)
    # Each site's momentum of its clipped updates (``robust.py``), by site id, phase and parameter,
    # flat float32 in parameter space: also what a checkpoint keeps.
    momenta: dict[str, dict[int, dict[str, torch.Tensor]]] = field(init=False, default_factory=dict)
    # The sites agreement zeroed in each of the last committed steps (the operator's warning).
    zeroed_recently: list[frozenset[str]] = field(init=False, default_factory=list)
    zeroed_warned_until: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.facts = ModelFacts.from_model(self.replica.model, self.replica.layout)
        self.numels = {name: math.prod(shape) for name, (shape, _) in self.facts.params.items()}
        self.momentum_warned = False  # a step without momentum is told once
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
        terms, self.measured = {}, {}
        for index, payload in enumerate(payloads):
            if index in refused:
                continue
            try:
                terms[index] = strategy.terms(layout, payload, messages, model)
            except Exception as exc:
                refused[index] = f"its contribution cannot be measured ({type(exc).__name__}: {exc})"
        squares = {}  # by index: (‖update‖², ‖buffers‖²)
        try:  # every site's at once (``gram.sq_norms``)
            squares = dict(zip(terms, zip(*(sq_norms([t[kind] for t in terms.values()]) for kind in (0, 1)))))
        except Exception:  # some site's terms have no norm: one by one, to refuse those
            for index, (update, buffer_terms) in terms.items():
                try:
                    squares[index] = (sq_norm(update), sq_norm(buffer_terms))
                except Exception as exc:
                    refused[index] = f"its contribution cannot be measured ({type(exc).__name__}: {exc})"
        measures = {index: {"update": math.sqrt(u), "buffers": math.sqrt(b)} for index, (u, b) in squares.items()}
        for index, (update_square, _) in squares.items():
            self.measured[id(payloads[index])] = (payloads[index], terms[index][0], update_square)
        good = list(measures)
        for j, reason in influence_outliers(list(measures.values()), self.max_influence_ratio, self.max_update_norm).items():
            refused[good[j]] = f"contribution out of bounds: {reason}"
        return refused

    def weigh(
        self, payloads: Sequence[Payload], messages: Sequence[Payload], remember: bool = True, sites: Sequence[str] | None = None
    ) -> list[Payload]:
        """The uploads scaled by the robust rule's factors (module text, step 2); ``remember``:
        keep the factors for the step's later phases and the metrics (not for trial runs).
        ``sites``: the uploads' site ids, whose standing and momentum the rule reads (None: this
        step alone decides); what it measured takes effect when the runtime commits the step (``commit``)."""
        if sites is not None and len(sites) != len(payloads):
            raise ValueError(f"{len(sites)} site ids for {len(payloads)} uploads: name every upload's site, in order")
        if len(payloads) < 2 or (not self.clip_ratio and not self.agreement):
            return list(payloads)
        decision = self._decide(payloads, messages, sites)
        if remember:
            self._remember(decision, payloads[0].step, payloads[0].phase, sites)
        # A site of weight 0 leaves the phase's aggregate and its sample count, as if it had not
        # sent: the others' mean is not diluted by it.
        # A site that counts less leaves part of its samples: every kept upload is scaled up for it.
        mean = decision.weights.undiluted
        kept = [(payload, factor * mean) for payload, factor in zip(payloads, decision.factors) if factor > 0.0]
        strategy, layout = self.strategy, self.replica.layout
        return [payload if factor == 1.0 else strategy.scale(layout, payload, factor) for payload, factor in kept]

    def weights(self, payloads: Sequence[Payload], messages: Sequence[Payload], sites: Sequence[str] | None = None) -> Weights:
        """What the rule decides for these uploads, as :meth:`weigh` would, nothing kept: the
        factors of this phase alone (an earlier phase's bind them further in ``weigh``)."""
        return self._decide(payloads, messages, sites).weights

    def _decide(self, payloads: Sequence[Payload], messages: Sequence[Payload], sites: Sequence[str] | None) -> Decision:
        strategy = self.strategy
        terms = [self._update_terms(payload, messages) for payload in payloads]
        step, phase = payloads[0].step, payloads[0].phase
        agreement = self.agreement and strategy.uploads_agree(step, phase) and len(payloads) <= MAX_AGREEMENT_SITES
        G = None
        if agreement:
            try:
                G = gram(terms)
            except UnpairedForms as exc:  # exact or nothing: this step is clipped only
                log.warning("step %d phase %d: no agreement weights (%s)", step, phase, exc)
                agreement = False
        if G is None:
            G = torch.diag(torch.tensor(self._sq_norms(payloads, terms), dtype=torch.float64))
        basis = strategy.chooses_basis(step, phase)
        clip_ratio = min(self.clip_ratio, BASIS_CLIP_RATIO) if basis and self.clip_ratio else self.clip_ratio
        earlier = self.weighed if phase > 0 and self.weighed.get("step") == step else None
        standing = earlier.get("standing", self.standing) if earlier else self.standing
        peer_standing = earlier.get("peer_standing", self.peer_standing) if earlier else self.peer_standing
        before = [standing.get(site, 0.0) for site in sites] if sites is not None and agreement else None
        peers_before = [peer_standing.get(site, 0.0) for site in sites] if before is not None else None
        recent = earlier.get("recent_norms", self.recent_norms) if earlier else self.recent_norms
        # a phase that only chooses a basis is clipped by this step's median alone (BASIS_CLIP_RATIO)
        history = [recent.get(site, {}).get(phase, []) for site in sites] if sites is not None and clip_ratio and not basis else None
        updates = momentum = None
        if before is not None and self._momentum_fits(len(sites)) and strategy.momenta_agree(step, phase):
            try:
                updates = [formed(t, self.numels) for t in terms]
                momentum = self._momentum([self.momenta.get(site, {}).get(phase, {}) for site in sites], updates)
            except UnpairedForms as exc:  # this step's agreement reads the step alone
                updates = None
                if not self.momentum_warned:
                    log.warning("step %d phase %d: agreement on this step alone, no momentum (%s); told once", step, phase, exc)
                    self.momentum_warned = True
        weights = robust_weights(
            G, clip_ratio, agreement, self.agreement_margin, before, self.standing_weight, history, peers_before, momentum,
            [payload.num_samples for payload in payloads], self.full_count_share,
        )
        names = list(sites) if sites is not None else None
        here = _positions(earlier, names, len(payloads)) if earlier else {}  # earlier index -> this phase's
        factors = list(weights.factors)
        for i, j in here.items():  # a site refused between the phases is gone; the others keep their bound
            factors[j] = min(factors[j], earlier["factors"][i])
        return Decision(weights, factors, earlier, here, basis, standing, peer_standing, before, peers_before, recent, history, updates)

    def _momentum_fits(self, sites: int) -> bool:
        if not self.momentum:
            return False
        if sites * sum(self.numels.values()) <= MAX_MOMENTUM_ELEMENTS:
            return True
        if not self.momentum_warned:
            log.warning(
                "%d sites x %d parameters is above the %d elements of momenta the coordinator keeps: agreement reads each "
                "step alone (docs/robustness.md); told once", sites, sum(self.numels.values()), MAX_MOMENTUM_ELEMENTS,
            )
            self.momentum_warned = True
        return False

    def _momentum(self, momenta: list[dict[str, torch.Tensor]], updates: list[dict[str, torch.Tensor]]) -> Momentum:
        """⟨m_i, m_j⟩ and ⟨m_i, g_j⟩ of the sites' momenta (float32, as kept) and this step's
        updates, in float64, one stacked product per parameter; a name held at two sizes raises
        ``UnpairedForms``."""
        S = len(updates)
        before = torch.zeros(S, S, dtype=torch.float64)
        with_update = torch.zeros(S, S, dtype=torch.float64)
        for name in sorted({name for held in (*momenta, *updates) for name in held}):
            sizes = {held[name].numel() for held in (*momenta, *updates) if name in held}
            if len(sizes) > 1:
                raise UnpairedForms(f"{name!r} held at sizes {sorted(sizes)}")
            size = sizes.pop()
            width = max(1, STACKED_ELEMENTS // S)  # a slice of every site's at a time: bounded memory for any layer
            for start in range(0, size, width):
                part = slice(start, min(size, start + width))
                zeros = torch.zeros(part.stop - start, dtype=torch.float64)
                kept = torch.stack([m[name][part].double() if name in m else zeros for m in momenta])
                now = torch.stack([g[name][part] if name in g else zeros for g in updates])
                before += kept @ kept.T
                with_update += kept @ now.T
        return Momentum(self.momentum, before.tolist(), with_update.tolist())

    def _remember(self, decision: Decision, step: int, phase: int, sites: Sequence[str] | None) -> None:
        weights, factors, earlier, here, basis = decision.weights, decision.factors, decision.earlier, decision.here, decision.basis
        standing, peer_standing, before, peers_before = decision.standing, decision.peer_standing, decision.before, decision.peers_before
        recent, history = decision.recent, decision.history
        names = list(sites) if sites is not None else None

        def mapped(key: str) -> set[int]:  # an earlier phase's sites of ``key``, at their places in this phase
            return {here[i] for i in earlier.get(key, ()) if i in here} if earlier else set()

        clipped, disagreeing = set(weights.clipped) | mapped("clipped"), set(weights.disagreeing) | mapped("disagreeing")
        basis_clipped = mapped("basis_clipped")
        if basis:  # its factors bind no later phase; the sites it clipped are recorded apart
            basis_clipped, clipped = basis_clipped | clipped, set()
        self.weighed = {
            "step": step, "sites": names, "factors": [1.0] * len(factors) if basis else factors, "clipped": sorted(clipped),
            "disagreeing": sorted(disagreeing), "basis_clipped": sorted(basis_clipped), "undiluted": weights.undiluted,
        }
        if before is not None and weights.push_backs is not None:
            standing, peer_standing = dict(standing), dict(peer_standing)
            standing.update({site: updated_standing(b, push, self.standing_weight) for site, b, push in zip(sites, before, weights.push_backs)})
            peer_standing.update({
                site: updated_standing(b, push, self.standing_weight)
                for site, b, push in zip(sites, peers_before, weights.peer_push_backs) if push is not None
            })
        if standing is not self.standing:
            self.weighed["standing"] = standing
        if peer_standing is not self.peer_standing:
            self.weighed["peer_standing"] = peer_standing
        if history is not None:
            recent = dict(recent)
            for site, past, norm in zip(sites, history, weights.norms):
                recent[site] = {**recent.get(site, {}), phase: recorded_norms(past, norm)}
        if recent is not self.recent_norms:
            self.weighed["recent_norms"] = recent
        if decision.updates is not None:  # what each site sent, clipped, zeroed or not: an honest site zeroed once recovers
            momenta = dict(earlier.get("momenta", self.momenta) if earlier else self.momenta)
            for site, update, a in zip(sites, decision.updates, weights.clip):
                kept = momenta.get(site, {}).get(phase, {})
                new = {}
                for name in sorted(kept.keys() | update.keys()):
                    value = a * update[name] if name in update else torch.zeros(kept[name].numel(), dtype=torch.float64)
                    if name in kept:
                        value = value + self.momentum * kept[name].double()
                    new[name] = value.float()
                momenta[site] = {**momenta.get(site, {}), phase: new}
            self.weighed["momenta"] = momenta

    def _sq_norms(self, payloads: Sequence[Payload], terms: Sequence) -> list[float]:
        """‖update‖² of each upload: as ``refusals`` measured them, else computed from ``terms``."""
        known = [self.measured.get(id(payload)) for payload in payloads]
        if all(entry is not None and entry[0] is payload for entry, payload in zip(known, payloads)):
            return [entry[2] for entry in known]
        return sq_norms(terms)

    def _update_terms(self, payload: Payload, messages: Sequence[Payload]):
        known = self.measured.get(id(payload))
        if known is not None and known[0] is payload:
            return known[1]
        return self.strategy.terms(self.replica.layout, payload, messages, self.replica.model)[0]

    def commit(self, step: int, names: Sequence[str]) -> dict:
        """``step`` is committed: the sites' standing it measured takes effect. Returns what the
        metrics keep of its factors, by site name (uploads' order): the factor of every site
        below 1, the sites clipped and those zeroed for disagreeing, and the standing of the
        step's sites."""
        weighed = self.weighed if self.weighed.get("step") == step else {}
        self.standing = weighed.get("standing", self.standing)
        self.peer_standing = weighed.get("peer_standing", self.peer_standing)
        self.recent_norms = weighed.get("recent_norms", self.recent_norms)
        self.momenta = weighed.get("momenta", self.momenta)
        if len(weighed.get("factors", ())) != len(names):
            return {}
        self._watch_zeroed(step, [names[i] for i in weighed["disagreeing"]])
        return {
            "robust_factors": {name: f for name, f in zip(names, weighed["factors"]) if f != 1.0},
            "robust_clipped": [names[i] for i in weighed["clipped"]],
            "robust_disagreeing": [names[i] for i in weighed["disagreeing"]],
            "robust_basis_clipped": [names[i] for i in weighed.get("basis_clipped", ())],
            **({"robust_undiluted": round(weighed["undiluted"], 4)} if weighed.get("undiluted", 1.0) != 1.0 else {}),
            **({"robust_standing": {name: round(self.standing[name], 4) for name in names if name in self.standing}} if "standing" in weighed else {}),
            **({"robust_peer_standing": {name: round(self.peer_standing[name], 4) for name in names if name in self.peer_standing}}
               if "peer_standing" in weighed else {}),
        }

    def _watch_zeroed(self, step: int, zeroed: Sequence[str]) -> None:
        """Tell the operator, once per window, of a site that agreement zeroed in a large share of
        the last ``ZEROED_WINDOW`` committed steps: an attacker, a free rider, or a site whose data differ from
        the others' (an honest hospital with other patients pushes back on the others too). The
        log names the site, never a value of its data."""
        self.zeroed_recently.append(frozenset(zeroed))
        del self.zeroed_recently[:-ZEROED_WINDOW]
        if len(self.zeroed_recently) < ZEROED_WINDOW or step < self.zeroed_warned_until:
            return
        counts = Counter(site for sites in self.zeroed_recently for site in sites)
        often = sorted(site for site, count in counts.items() if count >= ZEROED_WARN_SHARE * ZEROED_WINDOW)
        if often:
            log.warning(
                "agreement gave %s weight 0 in %s of the last %d steps: a site that pushes the model back or adds nothing, or one "
                "whose data differ from the others' (label skew pushes back honestly); if the sites' data differ, raise "
                "federation.agreement_margin or set federation.agreement = false (docs/robustness.md)",
                ", ".join(printable(site) for site in often), ", ".join(str(counts[site]) for site in often), ZEROED_WINDOW,
            )
            self.zeroed_warned_until = step + ZEROED_WINDOW

    def message(
        self, half: Any, payloads: Sequence[Payload], messages: Sequence[Payload], remember: bool = True, sites: Sequence[str] | None = None
    ) -> tuple[Payload, Payload, Decoded]:
        """Weigh (``sites``: as :meth:`weigh`), aggregate, and decode what sites will decode: (message,
        as sites receive it, update after this phase, decoded again when read). Raises when the
        message would fail at a site."""
        message = half.aggregate(self.weigh(payloads, messages, remember, sites))
        sent = roundtrip(message, self.codec)
        for key, tensor in sent.tensors.items():
            if not all_finite(tensor):
                raise ValueError(f"the aggregated {key!r} is not finite on the wire")
        update = Decoded(self.replica, (*messages, sent))  # checked one parameter at a time, never held whole
        check_update(self.facts, update)
        if remember:  # the phase's uploads are aggregated: their terms (and payloads) are not held further
            self.measured = {}
        return message, sent, update

    def passes(self, start: dict, payloads: Sequence[Payload], messages: Sequence[Payload]) -> bool:
        """Whether these uploads alone make a message every site can decode, tried on a fresh
        server half in ``start`` (the phase's start state) so the real one is untouched."""
        half = self.strategy.server(self.replica.layout, self.replica.model)
        half.load_state_dict(start)
        try:
            self.message(half, payloads, messages, remember=False)
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
