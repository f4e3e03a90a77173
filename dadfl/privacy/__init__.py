"""``dadfl.privacy`` — sample-level DP-SGD across the federation, in one place.

- :mod:`dadfl.privacy.accounting` — the ``[dp]`` configuration, the public half a site is
  sent (``SitePrivacy``), the accountant, the strategies [dp] admits;
- :mod:`dadfl.privacy.coordinator` — the coordinator's noise and the count of its releases;
- :mod:`dadfl.privacy.ledger` — the site's own ledger of the ε its records spent over every run.

The sites' half (per-sample clipping read off the factors) is strategy math and lives with
the factors it reads, in ``dadfl.strategies.sample_clipping``; what each party sees is in
``docs/privacy.md``.

One step, in order:

1. every site draws its batch by **Poisson sampling** (each of its n_s records with
   probability q_s = min(1, batch_size / n_s)) and clips every sample's gradient to C. A
   site process draws each upload's batch from the operating system's randomness, so a
   step replayed after a coordinator restart, or a retried attempt, is a new sample:
   every release is then one independent step of the sampled Gaussian mechanism, as the
   accountant counts it. (Releasing the same sample twice with fresh noise would cost as
   much as one step at σ/√2, far more than two steps at σ.) The in-process simulation,
   which never replays, seeds the draw by (seed, step);
2. the strategy carries the clipped sum to the coordinator exactly (its own factors,
   checks and bounds unchanged) and the coordinator decodes it: S = Σ_i c_i g_i;
3. the coordinator adds N(0, σ²C²) to every parameter's sum from its **own generator**
   (seeded from the operating system at every start, never sent, never logged, never
   saved) and divides by the *expected* batch B = Σ_s q_s n_s, not the drawn one, whose
   size is itself private: update = (S + z) / B;
4. that dense noisy update is the whole downlink, for every strategy: sites never see
   another site's factors, the noise, or the drawn batch size.

**Accounting.** Each step is the sampled Gaussian mechanism with noise multiplier σ and
sampling rate q = max_s q_s (a record sampled less often is protected at least as well);
ε after T steps at δ is Opacus's RDP accountant (or its PRV accountant) for (q, σ, T).
With ``target_epsilon`` alone, σ is the smallest that keeps ε ≤ target after the planned
steps; with both ``noise_multiplier`` and ``target_epsilon``, σ is given and the run stops
before the step that would take ε above the target.

**Strategies.** The guarantee needs the released update to move by at most C when one
record comes or goes. dsgd, dad, auto and edad decode exactly the clipped sum. rank-dAD
and PowerSGD do not: a rank-r approximation computed from the batch, and error-feedback
memory that releases a record's residual again at later steps, have a per-record
sensitivity that C does not bound — so they are refused with [dp] rather than reported
with an ε that does not hold. (PowerSGD's first phase would also send sites an unnoised
aggregate.)

**Restarts: privacy over reproducibility.** A restarted coordinator draws fresh noise and
counts every replayed step as a new release (``dadfl.privacy.coordinator`` keeps the count on
disk before each release goes out). Replaying a step with the noise of its first release
would let a site that saw both subtract them when the participants differ; so under [dp]
a resumed run is not bit-identical to an uninterrupted one (without [dp] it still is).
"""
