"""Exact verification: enumeration of small policies, exact moments, exact gradient energies.

* :mod:`otb_ref.exact.policies` — tabular tree and parameter-shared policies,
  every response enumerated with its probability, scores and energies.
* :mod:`otb_ref.exact.moments` — exact mean and variance of any per-position
  baseline estimator; the population baselines of THEORY §3 and ``B**`` (F4).
* :mod:`otb_ref.exact.groups` — exact bias and variance of the finite-group
  sample estimators of :func:`otb_ref.compute_advantages`.
* :mod:`otb_ref.exact.grad_norms` — exact ``||S||²`` and ``||S_t||²`` for real
  batches on any small causal LM (feeds ``"eob"`` and ``"otb_exact"``).

The exact variance table that uses them is a measurement, outside the library:
``python -m experiments.exact_table``.
"""

from otb_ref.exact.grad_norms import prefix_grad_norms_sq_fp64, sequence_grad_norms_sq_fp64
from otb_ref.exact.groups import group_moments
from otb_ref.exact.moments import (
    POPULATION_ESTIMATORS,
    Moments,
    estimator_moments,
    optimal_token_baseline,
    outcome_rewards,
    population_advantages,
    population_baseline,
    population_granularity,
    returns_to_go,
)
from otb_ref.exact.policies import Enumeration, SharedPolicy, TreePolicy, enumerate_policy, enumerate_responses

__all__ = [
    "Enumeration",
    "Moments",
    "POPULATION_ESTIMATORS",
    "SharedPolicy",
    "TreePolicy",
    "enumerate_policy",
    "enumerate_responses",
    "estimator_moments",
    "group_moments",
    "optimal_token_baseline",
    "outcome_rewards",
    "population_advantages",
    "population_baseline",
    "population_granularity",
    "prefix_grad_norms_sq_fp64",
    "returns_to_go",
    "sequence_grad_norms_sq_fp64",
]
