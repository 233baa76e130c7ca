"""Exact verification: enumeration of small policies, exact moments, exact gradient energies.

* :mod:`otb_ref.exact.policies` — tabular tree and parameter-shared policies,
  every response enumerated with its probability, scores and energies.
* :mod:`otb_ref.exact.moments` — exact mean and variance of any per-position
  baseline estimator; the population baselines of THEORY §3 and ``B**`` (F4).
* :mod:`otb_ref.exact.groups` — exact bias and variance of the finite-group
  sample estimators of :func:`otb_ref.compute_advantages`.
* :mod:`otb_ref.exact.grad_norms` — exact ``||S||²`` and ``||S_t||²`` for real
  batches on any small causal LM (feeds ``"eob"`` and ``"otb_exact"``).

``python -m otb_ref.exact`` prints the exact variance table.
"""
