"""Adaptive speculation: which source drafts each round, how much, or none at all.

On a CPU, verifying k drafted tokens is not free: one call over k+1 tokens costs c(k)
times a one-token call (≈1.6x for k=1, ≈3.5x for k=8 for the Qwen 1.5B on 2 cores). So
the engine

1. learns c(k) online from the run's own verify calls (:class:`OnlineCost`), starting
   from the curve cached for this model on this machine, or else from a few call sizes
   timed in its first rounds (padded drafts that still emit tokens) — nothing is
   measured before the first token;
2. keeps, per draft source, a decayed estimate of the conditional acceptance a_i of the
   i-th drafted token (given the ones before it were accepted), plus the model
   drafter's cost per token and the per-round overhead, relative to a one-token call;
3. picks, each round, the source and length maximising expected tokens per unit time,
   E(k) / T(k) with E(k) = 1 + sum_j prod_{i<=j} a_i and T(k) = c(k) + d k + o,
   where k = 0 is plain decoding (E = T = 1); model-free sources (d = 0) are asked
   every round and judged by their draft's own confidence;
4. when k = 0 wins, speculation is off; it probes again after a back-off that doubles
   while probes keep failing, so the worst case stays within a few percent of plain;
5. passes a SpecDec++ threshold to drafters that can stop early: stop drafting when
   the drafter's own estimate of P(any rejection) exceeds it.

The length only changes which tokens get verified, never the acceptance rule, so any
policy keeps decoding lossless.

The package: :mod:`.base` declares what the loop asks of a policy (and the fixed length
that answers it trivially); :mod:`.adaptive` is the expected-throughput policy;
:mod:`.beliefs` holds what it believes of each draft source's acceptance.
"""
