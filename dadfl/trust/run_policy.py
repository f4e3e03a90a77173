"""``dadfl.trust.run_policy`` — what a party that runs a coordinator's workloads holds its runs to.

A gRPC site's config (``client/config.py``: ``SiteConfig``) and a Flower node's policy
(``dadfl.flower.policy``: ``NodePolicy``) both extend :class:`RunPolicy`: the workloads it
allows, its limits on what a run may ask (:class:`RunLimits`) and its differential-privacy
floor (:class:`PrivacyPolicy`). ``dadfl.trust.run_checks`` holds a run config to them.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from dadfl.config import Precision, StrictModel
from dadfl.workloads import BUILTIN

WORKLOAD_SPEC = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
MODULE_PREFIX = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\.$"
DEVICE = r"^(auto|cpu|mps|cuda(:[0-9]{1,2})?)$"


class RunLimits(StrictModel):
    """Bounds on what the coordinator's run config may ask of this site; larger asks are refused."""

    max_batch_size: int = Field(4096, ge=1, description="samples per step")
    max_steps: int = Field(10_000_000, ge=1)
    max_parameters: int = Field(100_000_000, ge=1, description="parameters of the model the site builds")
    max_payload_bytes: int = Field(1 << 30, ge=1024, description="largest payload the site accepts from the server")
    precisions: list[Precision] = Field(
        default_factory=lambda: ["fp32", "bf16", "fp16"],
        description="training.precision values this site trains at (autocast on its device); drop the ones its "
        "hardware lacks, e.g. bf16 on a GPU without it",
    )


class PrivacyPolicy(StrictModel):
    """``[privacy]``: the least differential privacy this site trains with. The coordinator's
    run config states σ, δ and the ε it will not pass; a run below this floor is refused
    before any workload code is imported (the site recomputes ε itself), and ``max_epsilon``
    holds over every run through the site's own ledger (``dadfl.privacy.ledger``)."""

    require_dp: bool = Field(False, description="refuse runs without [dp] at the coordinator")
    min_noise_multiplier: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False, description="refuse σ below this")
    max_epsilon: float | None = Field(
        None, gt=0, le=1000, allow_inf_nan=False,
        description="the ε this site's records may spend over every run (RDP, counted in its privacy ledger under state_dir); a run or an upload that would pass it is refused",
    )
    max_delta: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False, description="refuse δ above this")

    @model_validator(mode="after")
    def _floor_needs_dp(self) -> "PrivacyPolicy":
        floors = [name for name in ("min_noise_multiplier", "max_epsilon", "max_delta") if getattr(self, name) is not None]
        if floors and not self.require_dp:
            raise ValueError(f"{', '.join(floors)} would not stop a run without differential privacy: set require_dp = true")
        if self.max_epsilon is not None and self.max_delta is None:
            raise ValueError("max_epsilon is a budget at a δ: set max_delta too (the site's ledger counts ε at it, whatever δ a run states)")
        return self


class RunPolicy(StrictModel):
    """What a party that runs a coordinator's workloads holds its runs to (``dadfl.trust.run_checks``):
    a gRPC site's config, a Flower node's policy (``dadfl.flower.policy``)."""

    workload_path: list[Path] = Field(default_factory=list, description="folders searched for the site's own code that is not installed: workload modules, data.factory")
    allowed_workloads: list[str] = Field(
        default_factory=lambda: list(BUILTIN),
        description="workloads this site runs: built-in names, 'package.module:factory' specs, or module "
        "prefixes ending in '.' ('hospital_wl.' allows every factory under hospital_wl); anything else the "
        "coordinator names is refused before it is imported",
    )
    limits: RunLimits = RunLimits()
    privacy: PrivacyPolicy = PrivacyPolicy()

    @field_validator("allowed_workloads")
    @classmethod
    def _workload_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if entry not in BUILTIN and not re.match(WORKLOAD_SPEC, entry) and not re.match(MODULE_PREFIX, entry):
                raise ValueError(
                    f"{entry!r} is neither a built-in workload ({', '.join(BUILTIN)}), a 'package.module:factory' "
                    "spec nor a module prefix ending in '.' (e.g. 'hospital_wl.')"
                )
        return entries
