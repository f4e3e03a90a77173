"""``dadfl.server.preflight`` — checks before anyone waits: what ``dadfl server --check``, the server at start and
``dadfl enroll`` run before a site is told to connect.

:func:`build_replica` is how the coordinator builds its replica (workload with the
coordinator's options, strategy, optimizer, the model probe every site compares): a
workload that cannot run here (no ``example_input`` and no training data, a factory that
raises, a strategy that refuses the model) fails here, in the operator's terminal, not
after the sites have started retrying. :func:`check_server` adds the files the server
reads at start (TLS, the tokens file) and the differential-privacy plan, and writes
nothing.
"""

from __future__ import annotations

from pathlib import Path

from dadfl.replica import Replica
from dadfl.strategies import make_strategy
from dadfl.workloads import load_workload

from .config import ServerConfig
from .enrol import check_tokens_file
from dadfl.privacy.coordinator import ServerPrivacy
from dadfl.protos.state import full_state_bytes


def build_replica(config: ServerConfig) -> Replica:
    """The coordinator's replica, built as the run builds it; ValueError naming the workload
    and the strategy when it cannot be (the workload's own code may raise anything), or when
    its full state would not fit a payload (:func:`check_state_fits`)."""
    workload = config.workload
    try:
        built = load_workload(workload.spec, workload.path, **workload.options, **workload.coordinator_options)
        strategy = make_strategy(config.strategy.name, **config.strategy.options)
        replica = Replica(built, strategy, config.optimizer, probe=True, precision=config.training.precision)
    except Exception as exc:
        raise ValueError(f"workload {workload.spec!r} with strategy {config.strategy.name!r} cannot run: {exc}") from None
    check_state_fits(config, replica)
    return replica


def check_state_fits(config: ServerConfig, replica: Replica) -> None:
    """A site that joins or falls behind after the first step receives the full state (weights
    and optimizer state) as one payload; a state over ``wire.max_payload_bytes`` could never
    reach it (it would retry until it gave up), so the run is refused before it starts."""
    needed = full_state_bytes(replica)
    if needed > config.wire.max_payload_bytes:
        raise ValueError(
            f"the model's full state (weights and {config.optimizer.name} state) takes {needed:,} bytes, more than "
            f"wire.max_payload_bytes ({config.wire.max_payload_bytes:,}): a site joining after the first step could not "
            f"receive it; raise wire.max_payload_bytes, and limits.max_payload_bytes in the sites' configs, to at least {needed:,}"
        )


def check_workload(config: ServerConfig) -> str:
    """Build the run's replica (and the DP plan); one line saying what was built."""
    replica = build_replica(config)
    if config.dp is not None:
        ServerPrivacy(config.dp, config.training.batch_size, config.training.steps, replica.model, replica.workload.example(), Path(config.run_dir))
    parameters = sum(p.numel() for p in replica.model.parameters())
    return f"workload {config.workload.spec} builds ({parameters:,} parameters) and {config.strategy.name} accepts it"


def check_server(config: ServerConfig, insecure: bool) -> list[str]:
    """Everything the server checks before it listens, as lines for the operator; ValueError
    naming the first thing that is wrong and how to fix it."""
    if insecure:
        config.require_plain_text_allowed()
        security = "plain text (--insecure)"
    else:
        cert, _ = config.require_tls()
        security = f"TLS with {cert}" + (", client certificates required" if config.listen.require_client_cert else "")
    sites = check_tokens_file(Path(config.listen.tokens))
    return [security, f"{sites} site(s) enrolled in {config.listen.tokens}", check_workload(config)]
