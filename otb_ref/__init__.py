"""otb_ref: reference implementation of the Optimal Token Baseline (OTB).

The specification is docs/THEORY.md (facts F1–F7). Pure functions on tensors:

* :mod:`otb_ref.proxy` — the Logit-Gradient Proxy (F6).
* :mod:`otb_ref.estimators` — the one estimator table (§3): granularity × energy, plus flags.
* :mod:`otb_ref.readable` — the estimator family stated in plain vectorised torch (the form to read and port).
* :mod:`otb_ref.advantages` — the estimator family (§3, F7), fast, and the
  verl-compatible OTB functions (§4).
* :mod:`otb_ref.diagnostics` — forward-only variance metrics (§5).
* :mod:`otb_ref.grad_norms` — every response's exact ``||S||²`` (the EOB's energy, F3) in one
  forward + backward.
* :mod:`otb_ref.integrations` — the verl plugin and TRL's ``OTBGRPOTrainer`` (optional extras; not imported here).
"""

from otb_ref import readable
from otb_ref.advantages import (
    compute_advantages,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from otb_ref.diagnostics import variance_proxy_metrics
from otb_ref.estimators import ESTIMATORS, Estimator
from otb_ref.grad_norms import row_grad_norms_sq, sequence_grad_norms_sq
from otb_ref.proxy import logprobs_and_sum_pi_squared, sum_pi_squared, token_energy

__all__ = [
    "readable",
    "ESTIMATORS",
    "Estimator",
    "compute_advantages",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
    "logprobs_and_sum_pi_squared",
    "row_grad_norms_sq",
    "sequence_grad_norms_sq",
    "sum_pi_squared",
    "token_energy",
    "variance_proxy_metrics",
]

__version__ = "0.1.0"
