"""``dadfl.privacy.coordinator`` — the coordinator's half of [dp], a step between the strategy's aggregate and the wire.

The strategy's server half aggregates and checks the sites' uploads as always; its
message is decoded here into the clipped sum and never sent. ``release`` replaces it by
the dense noisy update (:class:`CoordinatorNoise`): the only thing sites receive in a step.
Every release counts for the accountant — also one whose step is then aborted, since
sites have seen it — so ε is the value after ``releases`` sampled Gaussian steps.

**A crash loses no release.** The count is written to ``run_dir/dp_releases.json``
(atomically, fsync'd) *before* each release leaves ``release``, so it is never below what
sites have received, whenever the coordinator dies; a checkpoint only saves a copy, which
the file must not be below. A missing file beside a checkpoint that counted releases, or
an unreadable one, refuses the start: resetting the count would understate ε. The count
belongs to the run folder: a new run starts in a new ``run_dir`` (as for checkpoints).

**Fresh noise at every start.** The noise generator is seeded from the operating system
and never saved, so a step replayed after a restart gets new noise and counts as a new
release. Replaying the first noise would make the replay bit-identical but let a site that
received both releases subtract them when the participants differ. Privacy wins over
reproducibility: a resumed [dp] run is not bit-identical to an uninterrupted one.

**A ceiling on ε.** The coordinator never spends more than the ε it announces to the sites
(``RunConfig.dp.epsilon``, which they check against their own floor): ``target_epsilon``
when given, else ε after ``training.steps`` releases, whichever is lower. Replays after a
crash count, so a crashed run may stop before its last step.

Each site's expected batch is ``batch_size`` (its rate is batch_size / its records, at
most ``max_sample_rate``), so the expected batch of a step is batch_size × its sites.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Sequence

import torch

from dadfl.protos.codec import roundtrip
from dadfl.strategies import Layout, Payload
from dadfl.strategies.base import GRAD_ROLE, decode_message, tensor_key
from dadfl.strategies.sample_clipping import refuse_learning_buffers, refuse_sample_mixing

from .accounting import DPConfig, PrivacyBudget, log_plan, poisson_cap

log = logging.getLogger("dadfl.server")

STATE_PREFIX = "dp/"
RELEASES = "dp/releases"
RELEASES_FILE = "dp_releases.json"


class CoordinatorNoise:
    """The coordinator's Gaussian noise, from a generator nobody else holds.

    ``seed`` None (the coordinator) draws the seed from the operating system, anew at every
    start, and the generator is never saved: a replayed step gets fresh noise (module doc).
    A simulation may pass a seed so that a benchmark is reproducible.
    """

    def __init__(self, budget: PrivacyBudget, seed: int | None = None):
        self.budget = budget
        self.generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)

    def __repr__(self) -> str:  # never the generator's state
        return f"CoordinatorNoise(σ={self.budget.noise_multiplier:g}, C={self.budget.max_grad_norm:g})"

    def privatize(
        self, layout: Layout, update: dict[str, torch.Tensor], num_samples: int, expected: float, step: int
    ) -> Payload:
        """The noisy dense downlink: for every trainable parameter, (S + z) / B with
        S = update · N the clipped sum, z ~ N(0, σ²C²), B the expected batch."""
        if not expected > 0:
            raise ValueError(f"the expected batch must be positive, got {expected}")
        std = self.budget.noise_multiplier * self.budget.max_grad_norm
        tensors = {}
        for name, shape in zip(layout.params, layout.shapes):
            noise = torch.randn(shape, generator=self.generator)  # CPU, float32: the same numbers on every device
            clipped_sum = update.get(name)
            if clipped_sum is None:  # no sample reached it: the noise alone
                total = noise * std
            else:
                total = clipped_sum.detach().to(torch.float32).cpu() * num_samples + noise * std
            tensors[tensor_key(name, GRAD_ROLE)] = total / expected
        return Payload(step, 0, max(1, round(expected)), tensors)


def private_step(strategy, layout: Layout, model, site_halves: Sequence, server, locals_: Sequence, noise: CoordinatorNoise, expected: float, step: int) -> tuple[Payload, int]:
    """One step of a one-phase exact strategy under DP, in process: the sites' uploads, the
    strategy's aggregate decoded at the coordinator (the clipped sum, never sent), and the
    noisy dense downlink every replica applies. Returns (downlink, bytes up)."""
    payloads = [half.begin(local, step) for half, local in zip(site_halves, locals_)]
    total = sum(p.num_samples for p in payloads)
    update = strategy.decode(layout, [server.aggregate(payloads)], model) if payloads else {}
    return noise.privatize(layout, update, total, expected, step), sum(p.nbytes() for p in payloads)


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's saved half state: (the strategy's part, the privacy part)."""
    ours = {k: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
    return {k: v for k, v in state.items() if k not in ours}, ours


class ReleaseCount:
    """The durable count of releases of one run folder (see the module doc)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RELEASES_FILE
        self.value = self._read()

    def _read(self) -> int:
        if not self.path.exists():
            return 0
        try:
            value = json.loads(self.path.read_text())["releases"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            value = exc
        if type(value) is not int or value < 0:
            raise ValueError(
                f"{self.path} does not hold a release count ({{\"releases\": N}}); the differential-privacy account "
                "of this run folder is lost and ε cannot be stated: restore the file, or start the run in a new run_dir"
            )
        return value

    def add_one(self) -> None:
        """Count one release, on disk before the caller may send it."""
        tmp = self.path.with_name(RELEASES_FILE + ".tmp")
        with tmp.open("w") as file:
            file.write(json.dumps({"releases": self.value + 1}) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a power cut
        finally:
            os.close(folder)
        self.value += 1

    def check_checkpoint(self, saved: int) -> None:
        """A checkpoint's copy of the count may be behind the file, never ahead of it."""
        if saved > self.value:
            state = "is missing" if not self.path.exists() else f"counts {self.value}"
            raise ValueError(
                f"the checkpoint counted {saved} differential-privacy releases but {self.path} {state}: releases "
                "made after the checkpoint are unknown, so ε cannot be stated; restore the file, or start the run "
                "in a new run_dir"
            )


class ServerPrivacy:
    """The run's budget, the coordinator's noise and the count of releases (see the module doc)."""

    def __init__(self, config: DPConfig, batch_size: int, steps: int, model: torch.nn.Module, example_inputs, run_dir: Path):
        refuse_sample_mixing(model)  # what every site would refuse, refused before any site joins
        refuse_learning_buffers(model, example_inputs)
        self.config, self.batch_size = config, batch_size
        budget = PrivacyBudget.resolve(config, config.max_sample_rate, steps)
        ceiling = min(budget.epsilon(steps), config.target_epsilon or float("inf"))
        self.budget = dataclasses.replace(budget, stop_epsilon=ceiling)
        self.max_releases = self.budget.max_steps(steps)  # ε(steps) is the ceiling at most: never more releases
        self.noise = CoordinatorNoise(self.budget)
        self.count = ReleaseCount(run_dir)
        log_plan(self.budget, steps)
        if self.releases:
            log.warning("%s: the %d releases already made from this run folder count towards ε (%.3g so far)", self.count.path, self.releases, self.epsilon())

    @property
    def releases(self) -> int:
        return self.count.value

    def site_config(self) -> str:
        """``RunConfig.dp``: what the sites need to clip, sample and check their floor (not the noise)."""
        budget = self.budget
        return json.dumps({
            "max_grad_norm": budget.max_grad_norm, "max_sample_rate": budget.sample_rate,
            "noise_multiplier": budget.noise_multiplier, "delta": budget.delta, "epsilon": budget.stop_epsilon,
            "accountant": budget.accountant,
        })

    @property
    def max_samples(self) -> int:
        """The largest sample count an upload may claim (Poisson batches vary)."""
        return poisson_cap(self.batch_size)

    def stop_reason(self) -> str | None:
        """Why the run stops before its planned steps: one more release would pass the ε ceiling."""
        if self.releases < self.max_releases:
            return None
        return f"one more step would take ε above {self.budget.stop_epsilon:.4g} (ε = {self.epsilon():.4g} after {self.releases} releases)"

    def release(
        self, layout: Layout, clean_update: dict[str, torch.Tensor], num_samples: int, sites: int, step: int, codec: int,
    ) -> tuple[Payload, Payload, dict[str, torch.Tensor]]:
        """(message, as sites receive it, the update it carries): the noisy dense update
        replacing the strategy's message; counted on disk as one release before it is returned.

        The caller asks :meth:`stop_reason` before the sites compute the step (the coordinator
        does before every attempt), not here: by the time of a release the sites have uploaded,
        and each upload is already in their own privacy ledgers."""
        message = self.noise.privatize(layout, clean_update, num_samples, float(self.batch_size * sites), step)
        self.count.add_one()
        sent = roundtrip(message, codec)
        return message, sent, decode_message(layout, sent)

    def epsilon(self) -> float:
        return self.budget.epsilon(self.releases)

    def summary(self) -> dict[str, float]:
        return {**self.budget.summary(self.releases), "dp_releases": self.releases}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {RELEASES: torch.tensor(self.releases, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint's copy of the count, checked against the file; its noise generator,
        if an older checkpoint saved one, is not used (fresh noise, module doc)."""
        if RELEASES not in state:
            raise ValueError("the checkpoint holds no differential-privacy release count")
        self.count.check_checkpoint(int(state[RELEASES]))
