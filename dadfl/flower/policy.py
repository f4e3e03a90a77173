"""``dadfl.flower.policy`` — what a Flower node (the ClientApp) checks in the ServerApp's run
settings before it builds or imports anything: the gRPC site's own checks
(``dadfl.trust.run_checks``), called, not copied.

The ServerApp, like the gRPC coordinator, is trusted with the model's weights, not with the
node's machine. Its settings name code (a workload, possibly ``package.module:factory``) and
its arguments; a node runs only workloads its operator allows, decided from the name alone
before any import, and holds every other field to its limits (batch size, steps, option
size and depth, model size measured on the meta device, the [dp] floor), exactly as
``check_run_config`` and ``build_workload`` do for a gRPC site. The settings are read bounded
(``MAX_SETTINGS_CHARS``) and typed (``SimulationConfig``) first, then handed to those checks as
the run config a gRPC coordinator would send; the server's ``workload_path`` (folders on *its*
machine) is never used: the node searches its own.

**Where the policy comes from.** The node's own ``--node-config``, with keys named as the
fields of a gRPC site's TOML, flattened with dots as Flower flattens a TOML table:
``allowed_workloads`` (comma-separated: Flower's node-config values are scalars),
``workload_path`` (folders separated by ``os.pathsep``), ``limits.max_batch_size``,
``limits.max_steps``, ``limits.max_parameters``, ``limits.max_payload_bytes``,
``limits.precisions`` (comma-separated), ``privacy.require_dp`` and the other ``privacy.*`` fields. Unset keys keep the site
defaults: the built-in workloads only and the default limits. Besides them a node config
holds only the node's own settings (``NODE_SETTINGS``) and what Flower's simulation engine
sets on every node (``FLOWER_KEYS``); any other key is refused with its name, since a
misspelled limit that was ignored would leave a site believing it holds a bound it does not
(so a SuperNode shared with another app cannot carry that app's keys). Chosen over a path to a
site TOML because a SuperNode is configured by its node config (as ``data-path`` is), and a
site TOML must also hold a site id, a token and a server address that mean nothing to a
Flower node; with the same names, the checks' errors ("raise limits.max_batch_size in the
site config") name the key to set. A node config that does not validate is an error of the
node, not a refusal of the server's run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from pydantic import ValidationError

from dadfl.config import ConfigError, validate_config
from dadfl.options import validation_summary
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.sanitize import one_line, printable
from dadfl.simulation import SimulationConfig, StrategySpec
from dadfl.trust.run_checks import MAX_OPTIONS_CHARS, MIN_CHUNK_BYTES, CheckedRun, RunRefused, build_workload, check_run_config
from dadfl.trust.run_policy import DEVICE, RunPolicy
from dadfl.workloads import Workload

# The settings JSON carries three option objects (each at most MAX_OPTIONS_CHARS) and scalars.
MAX_SETTINGS_CHARS = 4 * MAX_OPTIONS_CHARS
POLICY_TABLES = ("limits", "privacy")
NODE_SETTINGS = ("data-path", "device", "threads")  # the node config keys the node (node.py) reads itself
FLOWER_KEYS = (PARTITION_ID_KEY, NUM_PARTITIONS_KEY)  # set on every node by Flower's simulation engine
RAW_CODEC = "none"  # Flower carries exact .npy arrays


class NodePolicy(RunPolicy):
    """A node's rules for the server's runs: the fields a gRPC site config holds its runs to."""

    @classmethod
    def node_config_keys(cls) -> list[str]:
        """Every key a node config may hold: the policy's fields (a table's flattened with dots),
        then the node's settings and Flower's own keys."""
        keys = []
        for name, info in cls.model_fields.items():
            if name in POLICY_TABLES:
                keys += [f"{name}.{field}" for field in info.annotation.model_fields]
            else:
                keys.append(name)
        return keys + list(NODE_SETTINGS) + list(FLOWER_KEYS)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> "NodePolicy":
        """The policy keys of a Flower node config (module docstring); a key no part of the node
        reads is a :class:`ConfigError` naming it and the known keys."""
        known = cls.node_config_keys()
        unknown = sorted(key for key in node_config if key not in known)
        if unknown:
            raise ConfigError(
                f"node config: unknown key(s) {', '.join(printable(key) for key in unknown[:5])}; "
                f"check the spelling, the known keys are {', '.join(known)}"
            )
        values: dict[str, Any] = {}
        for key, value in node_config.items():
            table, dot, name = key.partition(".")
            if key == "allowed_workloads" and isinstance(value, str):
                values[key] = [entry.strip() for entry in value.split(",") if entry.strip()]
            elif key == "workload_path" and isinstance(value, str):
                values[key] = [entry for entry in value.split(os.pathsep) if entry]
            elif key == "limits.precisions" and isinstance(value, str):
                values.setdefault(table, {})[name] = [entry.strip() for entry in value.split(",") if entry.strip()]
            elif key in cls.model_fields and not dot:
                values[key] = value  # a wrong type: the model says which
            elif dot and table in POLICY_TABLES:
                values.setdefault(table, {})[name] = value
        return validate_config(values, cls, source="node config")


@dataclass(frozen=True)
class NodeRun:
    """The server's settings after every check: the node builds its replica from these only."""

    checked: CheckedRun
    config: SimulationConfig
    spec: StrategySpec


def check_settings(settings_json: str, policy: NodePolicy, run_id: int, layout: str) -> NodeRun:
    """The ServerApp's settings checked as a gRPC site checks its coordinator's run config; no
    workload code is imported. Raises :class:`RunRefused` naming the field and the fix."""
    if len(settings_json) > MAX_SETTINGS_CHARS:
        raise RunRefused(f"the server's run settings are {len(settings_json)} characters; at most {MAX_SETTINGS_CHARS} are accepted")
    try:
        data = json.loads(settings_json)
    except (ValueError, RecursionError):
        raise RunRefused("the server's run settings are not valid JSON") from None
    if not isinstance(data, dict) or set(data) != {"config", "strategy"}:
        raise RunRefused("the server's run settings must be a JSON object with exactly 'config' and 'strategy'")
    try:
        config = SimulationConfig.model_validate(data["config"])
        spec = StrategySpec.model_validate(data["strategy"])
    except ValidationError as exc:
        raise RunRefused(f"the server's run settings are not valid: {validation_summary(exc)}") from None
    except (ValueError, TypeError, RecursionError) as exc:  # a strategy validator's own refusal
        raise RunRefused(f"the server's run settings are not valid: {one_line(str(exc), 200)}") from None
    if config.dp is not None:  # never train without the noise the server asks for
        raise RunRefused("the server asks for differential privacy ([dp]), which the Flower integration does not run; use dadfl server/site")
    try:
        run_config = cpb.RunConfig(
            run_id=str(run_id),
            workload=config.workload,
            workload_options=json.dumps(config.workload_options),
            strategy=spec.name,
            strategy_options=json.dumps(spec.options),
            optimizer=config.optimizer.model_dump_json(),
            batch_size=config.batch_size,
            steps=config.steps,
            # Flower moves whole messages: no chunks, and the node's own cap bounds what it decodes.
            max_payload_bytes=policy.limits.max_payload_bytes,
            chunk_bytes=MIN_CHUNK_BYTES,
            codec=RAW_CODEC,
            layout_fingerprint=layout,
        )
    except (ValueError, TypeError) as exc:  # a number out of the wire fields' range
        raise RunRefused(f"the server's run settings do not fit a run config: {one_line(str(exc), 120)}") from None
    checked = check_run_config(run_config, policy, MIN_CHUNK_BYTES)  # the [dp] floor too: privacy.require_dp refuses every run
    if not re.fullmatch(DEVICE, config.device):
        raise RunRefused(f"the server asks for device {printable(config.device)}: expected auto, cpu, mps, cuda or cuda:N")
    return NodeRun(checked, config, spec)


# Workloads built on this process: loading data costs seconds, and a workload is pure (seeded).
# A node's are keyed by (spec, options, search path, size limit) and only ever filled after the
# checks allowed the spec; the ServerApp's by (name, options).
_workloads: dict[tuple, Workload] = {}
MAX_CACHED_WORKLOADS = 4


def cached_workload(key: tuple, build: Callable[[], Workload]) -> Workload:
    """``build()`` once per ``key`` on this process, keeping the last ``MAX_CACHED_WORKLOADS``."""
    if key not in _workloads:
        if len(_workloads) >= MAX_CACHED_WORKLOADS:
            del _workloads[next(iter(_workloads))]
        _workloads[key] = build()
    return _workloads[key]


def node_workload(checked: CheckedRun, policy: NodePolicy) -> Workload:
    """``build_workload`` for an allowed run, from the node's own ``workload_path``."""
    key = ("node", checked.workload, json.dumps(checked.workload_options, sort_keys=True),
           tuple(map(str, policy.workload_path)), policy.limits.max_parameters)
    return cached_workload(key, lambda: build_workload(checked, policy.limits, policy.workload_path))
