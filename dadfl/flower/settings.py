"""``dadfl.flower.settings`` — the run settings a ServerApp sends every node, and its bounds on
replies.

``flwr run`` reads them from the Flower run config (:func:`settings_from_run_config`): a
simulation TOML, one strategy spec, and any scalar ``SimulationConfig`` field. The bounds
(:class:`ServerBounds`) are ``dadfl server``'s ``[federation]`` and ``[wire]`` fields of the same
names (``dadfl.federation``), checked as there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dadfl.config import load_config, validate_config
from dadfl.federation import FederationConfig, WireConfig
from dadfl.simulation import SimulationConfig, StrategySpec
from dadfl.workloads import Workload, load_workload

from .policy import cached_workload

# The ServerApp's bounds on replies: ``dadfl server``'s [federation] and [wire] fields of these names.
BOUND_FIELDS = {
    "max_influence_ratio": FederationConfig, "max_update_norm": FederationConfig, "clip_ratio": FederationConfig,
    "agreement": FederationConfig, "agreement_margin": FederationConfig, "agreement_momentum": FederationConfig,
    "full_count_share": FederationConfig,
    "max_payload_bytes": WireConfig,
}
# Keys a Flower run config may set besides the SimulationConfig fields (dashes or underscores).
RUN_CONFIG_EXTRAS = ("config", "strategy", "out", *BOUND_FIELDS)


@dataclass(frozen=True)
class RunSettings:
    """What the server tells every node: the simulation settings and the one strategy."""

    config: SimulationConfig
    spec: StrategySpec

    def __post_init__(self) -> None:
        if self.config.dp is not None:  # never train without the noise the config asks for
            raise ValueError("[dp] is not supported by the Flower integration yet; use dadfl sim or dadfl server/site")

    def to_json(self) -> str:
        return json.dumps({"config": self.config.model_dump(mode="json"), "strategy": self.spec.model_dump(mode="json")})


@dataclass(frozen=True)
class ServerBounds:
    """What the ServerApp accepts from a reply: ``dadfl server``'s [federation] and [wire]
    fields of the same names, with their defaults and limits (``server/config.py``)."""

    max_influence_ratio: float = FederationConfig().max_influence_ratio
    max_update_norm: float | None = FederationConfig().max_update_norm
    max_payload_bytes: int = WireConfig().max_payload_bytes
    clip_ratio: float = FederationConfig().clip_ratio
    agreement: bool = FederationConfig().agreement
    agreement_margin: float = FederationConfig().agreement_margin
    agreement_momentum: float = FederationConfig().agreement_momentum
    full_count_share: float = FederationConfig().full_count_share

    @classmethod
    def from_values(cls, values: dict[str, Any], source: str) -> "ServerBounds":
        """The bounds ``values`` set (the rest default), checked as the gRPC server's config is."""
        checked = {}
        for model in (FederationConfig, WireConfig):
            fields = {key: values[key] for key, owner in BOUND_FIELDS.items() if owner is model and key in values}
            checked.update(validate_config(fields, model, source=source).model_dump(include=set(fields)))
        return cls(**checked)


def settings_from_run_config(run_config: dict[str, Any]) -> tuple[RunSettings, Path, ServerBounds]:
    """Settings for ``flwr run`` from the Flower run config; returns them, the metrics folder
    and the bounds on replies.

    ``config`` names a simulation TOML (``configs/simulation.toml``), ``strategy`` is one
    strategy spec (``"powersgd:rank=4"``, default ``"dad"``), ``out`` the folder for run
    directories (default ``runs``); any scalar SimulationConfig field (``workload``,
    ``sites``, ``steps``, ``batch-size``, ``seed`` ...) overrides the file.
    ``max-influence-ratio``, ``max-update-norm`` and ``max-payload-bytes`` set the
    :class:`ServerBounds` (absent: ``dadfl server``'s defaults).
    """
    values = {key.replace("-", "_"): value for key, value in run_config.items()}
    unknown = sorted(set(values) - set(RUN_CONFIG_EXTRAS) - set(SimulationConfig.model_fields))
    if unknown:
        raise ValueError(
            f"Flower run config has unknown key(s) {', '.join(map(repr, unknown))}; dadfl reads "
            f"{', '.join(RUN_CONFIG_EXTRAS)} and the fields of SimulationConfig (see configs/simulation.toml)"
        )
    bounds = ServerBounds.from_values({key: values.pop(key) for key in BOUND_FIELDS if key in values}, "Flower run config")
    path = values.pop("config", None)
    base = load_config(path, SimulationConfig).model_dump() if path else SimulationConfig().model_dump()
    spec = StrategySpec.parse(str(values.pop("strategy", "dad")))
    out = Path(str(values.pop("out", "runs")))
    base.update(values)
    base["strategies"] = [spec.model_dump()]
    config = validate_config(base, SimulationConfig, source=f"Flower run config{f' ({path})' if path else ''}")
    return RunSettings(config, spec), out, bounds


def workload_for(config: SimulationConfig) -> Workload:
    """The ServerApp's workload, from its own config (a node builds its own: :func:`node_workload`)."""
    key = ("server", config.workload, json.dumps(config.workload_options, sort_keys=True))
    return cached_workload(key, lambda: load_workload(config.workload, **config.workload_options))
