"""``dadfl`` — dadfl: federated learning that shares auto-differentiation factors instead of gradients.

The package gathers the project's parts under one name: ``dadfl.strategies`` (the math),
``dadfl.server`` and ``dadfl.client`` (the gRPC runtime), ``dadfl.protos`` (the wire),
``dadfl.workloads``, and here the command line (``dadfl.cli``), the in-process simulation,
the model replica, the typed records and the Flower integration. ``docs/architecture.md``
shows how they fit and where new code goes.
"""
