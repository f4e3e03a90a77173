"""What several test folders share: ``network`` (a coordinator and sites in threads, their
configs), ``model_zoo`` (small models of every layer kind, per-site batches), ``workloads``
(workload factories of the tests' own, importable as ``tests.helpers.workloads:NAME``)."""
