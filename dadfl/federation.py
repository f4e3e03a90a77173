"""``dadfl.federation`` — the coordinator's settings that every runtime reads.

The ``[federation]`` table (:class:`FederationConfig`: quorum, timeouts, the influence bounds and
the robust rule's settings that ``dadfl.trust.screening`` applies, quarantine) and the ``[wire]``
table (:class:`WireConfig`: codec, chunk and payload sizes) of a server config. The gRPC
coordinator's ``ServerConfig`` (``server/config.py``) holds them; the Flower ServerApp
(``dadfl.flower.settings``) builds its bounds from the same classes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dadfl.config import StrictModel
from dadfl.strategies.robust import DEFAULT_AGREEMENT_MARGIN, DEFAULT_CLIP_RATIO, DEFAULT_MOMENTUM, FULL_COUNT_SHARE, check_clip_ratio


class FederationConfig(StrictModel):
    min_sites: int = Field(2, ge=1, description="quorum: a step needs at least this many sites")
    initial_sites: int | None = Field(None, ge=1, description="sites to wait for before the first step (default min_sites)")
    phase_timeout_s: float = Field(60.0, gt=0, description="how long a phase waits for a site's payload")
    quorum_timeout_s: float = Field(600.0, gt=0, description="how long the server waits for a quorum before giving up")
    linger_s: float = Field(10.0, ge=0, description="after the last step, how long to wait for disconnected sites to learn the run finished")
    max_influence_ratio: float = Field(
        100.0, gt=1, description="with 3 or more sites in a step, a site whose update norm exceeds this multiple of the "
        "median of the other sites' is dropped from the step (honest sites differ by 10x and more late in training)"
    )
    max_update_norm: float | None = Field(
        None, gt=0, description="optional absolute bound on a site's update norm (mean units); the only size bound "
        "when fewer than 3 sites take part"
    )
    clip_ratio: float = Field(
        DEFAULT_CLIP_RATIO, description="bounded influence: each site's update is scaled down to at most this "
        "multiple of the median of the other sites' norms before aggregating (docs/robustness.md); 0: no clipping"
    )
    agreement: bool = Field(
        True, description="bounded influence, 3 or more sites: a site whose push-back on the model along the other sites' "
        "summed update, averaged over its recent steps, exceeds what the other sites push back on each other by "
        "agreement_margin x their median norm (or keeps less than a third of their pull) gets weight 0 for the step "
        "(docs/robustness.md)"
    )
    agreement_margin: float = Field(
        DEFAULT_AGREEMENT_MARGIN, ge=0, le=10, description="how much more a site may push back (in median norms) than "
        "the other sites do on each other; raise it where one site's data differ much from all the others' (non-IID sites "
        "push back honestly: docs/robustness.md)"
    )
    full_count_share: float = Field(
        FULL_COUNT_SHARE, ge=0, le=1, description="with agreement: a kept site that keeps less than this share of the "
        "pull forward the other sites have on each other counts less in the mean, and every kept update is scaled up "
        "(at most 1.5x) for the samples that do not count, so a site that withholds cannot shorten the others' step; "
        "0: every kept site counts whole (the step's length is plain averaging's) (docs/robustness.md)"
    )
    agreement_momentum: float = Field(
        DEFAULT_MOMENTUM, ge=0, lt=1, description="agreement reads each site's momentum of its updates (their sum over "
        "the last steps, each step's weight this times the next's), so a site cannot push the model back a little in every "
        "step while each step alone looks honest; 0.9 where the sites' data are alike (it adds up label skew too, "
        "zeroing hospitals whose data differ more often); 0: each step's update alone (docs/robustness.md)"
    )
    quarantine_after: int = Field(
        3, ge=1, description="refused uploads after which a site is quarantined for the run (run_dir/quarantine.json; "
        "the operator re-admits it by deleting its entry)"
    )
    max_eval_samples: int = Field(10_000_000, ge=1, description="largest held-out sample count a site may report")
    sync_per_minute: int = Field(60, ge=1, description="repairs a site may ask for per minute (per step: one block repair, then one full state)")

    _clip_ratio = field_validator("clip_ratio")(check_clip_ratio)

    @model_validator(mode="after")
    def _initial_at_least_quorum(self) -> "FederationConfig":
        if self.initial_sites is not None and self.initial_sites < self.min_sites:
            raise ValueError(f"initial_sites ({self.initial_sites}) must be at least min_sites ({self.min_sites})")
        return self


class WireConfig(StrictModel):
    codec: Literal["none", "fp16", "bf16"] = Field("none", description="encoding of factor tensors (A, D, P, Q)")
    chunk_bytes: int = Field(1 << 20, ge=1024, le=(4 << 20) - 65536, description="payload bytes per gRPC message")
    max_payload_bytes: int = Field(1 << 30, ge=1024, description="largest payload a site may send")
