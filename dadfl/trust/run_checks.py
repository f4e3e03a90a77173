"""``dadfl.trust.run_checks`` — what a site checks in the coordinator's run config before it builds or imports anything.

The coordinator is trusted with the model's weights, not with the site's machine. A run
config names code (a workload factory) and its arguments; the site runs only workloads
its own config allows (``allowed_workloads``), decided from the name alone, before any
import. Every other field is bounded: options are small JSON objects of typed values,
batch size, steps and payload sizes stay under the site's ``limits``, and the model's
size is measured on torch's meta device before a single weight is allocated.
Differential privacy is held to the site's own floor (``[privacy]``): the public
parameters of the run's [dp] are checked, and its ε recomputed, here too.

The checks are a chain of small steps, each taking a typed record and returning it or raising
:class:`RunRefused`: the field checks (``CONFIG_CHECKS``) on the ``RunConfig`` message, then
``parse_run`` into a :class:`CheckedRun`, then the checks of the parsed run (``RUN_CHECKS``).
The built workload is checked last, against the coordinator's model (``check_same_model``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from pydantic import ValidationError

from dadfl.model_identity import MAX_LAYOUT_LINES, PROBE_TOLERANCE, PROBE_VALUES, layout_difference, probe_distance
from dadfl.options import strategy_options, validation_summary
from dadfl.privacy.accounting import SitePrivacy, check_dp_strategy
from dadfl.protos import coordinator_pb2 as cpb
from dadfl.protos.codec import CODECS
from dadfl.replica import OptimizerConfig, Replica
from dadfl.sanitize import printable
from dadfl.strategies import STRATEGIES, Strategy, make_strategy
from dadfl.workloads import BUILTIN, Workload, load_workload

from .run_policy import WORKLOAD_SPEC, PrivacyPolicy, RunLimits, RunPolicy

log = logging.getLogger("dadfl.site")

MAX_OPTIONS_CHARS = 64 << 10  # one JSON field of the run config
MAX_OPTIONS_DEPTH = 4  # nesting of option values (a JSON bomb nests thousands deep)
MAX_SPEC_CHARS = 256
MIN_CHUNK_BYTES = 1024
RUN_ID = r"^[A-Za-z0-9_-]{1,64}$"
FINGERPRINT = r"^[0-9a-f]{1,128}$"


class RunRefused(RuntimeError):
    """The coordinator's run config asks for something this site does not run or allow."""


class PrivateRefusal(RunRefused):
    """A refusal whose words name what [dp] protects (this site's record count, the ε its
    records spent over every run): they stay in the site's log, the server hears ``PUBLIC``."""

    PUBLIC = "its privacy budget or its number of records refuses this run's [dp]; the site's log says why"


@dataclass(frozen=True)
class CheckedRun:
    """The run config's fields after every check; ``workload`` is built only from these."""

    workload: str
    workload_options: dict[str, Any]
    strategy: Strategy
    optimizer: OptimizerConfig
    privacy: SitePrivacy | None = None  # [dp]: clip to its max_grad_norm, Poisson batches
    precision: str = "fp32"  # the autocast of the local forward/backward (strategies/precision.py)


def workload_allowed(spec: str, allowed: list[str]) -> bool:
    """Whether ``allowed_workloads`` lets this site run ``spec``: decided from the text alone."""
    path = BUILTIN.get(spec, spec)
    if path in {BUILTIN.get(entry, entry) for entry in allowed}:  # a built-in's name allows its import path too
        return True
    if not re.fullmatch(WORKLOAD_SPEC, path):
        return False
    module = path.split(":", 1)[0]
    return any(entry.endswith(".") and f"{module}.".startswith(entry) for entry in allowed)


def check_run_id(config: cpb.RunConfig, site: RunPolicy) -> cpb.RunConfig:
    if not re.fullmatch(RUN_ID, config.run_id):
        raise RunRefused(f"the coordinator sent run_id {printable(config.run_id)}: expected 1-64 letters, digits, '_' or '-'")
    return config


def check_workload_allowed(config: cpb.RunConfig, site: RunPolicy) -> cpb.RunConfig:
    """The workload by name alone, before anything could import it (``allowed_workloads``)."""
    spec = config.workload
    if len(spec) > MAX_SPEC_CHARS or not workload_allowed(spec, site.allowed_workloads):
        raise RunRefused(
            f"the coordinator asks for workload {printable(spec)}, which this site does not allow; "
            f"to run it, add it (or its module prefix, e.g. 'package.') to allowed_workloads in the site config"
        )
    return config


def check_sizes(config: cpb.RunConfig, site: RunPolicy) -> cpb.RunConfig:
    """Batch size, steps and payload size within the site's ``limits``."""
    limits = site.limits
    bound("batch_size", config.batch_size, 1, limits.max_batch_size, "limits.max_batch_size")
    bound("steps", config.steps, 1, limits.max_steps, "limits.max_steps")
    bound("max_payload_bytes", config.max_payload_bytes, MIN_CHUNK_BYTES, limits.max_payload_bytes, "limits.max_payload_bytes")
    return config


def check_codec(config: cpb.RunConfig, site: RunPolicy) -> cpb.RunConfig:
    if config.codec not in CODECS:
        raise RunRefused(f"the coordinator sent codec {printable(config.codec)}; this site knows {', '.join(CODECS)}")
    return config


def check_model_identity(config: cpb.RunConfig, site: RunPolicy) -> cpb.RunConfig:
    """The fields that identify the coordinator's model (``check_same_model`` compares them), bounded."""
    if not re.fullmatch(FINGERPRINT, config.layout_fingerprint):
        raise RunRefused(f"the coordinator sent layout fingerprint {printable(config.layout_fingerprint)}: expected hex digits")
    bound("model_probe values", len(config.model_probe), 0, PROBE_VALUES, None)
    bound("layout_line_hashes", len(config.layout_line_hashes), 0, MAX_LAYOUT_LINES, None)
    return config


def check_precision(config: cpb.RunConfig, site: RunPolicy) -> cpb.RunConfig:
    precision = config.precision or "fp32"
    if precision not in site.limits.precisions:
        raise RunRefused(
            f"the coordinator asks for precision {printable(precision)}; this site trains at {', '.join(site.limits.precisions)} "
            "(limits.precisions in the site config)"
        )
    return config


def parse_run(config: cpb.RunConfig) -> CheckedRun:
    """The run config's JSON fields parsed and typed: options, strategy, optimizer, [dp]."""
    workload_options = parse_options(config.workload_options, "workload_options")
    strategy = checked_strategy(config.strategy, parse_options(config.strategy_options, "strategy_options"))
    try:
        optimizer = OptimizerConfig.model_validate(parse_options(config.optimizer, "optimizer"), strict=True)
    except ValidationError as exc:
        raise RunRefused(f"the coordinator's optimizer is not valid: {validation_summary(exc)}") from None
    privacy = None
    if config.dp:
        try:
            check_dp_strategy(config.strategy)
            privacy = SitePrivacy.model_validate(parse_options(config.dp, "dp"), strict=True)
        except ValidationError as exc:
            raise RunRefused(f"the coordinator's dp section is not valid: {validation_summary(exc)}") from None
        except ValueError as exc:
            raise RunRefused(f"the coordinator asks for differential privacy with a strategy that cannot give it: {exc}") from None
    return CheckedRun(config.workload, workload_options, strategy, optimizer, privacy, config.precision or "fp32")


def check_local_batches(run: CheckedRun, config: cpb.RunConfig, site: RunPolicy) -> CheckedRun:
    # A step of a strategy with local steps (FedAvg, DiLoCo) reads one batch per inner step.
    batches = config.batch_size * run.strategy.batches_per_step()
    bound("batch_size × local steps", batches, 1, site.limits.max_batch_size, "limits.max_batch_size")
    return run


def check_privacy(run: CheckedRun, config: cpb.RunConfig, site: RunPolicy) -> CheckedRun:
    """The run's [dp] against the site's floor, and in the precision per-sample clipping needs."""
    check_privacy_floor(run.privacy, config.steps, site.privacy)
    if run.privacy is not None and run.precision != "fp32":
        raise RunRefused(f"the coordinator asks for precision {run.precision} with [dp]; per-sample clipping runs in fp32")
    return run


# The chain, in order; the first step that refuses names the field. Field checks read the
# config alone; the run checks read the parsed run (``parse_run``) with it.
CONFIG_CHECKS: tuple[Callable[[cpb.RunConfig, RunPolicy], cpb.RunConfig], ...] = (
    check_run_id, check_workload_allowed, check_sizes, check_codec, check_model_identity, check_precision,
)
RUN_CHECKS: tuple[Callable[[CheckedRun, cpb.RunConfig, RunPolicy], CheckedRun], ...] = (check_local_batches, check_privacy)


def check_run_config(config: cpb.RunConfig, site: RunPolicy, max_chunk_bytes: int) -> CheckedRun:
    """Every field of the coordinator's run config checked against this site's config; no import of
    workload code happens here. Raises :class:`RunRefused` naming the field and what would allow it.
    ``max_chunk_bytes``: the largest gRPC message this site's channel takes."""
    for check in CONFIG_CHECKS:
        config = check(config, site)
    bound("chunk_bytes", config.chunk_bytes, MIN_CHUNK_BYTES, max_chunk_bytes, None)
    run = parse_run(config)
    for check in RUN_CHECKS:
        run = check(run, config, site)
    return run


def check_privacy_floor(privacy: SitePrivacy | None, steps: int, policy: PrivacyPolicy) -> None:
    """Refuse a run below the site's ``[privacy]`` floor, naming the setting and both values."""
    if privacy is None:
        if policy.require_dp:
            raise RunRefused("the coordinator's run has no differential privacy ([dp]), and privacy.require_dp = true in the site config")
        return
    if policy.min_noise_multiplier is not None and privacy.noise_multiplier < policy.min_noise_multiplier:
        raise RunRefused(
            f"the coordinator's noise multiplier σ = {privacy.noise_multiplier:.4g} is below privacy.min_noise_multiplier = "
            f"{policy.min_noise_multiplier:g} in the site config"
        )
    if policy.max_delta is not None and privacy.delta > policy.max_delta:
        raise RunRefused(f"the coordinator's δ = {privacy.delta:g} is above privacy.max_delta = {policy.max_delta:g} in the site config")
    if policy.max_epsilon is not None:
        try:
            run_epsilon = privacy.run_epsilon(steps)
        except ImportError:
            raise RunRefused("privacy.max_epsilon needs the accountant to check the run: pip install 'dadfl[dp]'") from None
        except (ArithmeticError, ValueError):  # a σ so small the accountant divides by zero: no privacy to speak of
            run_epsilon = math.inf
        if not run_epsilon <= policy.max_epsilon:  # NaN too
            raise RunRefused(
                f"the coordinator's run reaches ε = {run_epsilon:.4g} (σ = {privacy.noise_multiplier:.4g}, "
                f"q = {privacy.max_sample_rate:.4g}, {steps} steps, δ = {privacy.delta:g}; the coordinator states "
                f"{privacy.epsilon:.4g}), above privacy.max_epsilon = {policy.max_epsilon:g} in the site config"
            )


def bound(field: str, value: int, lowest: int, highest: int, site_field: str | None) -> None:
    if not lowest <= value <= highest:
        allow = f"; raise {site_field} in the site config to allow it" if site_field and value > highest else ""
        raise RunRefused(f"the coordinator asks for {field} = {value}, outside {lowest}..{highest}{allow}")


def parse_options(text: str, field: str) -> dict[str, Any]:
    """A JSON object of the run config, bounded in size and nesting."""
    if len(text) > MAX_OPTIONS_CHARS:
        raise RunRefused(f"the coordinator's {field} is {len(text)} characters; at most {MAX_OPTIONS_CHARS} are accepted")
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        raise RunRefused(f"the coordinator's {field} is not valid JSON") from None
    if not isinstance(value, dict):
        raise RunRefused(f"the coordinator's {field} must be a JSON object, not {type(value).__name__}")
    if depth(value) > MAX_OPTIONS_DEPTH:
        raise RunRefused(f"the coordinator's {field} nests deeper than {MAX_OPTIONS_DEPTH} levels")
    return value


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def checked_strategy(name: str, options: dict[str, Any]) -> Strategy:
    if name not in STRATEGIES:
        raise RunRefused(f"the coordinator asks for strategy {printable(name)}; this site knows {', '.join(STRATEGIES)}")
    try:
        return make_strategy(name, **strategy_options(STRATEGIES[name], options))
    except (ValueError, TypeError) as exc:
        raise RunRefused(f"the coordinator's strategy is not valid: {exc}") from None


def build_workload(run: CheckedRun, limits: RunLimits, search_path: Sequence[Path] = ()) -> Workload:
    """Import the (allowed) workload, looking in the site's ``search_path`` first, build it with
    the coordinator's options (typed as the factory declares them), and refuse a model above
    ``limits.max_parameters`` before allocating it."""
    try:
        workload = load_workload(run.workload, search_path, **run.workload_options)
    except (ValueError, TypeError) as exc:
        raise RunRefused(f"the coordinator's workload is not valid here: {exc}") from None
    parameters = count_parameters(workload)
    if parameters > limits.max_parameters:
        raise RunRefused(
            f"workload {printable(run.workload)} with the coordinator's options has {parameters:,} parameters, "
            f"above limits.max_parameters = {limits.max_parameters:,} in the site config"
        )
    return workload


def check_same_model(replica: Replica, layout_fingerprint: str, layout_line_hashes: Sequence[int], model_probe: Sequence[float]) -> None:
    """Refuse a run whose model this site builds differently from the coordinator: another
    layout (naming what this site has that the coordinator's lacks, from the coordinator's
    line hashes), or another function (its ``model_probe``, ``dadfl/model_identity.py``).
    Both mean different model code on the two sides."""
    layout = replica.layout
    if layout.fingerprint() != layout_fingerprint:
        raise RunRefused(
            f"this site's model differs from the coordinator's in its layout: {layout_difference(layout.lines(), layout_line_hashes)}; "
            "site and coordinator must run the same dadfl, torch and workload code"
        )
    if not replica.model_probe or not model_probe:
        log.info("the model's output is not probed (no finite floating output): only its layout is checked against the coordinator's")
        return
    distance = probe_distance(replica.model_probe, model_probe)
    if not distance <= PROBE_TOLERANCE:  # NaN from the wire fails too
        raise RunRefused(
            f"this site's model computes a different function from the coordinator's: given the same seeded weights and input, "
            f"their outputs differ by {distance:.3g} (relative; another machine's rounding stays below {PROBE_TOLERANCE:g}), so "
            "the model code differs (a changed activation or operation?); site and coordinator must run the same workload code"
        )


def count_parameters(workload: Workload) -> int:
    """Parameters of the workload's model, from shapes on torch's meta device (no memory, no
    time). A model that cannot be built there is refused: building it for real to count it
    would allocate whatever size the coordinator's options ask for before the check."""
    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception as exc:
        raise RunRefused(
            f"workload {printable(workload.name)} cannot be built on torch's meta device ({type(exc).__name__}), so "
            "its size cannot be checked before memory is allocated; build its model from torch.nn modules "
            "without reading tensor values in the constructor"
        ) from None
    return sum(p.numel() for p in model.parameters())
