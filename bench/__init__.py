"""Benchmark suite: strategies x workloads x sites x splits x seeds, measured in-process.

``python -m bench.run`` runs a reduced matrix (the CI smoke run); ``--full`` runs the
whole matrix, the real-links and the peer comparison, and publishes
``docs/benchmarks.md``. Modules, one job each:

- ``matrix``: what is measured — workload settings, strategy specs, the cells.
- ``workloads``: text workloads with a label per sequence, so label skew applies to them.
- ``execute``: run cells (one strategy, one workload setting, sites, split, seed) in
  worker processes, each writing its per-step metrics; finished cells are skipped.
- ``costs``: bytes per step from the cost formulas, the round trips per step, and the
  bound a model's uncovered (dense) parameters put on any compression ratio.
- ``analysis``: per-step records -> per-cell statistics over seeds, targets, dominance.
- ``links``: coordinator and sites in network namespaces behind ``tc tbf`` links.
- ``peers``, ``ddp_worker``: our PowerSGD beside PyTorch DDP's ``powerSGD_hook``.
- ``report``: statistics -> markdown tables and PNG plots.
- ``run``: the command line.

``bench_overhead`` and ``bench_codec`` (the runtime's wire benchmarks) stand apart.
"""
