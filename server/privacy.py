"""The coordinator's half of [dp], a step between the strategy's aggregate and the wire.

The strategy's server half aggregates and checks the sites' uploads as always; its
message is decoded here into the clipped sum and never sent. ``release`` replaces it by
the dense noisy update (``dadfl/privacy.py``): the only thing sites receive in a step.
Every release counts for the accountant — also one whose step is then aborted, since
sites have seen it — so ε is the value after ``releases`` sampled Gaussian steps.

The noise generator is seeded from the operating system. Its state and the release count
go into the checkpoint, beside the strategy's server state (keys under ``dp/``), so a
restarted coordinator draws for each replayed step the noise it drew before and resumes
bit-identically; nothing else stores or logs them.

Each site's expected batch is ``batch_size`` (its rate is batch_size / its records, at
most ``max_sample_rate``), so the expected batch of a step is batch_size × its sites.
"""

from __future__ import annotations

import json
import logging
import torch

from dadfl.privacy import NOISE_STATE, CoordinatorNoise, DPConfig, PrivacyBudget, log_plan, poisson_cap
from dadfl.protos.codec import roundtrip
from dadfl.strategies import Layout, Payload
from dadfl.strategies.base import decode_message
from dadfl.strategies.privacy import refuse_learning_buffers, refuse_sample_mixing

STATE_PREFIX = "dp/"
RELEASES = "dp/releases"


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's saved half state: (the strategy's part, the privacy part)."""
    ours = {k: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
    return {k: v for k, v in state.items() if k not in ours}, ours


class ServerPrivacy:
    """The run's budget, the coordinator's noise and the count of releases (see the module doc)."""

    def __init__(self, config: DPConfig, batch_size: int, steps: int, model: torch.nn.Module, example_inputs):
        refuse_sample_mixing(model)  # what every site would refuse, refused before any site joins
        refuse_learning_buffers(model, example_inputs)
        self.config, self.batch_size = config, batch_size
        self.budget = PrivacyBudget.resolve(config, config.max_sample_rate, steps)
        self.noise = CoordinatorNoise(self.budget)
        self.releases = 0
        log_plan(self.budget, steps)

    def site_config(self) -> str:
        """``RunConfig.dp``: what the sites need (not σ, not the noise)."""
        return json.dumps({"max_grad_norm": self.config.max_grad_norm, "max_sample_rate": self.config.max_sample_rate})

    @property
    def max_samples(self) -> int:
        """The largest sample count an upload may claim (Poisson batches vary)."""
        return poisson_cap(self.batch_size)

    def stop_reason(self) -> str | None:
        """Why the run stops before its planned steps: one more release would pass the ε target."""
        if self.budget.allows(self.releases + 1):
            return None
        return f"one more step would take ε above {self.budget.stop_epsilon:g} (ε = {self.epsilon():.3g} after {self.releases} releases)"

    def release(
        self, layout: Layout, clean_update: dict[str, torch.Tensor], num_samples: int, sites: int, step: int, codec: int,
    ) -> tuple[Payload, Payload, dict[str, torch.Tensor]]:
        """(message, as sites receive it, the update it carries): the noisy dense update
        replacing the strategy's message; counted as one release."""
        message = self.noise.privatize(layout, clean_update, num_samples, float(self.batch_size * sites), step)
        self.releases += 1
        sent = roundtrip(message, codec)
        return message, sent, decode_message(layout, sent)

    def epsilon(self) -> float:
        return self.budget.epsilon(self.releases)

    def summary(self) -> dict[str, float]:
        return {**self.budget.summary(self.releases), "dp_releases": self.releases}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.noise.state_dict(), RELEASES: torch.tensor(self.releases, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if NOISE_STATE not in state or RELEASES not in state:
            raise ValueError("the checkpoint holds no differential-privacy state (noise generator, releases)")
        self.noise.load_state_dict(state)
        self.releases = int(state[RELEASES])
