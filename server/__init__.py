"""``dadfl.server`` — the coordinator: enrolment, the step loop over connected sites, checkpoints, metrics.

``dadfl server --config configs/server.toml`` runs it (:mod:`.runtime`); the step loop
is :class:`.coordinator.Coordinator`; :func:`simulate_processes` runs a whole federation
as local processes over loopback gRPC.
"""

from .processes import simulate_processes

__all__ = ["simulate_processes"]
