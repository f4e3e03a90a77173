"""``dadfl.trust`` — what every runtime checks between the wire and the workflow.

Both runtimes (the gRPC ``server/`` and ``client/``, and ``dadfl.flower``) move bytes and call
these; none of them copies a check. Each module is one concern, and each check is a step that
takes a typed record and returns it, or refuses it with the concern's error type:

- :mod:`dadfl.trust.protocol` — the coordinator, each upload on its own (an ``Assembled`` upload
  against what the server runs): step, phase, model version, counts. Refuses with ``PayloadError``.
- :mod:`dadfl.trust.screening` — the coordinator, a phase's uploads together: the strategy's own
  rules, the influence bound, the robust weights, the message every site will decode, and
  whether the model rather than the sites is at fault.
- :mod:`dadfl.trust.run_policy` — what a site (or Flower node) holds a run to: allowed workloads,
  limits, its differential-privacy floor.
- :mod:`dadfl.trust.run_checks` — the site, the coordinator's run config against that policy
  (``cpb.RunConfig`` → ``CheckedRun`` → the built ``Workload`` → the same model as the
  coordinator's). Refuses with ``RunRefused``.

A new check goes into the module of its concern, as one more step; a new runtime calls the
chain in the same order.
"""
