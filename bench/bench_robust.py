"""Bounded influence against an adaptive site (a benchmark, not a test).

    nice -n 10 python -m bench.bench_robust [--steps 150] [--seeds 0] [--out bench-robust.json]

digits-mlp, 4 IID sites (3 honest + 1 attacker), batch 32 per site, SGD 0.1. Each step runs
in one process what the gRPC coordinator runs between the uploads and the message
(``dadfl/trust/screening.py``: the strategy's checks, the influence bound ``max_influence_ratio``
= 100, then the robust rule's weights, the aggregation, the message as sites decode it):
the sites' halves, the coordinator's screening and every replica are the real ones, only
the bytes do not cross a socket. The attacker computes its genuine upload each phase and
then attacks the gradient-carrying tensors (dense gradients, Δ, lookups' Δ rows, P, and
PowerSGD's Q):

- ``x50``: × 50, every phase; ``flip20``: × −20;
- ``under``: scaled to 0.99 × the influence bound (100 × the others' median norm), the
  largest the refusal rule accepts; ``under-flip``: the same, sign flipped;
- ``margin-flip``: its genuine upload negated and scaled as far (up to 20×) as the agreement
  rule keeps it at a weight above 0, or, where even 0 is not kept, sent forward (up to 1×)
  as little as keeps it: the attacker knowing every site's upload, both standings of every
  site and the clip's history, just inside the agreement rule;
- ``shrink``: its genuine upload scaled down, never negated, as far (down to 0) as the agreement
  rule keeps it at a weight above 0 (knowing what ``margin-flip`` knows): a site that only
  withholds, whose upload points where its gradient does; what it costs is the honest mean's
  dilution by the part of its share of the samples that it withholds;
- ``withhold``: as ``shrink``, but only as far as the rule still counts it as a whole site in the
  mean (its count 1): what a site that only withholds keeps from the others once the mean is
  over the samples that count;
- ``blind-margin``, ``blind-shrink``: ``margin-flip`` and ``shrink`` with what a site can know
  when it uploads: the others' uploads of the last step stand for this step's (a site learns
  them, or their sum, from the step's message); every standing and the clip's history as the
  coordinator holds them (more than a site knows);
- ``blind-flip``: the same without seeing the others' uploads: the attacker takes the
  direction of the last message it received for the others' sum and its own norm for their
  median, estimates its standing and its peers' from those, and keeps its estimated score
  below its estimated bound less 0.1 β (one-phase strategies whose messages are updates:
  dSGD, dAD, auto, FedAvg);
- ``ortho``: across the others' sum: its genuine gradient's part orthogonal to the honest
  sites' sum (with ``--momentum``, their momenta), negated, at the clip's bound, turned towards
  it only as far as agreement needs to keep it (knowing every upload, standing, momentum and
  the clip's history; dSGD, whose upload
  can be any vector). Agreement measures a site along the others' sum only, so this is what
  a site inside the rule can still do (``docs/robustness.md``); ``blind-ortho``: the same
  with what a site sees (the last message for the others' sum, estimates as ``blind-flip``);
- ``zero``: its upload times 0, its sample count as it is: a site that adds nothing (a free
  rider), which would slow the federation by its share of the samples if it stayed in the
  mean; it pushes back by 0, more than honest peers do among themselves on IID data;
- ``drift``: a constant tensor (drawn once per key, 10% of the first upload's mean |entry|)
  added every phase.

A refused upload drops the attacker for the rest of that step (it rejoins the next, as a
dropped site does); a step whose message fails is aborted (nothing applied). Reported per
strategy and attack: final test accuracy, that of the 3 honest sites alone (``clean``), the
mean, lowest and highest of each after each of the last 10 steps (how much the final figure
moves from one step to the next), the attacker's refusals, the fraction of steps where the
attacker's factor was below 1, honest refusals, the fraction of honest (site, step) pairs with
a factor below 1, and the fractions of steps where some honest site was clipped, zeroed by the
agreement rule, or either (the step is then not plain averaging), and where some honest site
was clipped in a phase that only chooses a basis (PowerSGD's P_s: ``Strategy.chooses_basis``),
and where the kept sites were scaled up for a site that counts less (``undiluted``, with the
mean of that factor over those steps).
The ``clean4`` row is 4 honest sites (the 4th counted as the attacker's column): the
clean runs' rates.
``--clip-ratio``/``--no-agreement``/``--agreement-margin``/``--full-count-share``/``--momentum`` change the rule
(``--momentum 0.9``: agreement on the sites' momenta, ``federation.agreement_momentum``); ``--off`` runs without it (the table
before).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from dadfl.replica import OptimizerConfig, Replica
from dadfl.trust.screening import Screening
from dadfl.strategies import make_strategy
from dadfl.strategies.base import split_key
from dadfl.strategies.checks import medians_of_the_others
from dadfl.strategies.gram import gram
from dadfl.strategies.robust import DEFAULT_CLIP_RATIO, agreement_bound, history_references
from dadfl.workloads import load_workload, partition, site_batches

STRATEGIES = {
    "dsgd": ("dsgd", {}),
    "dad": ("dad", {}),
    "auto": ("auto", {}),
    "rankdad r=2": ("rankdad", {"rank": 2}),
    "powersgd r=2": ("powersgd", {"rank": 2}),
    "fedavg H=4": ("fedavg", {"local_steps": 4}),
}
ATTACKS = ("clean4", "x50", "flip20", "under", "under-flip", "margin-flip", "shrink", "withhold", "blind-margin", "blind-shrink", "blind-flip", "ortho", "blind-ortho", "zero", "drift")
SITES, BATCH, LR, MAX_RATIO = 4, 32, 0.1, 100.0
ATTACKER = SITES - 1
RECENT_STEPS = 10  # the test accuracy after each of a run's last steps: the final figure's step-to-step noise
BLIND_STRATEGIES = ("dsgd", "dad", "auto", "fedavg H=4")  # one phase, a message that is the update (blind-flip)
ORTHO_STRATEGIES = ("dsgd",)  # uploads that are the dense gradient: any vector can be sent (ortho, blind-ortho)
PARTITION = {"scheme": "iid", "alpha": 0.5}  # how the training set is split (the command line's --partition, --alpha)
RULE: dict = {}  # the agreement rule's margin and standing weight where the command line sets them


def attacked(payload, roles, change):
    tensors = {k: change(k, t) if split_key(k)[1] in roles and t.is_floating_point() else t for k, t in payload.tensors.items()}
    return type(payload)(payload.step, payload.phase, payload.num_samples, tensors)


def flat_tensors(payload, keys: list[str] | None = None) -> torch.Tensor:
    """A dense upload (or message) as one float64 vector, its tensors in ``keys``' order."""
    return torch.cat([payload.tensors[k].reshape(-1).double() for k in (keys or list(payload.tensors))])


def dense_upload(genuine, vector: torch.Tensor):
    """``genuine`` with its tensors replaced by ``vector``, cut in their shapes and order."""
    tensors, offset = {}, 0
    for key, tensor in genuine.tensors.items():
        tensors[key] = vector[offset:offset + tensor.numel()].reshape(tensor.shape).to(tensor.dtype)
        offset += tensor.numel()
    return type(genuine)(genuine.step, genuine.phase, genuine.num_samples, tensors)


class Attacker:
    def __init__(self, kind: str, strategy, screening: Screening, standing: bool = True):
        self.kind, self.strategy, self.screening, self.standing = kind, strategy, screening, standing
        self.roles = {"grad", "D", "rows", "P"} | ({"Q"} if strategy.name == "powersgd" else set())
        self.drift: dict[str, torch.Tensor] = {}
        self.last_message = None  # blind-flip: the last step's message, as every site receives it
        self.estimated_standing = 0.0  # blind-flip: its standing as it estimates it
        self.estimated_peers = 0.0  # blind-flip: its peers' standing as it estimates it
        self.previous: dict[int, list] = {}  # blind-margin, blind-shrink: the others' uploads of the last step, by phase

    def __call__(self, payloads: list, messages: list) -> list:
        genuine = payloads[ATTACKER]
        if self.kind == "x50":
            bad = attacked(genuine, self.roles, lambda k, t: t * 50)
        elif self.kind == "flip20":
            bad = attacked(genuine, self.roles, lambda k, t: t * -20)
        elif self.kind in ("under", "under-flip"):
            layout, model = self.screening.replica.layout, self.screening.replica.model
            norms = [self.strategy.contribution(layout, p, messages, model)["update"] for p in payloads]
            bound = 0.99 * MAX_RATIO * medians_of_the_others(norms)[ATTACKER]
            factor = bound / norms[ATTACKER] if norms[ATTACKER] else 1.0
            factor = -factor if self.kind == "under-flip" else factor
            bad = attacked(genuine, self.roles, lambda k, t: t * factor)
        elif self.kind == "margin-flip":
            bad = attacked(genuine, self.roles, lambda k, t: t * -self.margin_scale(payloads, messages))
        elif self.kind == "shrink":
            bad = attacked(genuine, self.roles, lambda k, t: t * -self.margin_scale(payloads, messages, largest=0.0))
        elif self.kind == "withhold":
            bad = attacked(genuine, self.roles, lambda k, t: t * -self.margin_scale(payloads, messages, largest=0.0, whole=True))
        elif self.kind == "blind-margin":
            bad = attacked(genuine, self.roles, lambda k, t: t * -self.stale_margin_scale(payloads, messages))
        elif self.kind == "blind-shrink":
            bad = attacked(genuine, self.roles, lambda k, t: t * -self.stale_margin_scale(payloads, messages, largest=0.0))
        elif self.kind == "blind-flip":
            bad = attacked(genuine, self.roles, lambda k, t: t * -self.blind_scale(genuine, messages))
        elif self.kind == "ortho":
            bad = self.orthogonal(payloads, messages)
        elif self.kind == "blind-ortho":
            bad = self.blind_orthogonal(genuine)
        elif self.kind == "zero":
            bad = attacked(genuine, self.roles, lambda k, t: t * 0)
        elif self.kind == "drift":
            def add(key, tensor):
                if key not in self.drift or self.drift[key].shape != tensor.shape:
                    generator = torch.Generator().manual_seed(len(self.drift))
                    self.drift[key] = 0.1 * float(tensor.abs().mean()) * torch.randn(tensor.shape, generator=generator).sign()
                return tensor + self.drift[key].to(tensor.dtype)
            bad = attacked(genuine, self.roles, add)
        else:
            bad = genuine
        return [*payloads[:ATTACKER], bad]

    def kept(self, payloads: list, messages: list, whole: bool = False) -> bool:
        """Whether the rule, as the coordinator holds it now (every site's standings, momenta and
        the clip's history, unless the run is per step), keeps the attacker among ``payloads``;
        ``whole``: and counts it as a whole site in the mean."""
        sites = [str(i) for i in range(len(payloads))] if self.standing else None
        weights = self.screening.weights(payloads, messages, sites)
        return ATTACKER not in weights.disagreeing and (not whole or weights.counts is None or weights.counts[ATTACKER] >= 1.0)

    def margin_scale(self, payloads: list, messages: list, largest: float = 20.0, whole: bool = False) -> float:
        """The largest s in [−1, ``largest``] at which −s × the genuine upload is not zeroed by agreement
        (``whole``: and counts as a whole site in the mean), the attacker knowing every upload, every
        site's standing and the clip's history (bisection on the rule itself)."""
        step, phase = payloads[0].step, payloads[0].phase
        if not self.strategy.uploads_agree(step, phase):
            return largest

        def kept(scale: float) -> bool:
            return self.kept([*payloads[:ATTACKER], attacked(payloads[ATTACKER], self.roles, lambda k, t: t * -scale)], messages, whole)

        if kept(largest):
            return largest
        low, high = -1.0, largest
        for _ in range(30):
            middle = (low + high) / 2
            low, high = (middle, high) if kept(middle) else (low, middle)
        return low

    def stale_margin_scale(self, payloads: list, messages: list, largest: float = 20.0) -> float:
        """``margin_scale`` with the others' uploads of the last step standing for this step's: what a
        site can know (it learns them once the step is done: the message carries them, or their sum),
        with every standing and the clip's history as the coordinator holds them (more than a site
        knows)."""
        genuine, phase = payloads[ATTACKER], payloads[ATTACKER].phase
        previous, self.previous[phase] = self.previous.get(phase), payloads[:ATTACKER]
        if previous is None:
            return -1.0  # nothing to estimate from yet: its genuine upload
        others = [type(p)(genuine.step, p.phase, p.num_samples, p.tensors) for p in previous]
        return self.margin_scale([*others, genuine], messages, largest)

    def orthogonal(self, payloads: list, messages: list):
        """Its genuine gradient negated, with the part along the others' sum replaced by just enough
        pull forward to be kept: v = L (cos θ · (−ĝ⊥) + sin θ · û), û the direction of the honest
        sites' sum, ĝ⊥ that of its own gradient's part orthogonal to it, L the clip's bound (with the
        clip's history), θ the smallest that agreement keeps (bisection on the rule itself; dense
        uploads: dSGD). Where agreement reads momenta, û is the direction of the honest sites'
        momenta after this step (μ m_j + g_j), the direction the rule measures it along."""
        genuine = payloads[ATTACKER]
        own, others = flat_tensors(genuine), sum(flat_tensors(p) for p in payloads[:ATTACKER])
        rule = self.screening
        if self.standing and rule.momentum and rule.momenta:
            ones = {}  # per payload key, the honest sites' momenta after this step (mean units)
            for i, p in enumerate(payloads[:ATTACKER]):
                kept = rule.momenta.get(str(i), {}).get(genuine.phase, {})
                for key, tensor in p.tensors.items():
                    name = split_key(key)[0]
                    now = tensor.double().reshape(-1) / p.num_samples
                    ones[key] = ones.get(key, 0) + now + (rule.momentum * kept[name].double() if name in kept else 0)
            others = torch.cat([ones[key] for key in genuine.tensors])
        forward = others / others.norm()
        across = -(own - (own @ forward) * forward)
        across = across / across.norm()
        phase = genuine.phase
        history = [rule.recent_norms.get(str(i), {}).get(phase, []) for i in range(len(payloads))]
        honest_norms = [float(flat_tensors(p).norm()) for p in payloads[:ATTACKER]]
        length = rule.clip_ratio * max(statistics.median(honest_norms), history_references(history)[ATTACKER])

        def upload(theta: float):
            return dense_upload(genuine, length * (math.cos(theta) * across + math.sin(theta) * forward))

        def kept(theta: float) -> bool:
            return self.kept([*payloads[:ATTACKER], upload(theta)], messages)

        low, high = 0.0, math.pi / 2
        if kept(low):
            return upload(low)
        for _ in range(20):
            middle = (low + high) / 2
            low, high = (low, middle) if kept(middle) else (middle, high)
        return upload(high)

    def blind_orthogonal(self, genuine):
        """``ortho`` without seeing the others' uploads: the last message's direction ℓ̂ stands for
        their sum and its own norm for their median; it sends c ‖g‖ (cos θ · (−ĝ⊥) + sin θ · ℓ̂),
        ĝ⊥ its gradient's part orthogonal to ℓ̂, with θ the smallest whose estimated push-back
        (−c sin θ) keeps its estimated score below its estimated bound less 0.1 β, the peers'
        standing estimated as for ``blind-flip``."""
        if self.last_message is None:
            return genuine  # nothing to estimate from yet: its genuine upload
        own, last = flat_tensors(genuine), flat_tensors(self.last_message, list(genuine.tensors))
        forward = last / last.norm()
        cosine = float(own @ forward / own.norm())
        across = -(own - (own @ forward) * forward)
        across = across / across.norm()
        rule, weight = self.screening, self.screening.standing_weight
        self.estimated_peers = weight * self.estimated_peers + (1 - weight) * -cosine
        limit = agreement_bound(self.estimated_peers, rule.agreement_margin) - 0.1 * rule.agreement_margin
        push = min(0.0, (limit - weight * self.estimated_standing) / (1 - weight))  # the largest it may show, at most 0
        sine = min(1.0, -push / rule.clip_ratio)
        self.estimated_standing = weight * self.estimated_standing + (1 - weight) * -rule.clip_ratio * sine
        theta = math.asin(sine)
        return dense_upload(genuine, rule.clip_ratio * float(own.norm()) * (math.cos(theta) * across + math.sin(theta) * forward))

    def blind_scale(self, genuine, messages: list) -> float:
        """The largest s in [−1, 20] whose estimated score stays below its estimated bound: push-back
        estimated as s · ‖g‖ (at most c · ‖g‖) times the cosine of its genuine update with the last
        message; the peers' standing as the average of the push-back its genuine update would have
        there (−cosine), and the bound from that, less 0.1 β. Below 0 it sends its gradient forward, to
        earn the standing it spends."""
        if self.last_message is None:
            return 0.0  # nothing to estimate from yet: send nothing
        layout, model, rule = self.screening.replica.layout, self.screening.replica.model, self.screening
        own, last = self.strategy.terms(layout, genuine, messages, model)[0], self.strategy.terms(layout, self.last_message, [], model)[0]
        G = gram([own, last])
        norm, cosine = math.sqrt(G[0, 0]), float(G[0, 1] / math.sqrt(G[0, 0] * G[1, 1])) if G[0, 0] * G[1, 1] > 0 else 0.0
        weight = rule.standing_weight
        self.estimated_peers = weight * self.estimated_peers + (1 - weight) * -cosine
        limit = agreement_bound(self.estimated_peers, rule.agreement_margin) - 0.1 * rule.agreement_margin
        scale = 20.0 if cosine <= 0 else min(20.0, (limit - weight * self.estimated_standing) / ((1 - weight) * cosine))
        scale = max(scale, -1.0)
        push = min(scale, rule.clip_ratio) * cosine if norm else 0.0  # a clipped site sends c · ‖g‖ at most
        self.estimated_standing = weight * self.estimated_standing + (1 - weight) * push
        return scale


def run(
    label: str, attack: str, steps: int, seed: int, clip_ratio: float | None, agreement: bool, honest_only: bool = False, standing: bool = True,
) -> dict:
    name, options = STRATEGIES[label]
    torch.manual_seed(seed)
    workload = load_workload("digits-mlp")
    strategy = make_strategy(name, **options)
    train = workload.training_data()
    indices = partition(SITES, len(train), PARTITION["scheme"], labels=workload.labels, alpha=PARTITION["alpha"], seed=seed)
    count = SITES - 1 if honest_only else SITES
    batches = [site_batches(train, index, BATCH, seed=seed + s) for s, index in enumerate(indices[:count])]
    optimizer = OptimizerConfig(name="sgd", lr=LR)
    coordinator = Replica(workload, strategy, optimizer, "cpu")
    sites = [Replica(workload, strategy, optimizer, "cpu") for _ in range(count)]
    for site in sites:
        site.load_weights_from(coordinator)
    screening = Screening(coordinator, MAX_RATIO, None, clip_ratio=clip_ratio, agreement=agreement, **RULE)
    attacker = Attacker(attack if not honest_only else "clean4", strategy, screening, standing)
    server = strategy.server(coordinator.layout, coordinator.model)
    refused_attacker = refused_honest = aborted = 0
    attacker_weighed = honest_weighed = honest_clipped = honest_zeroed = honest_touched = honest_basis = undiluted = 0
    lengthened = 0.0  # the kept sites' common factor less 1, summed over the steps
    error, recent = None, []
    try:
        for step in range(steps):
            locals_ = [site.work(batch.at, step) for site, batch in zip(sites, batches)]
            payloads = [site.half.begin(local, step) for site, local in zip(sites, locals_)]
            active, messages, start = list(range(count)), [], server.state_dict()
            while True:
                if ATTACKER in active and not honest_only:
                    payloads = attacker([payloads[i] for i in range(count)], messages)
                screened = [payloads[i] for i in active]
                refused = screening.refusals(step, len(messages), screened, messages)
                refused_attacker += sum(active[i] == ATTACKER and not honest_only for i in refused)
                refused_honest += sum(active[i] != ATTACKER or honest_only for i in refused)
                active = [i for k, i in enumerate(active) if k not in refused]
                try:
                    site_ids = [str(i) for i in active] if standing else None
                    _, sent, _ = screening.message(server, [payloads[i] for i in active], messages, sites=site_ids)
                except Exception:
                    server.load_state_dict(start)
                    aborted += 1
                    messages = None
                    break
                messages.append(sent)
                replies = [site.half.receive(sent) for site in sites]
                if all(r is None for r in replies):
                    break
                payloads = replies
            if messages is None:
                continue  # as an aborted step: every replica keeps its weights
            attacker.last_message = messages[-1]
            weighed = screening.weighed if screening.weighed.get("step") == step else {}
            screening.commit(step, [str(i) for i in active])
            factors = weighed.get("factors", [1.0] * len(active))
            honest_sites = [k for k, i in enumerate(active) if i != ATTACKER or honest_only]
            attacker_weighed += any(f < 1.0 for k, f in enumerate(factors) if k not in honest_sites)
            honest_weighed += sum(factors[k] < 1.0 for k in honest_sites)
            honest_clipped += any(k in honest_sites for k in weighed.get("clipped", ()))
            honest_zeroed += any(k in honest_sites for k in weighed.get("disagreeing", ()))
            honest_touched += any(factors[k] < 1.0 for k in honest_sites)
            honest_basis += any(k in honest_sites for k in weighed.get("basis_clipped", ()))
            undiluted += weighed.get("undiluted", 1.0) > 1.0
            lengthened += weighed.get("undiluted", 1.0) - 1.0
            fingerprints = {replica.apply(messages) for replica in [*sites, coordinator]}
            if len(fingerprints) != 1:
                raise RuntimeError(f"replicas differ after step {step}")
            if step >= steps - RECENT_STEPS:
                recent.append(coordinator.evaluate()[workload.metric_name])
    except Exception as exc:  # what the "before" table records: the run stops
        error = f"{type(exc).__name__}: {str(exc)[:120]}"
    accuracy = coordinator.evaluate()[workload.metric_name]
    honest = count if honest_only else count - 1
    return {
        "strategy": label, "attack": attack, "seed": seed, "accuracy": accuracy if math.isfinite(accuracy) else float("nan"),
        "recent_accuracy": recent, "error": error, "aborted": aborted, "refused_attacker": refused_attacker, "refused_honest": refused_honest,
        "attacker_weighed": attacker_weighed / steps, "honest_weighed": honest_weighed / (steps * honest),
        "steps_honest_clipped": honest_clipped / steps, "steps_honest_zeroed": honest_zeroed / steps,
        "steps_honest_touched": honest_touched / steps, "steps_honest_basis_clipped": honest_basis / steps,
        "steps_undiluted": undiluted / steps, "mean_undiluted": 1.0 + lengthened / undiluted if undiluted else 1.0,
    }


def spread(row: dict) -> str:
    """The mean, lowest and highest test accuracy after each of a run's last ``RECENT_STEPS`` steps."""
    recent = row["recent_accuracy"]
    return f"mean {statistics.fmean(recent):.3f} {min(recent):.3f}-{max(recent):.3f}" if recent else "-"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument(  # blind-flip and ortho serve some strategies only: asked for by name
        "--attacks", nargs="+", default=[a for a in ATTACKS if a not in ("blind-flip", "ortho", "blind-ortho")], choices=list(ATTACKS)
    )
    parser.add_argument("--clip-ratio", type=float, default=DEFAULT_CLIP_RATIO)
    parser.add_argument("--no-agreement", action="store_true")
    parser.add_argument("--agreement-margin", type=float, default=None, help="beta (default: the rule's)")
    parser.add_argument("--standing-weight", type=float, default=None, help="lambda (default: the rule's)")
    parser.add_argument("--full-count-share", type=float, default=None, help="k, the share of its peers' pull a site counts whole at (default: the rule's)")
    parser.add_argument("--momentum", type=float, default=None, help="mu, 0: agreement on each step's updates alone (default: the rule's)")
    parser.add_argument("--partition", choices=["iid", "dirichlet", "quantity"], default="iid", help="how the sites' data is split")
    parser.add_argument("--alpha", type=float, default=0.5, help="the Dirichlet concentration of a non-IID split")
    parser.add_argument("--per-step", action="store_true", help="agreement from each step alone, without the sites' standing")
    parser.add_argument("--off", action="store_true", help="no robust rule: only the refusals (the table before)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    unsupported = [label for label in args.strategies if label not in BLIND_STRATEGIES]
    if "blind-flip" in args.attacks and unsupported:
        parser.error(f"blind-flip estimates from the last message, which is no update for {', '.join(unsupported)}; drop them or the attack")
    unsupported = [label for label in args.strategies if label not in ORTHO_STRATEGIES]
    if {"ortho", "blind-ortho"} & set(args.attacks) and unsupported:
        parser.error(f"ortho and blind-ortho send a vector of their choosing, which {', '.join(unsupported)} cannot carry; drop them or the attack")
    clip, agreement = (None, False) if args.off else (args.clip_ratio, not args.no_agreement)
    torch.set_num_threads(1)
    PARTITION.update(scheme=args.partition, alpha=args.alpha)
    RULE.update({
        k: v for k, v in (
            ("agreement_margin", args.agreement_margin), ("standing_weight", args.standing_weight), ("momentum", args.momentum),
            ("full_count_share", args.full_count_share),
        )
        if v is not None
    })
    rows = []
    for label in args.strategies:
        for seed in args.seeds:
            clean = run(label, "clean", args.steps, seed, clip, agreement, honest_only=True, standing=not args.per_step)
            for attack in args.attacks:
                row = run(label, attack, args.steps, seed, clip, agreement, standing=not args.per_step)
                row["clean_accuracy"] = clean["accuracy"]
                rows.append(row)
                print(
                    f"{label:14s} {attack:10s} seed {seed}: acc {row['accuracy']:.3f} (clean {clean['accuracy']:.3f}) "
                    f"last {RECENT_STEPS} steps {spread(row)} (clean {spread(clean)}) "
                    f"refused attacker {row['refused_attacker']} honest {row['refused_honest']} aborted {row['aborted']} "
                    f"attacker<1 {row['attacker_weighed']:.2f} honest<1 {row['honest_weighed']:.3f} "
                    f"steps honest clipped {row['steps_honest_clipped']:.3f} zeroed {row['steps_honest_zeroed']:.3f} "
                    f"either {row['steps_honest_touched']:.3f} basis clipped {row['steps_honest_basis_clipped']:.3f} "
                    f"undiluted {row['steps_undiluted']:.3f} (mean factor {row['mean_undiluted']:.3f})"
                    + (f" STOPPED {row['error']}" if row["error"] else ""),
                    flush=True,
                )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
