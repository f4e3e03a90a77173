"""The test suite, one folder per part of the project.

``strategies/`` the math of each strategy in process; ``protos/`` the wire codec and payloads;
``workloads/`` built-in and users' workloads, data partitions; ``runtime/`` the gRPC coordinator
and sites, processes, resume, operator commands; ``trust/`` hostile sites and input, screening,
identity and TLS; ``privacy/`` differential privacy and the site's ledger; ``flower/`` the Flower
integration; ``bench/`` the benchmark tools. ``helpers/`` holds what several folders share.

Markers (``pyproject.toml``): ``network`` for tests that start a coordinator, a site or another
process on loopback; ``slow`` for those that take longest (``-m "not network"`` runs the math alone).
"""
