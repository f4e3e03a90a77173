"""``dadfl.flower`` — the strategies as a Flower (``flwr`` 1.41 and 1.42) ServerApp/ClientApp pair,
for sites that already run Flower.

What goes where, along Flower's own seams:

- :mod:`dadfl.flower.records` — the messages: record and status names, payloads as Flower
  records, and the bounded readers either side uses on what the other sent;
- :mod:`dadfl.flower.settings` — the run settings every node receives and the ServerApp's
  bounds on replies (``dadfl server``'s ``[federation]``/``[wire]`` fields);
- :mod:`dadfl.flower.policy` — what a node holds the ServerApp's settings to (its node config);
- :mod:`dadfl.flower.node` — the ClientApp (``client_app``): a node's replica in Flower's
  ``context.state``, one handler per message kind;
- :mod:`dadfl.flower.serverapp` — the ServerApp's step loop (``server_app``) and the entry
  points that run both in Flower's simulation engine.

The strategies' math and every check come from the runtime-neutral rooms (``dadfl.strategies``,
``dadfl.trust``), never from the gRPC runtime's ``server/`` or ``client/``. Entry points:
``dadfl.flower:server_app`` and ``dadfl.flower:client_app`` for ``flwr run`` (settings from the
run config), :func:`make_flower_apps`, :func:`simulate_flower` and :func:`run_flower_simulation`
(``dadfl sim --mode flower``). Why per-step protocols prefer the gRPC runtime (Flower's round
trip costs seconds): ``docs/flower.md``.
"""

import os

# Flower reads this once, on first import: no usage reports from sites unless a user opts in
# by setting it to 1 (in a deployment, the SuperLink's and SuperNodes' own environment decides).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from .node import client_app, handle_phase, handle_step, make_client_app  # noqa: E402
from .records import HEADER, NUMPY_DTYPES, PHASE_MESSAGE, REFUSED, STATE, STEP_MESSAGE, TENSORS, Refused, read_tensors  # noqa: E402
from .serverapp import (  # noqa: E402
    FlowerApps, FlowerCoordinator, FlowerRunError, make_flower_apps, run_flower_simulation, server_app, simulate_flower,
)
from .settings import RunSettings, ServerBounds, settings_from_run_config, workload_for  # noqa: E402

__all__ = [
    "client_app", "server_app", "make_client_app", "make_flower_apps", "simulate_flower", "run_flower_simulation",
    "handle_step", "handle_phase", "FlowerApps", "FlowerCoordinator", "FlowerRunError", "RunSettings", "ServerBounds",
    "settings_from_run_config", "workload_for", "HEADER", "TENSORS", "STATE", "STEP_MESSAGE", "PHASE_MESSAGE",
    "REFUSED", "NUMPY_DTYPES", "Refused", "read_tensors",
]
