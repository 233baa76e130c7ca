"""Exact moments of per-position baseline estimators (THEORY §2, F1–F5).

Every estimator here has the form ``ĝ(y) = Σ_t a_t(y) s_t(y)`` with an
advantage ``a_t`` that is zero off the mask. Over an :class:`Enumeration`:

    mean      E ĝ    = Σ_y P(y) Σ_t a_t(y) s_t(y)          (one backward pass)
    second    E||ĝ||² = Σ_y P(y) a_yᵀ K_y a_y             (K_y[t,u] = <s_t, s_u>)
    variance  Var ĝ  = E||ĝ||² − ||E ĝ||²                  (trace of the covariance)

Population baselines are constants (one per position, or a single scalar for sequence estimators):

    token      a_t = m_t (G_t − B_t),   B_t = E[m_t W_t G_t] / E[m_t W_t]
    sequence   a_t = m_t (R − b),       b   = E[v R] / E[v]

with the energies of THEORY §3 (``v`` and ``W_t`` from :func:`otb_ref.readable.energies`, the same code as the
group estimators), and the variance-optimal ``B**`` of F4: ``B**_t = E[m_t <s_t, ĝ_0>] / E[m_t ||s_t||²]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otb_ref.estimators import Estimator, population_cells
from otb_ref.exact.policies import Enumeration
from otb_ref.readable import energies, returns_to_go  # G_t = Σ_{k≥t} m_k r_k, re-exported

__all__ = [
    "Moments",
    "POPULATION_ESTIMATORS",
    "estimator_moments",
    "returns_to_go",
    "outcome_rewards",
    "population_baseline",
    "population_advantages",
    "optimal_token_baseline",
    "population_granularity",
]


@dataclass
class Moments:
    """Exact first and second moments of a vector estimator."""

    mean: torch.Tensor  # [P] E ĝ
    second_moment: float  # E||ĝ||²
    variance: float  # E||ĝ||² − ||E ĝ||²
    bias: torch.Tensor  # [P] E ĝ − ∇J (∇J = E[Σ_t m_t s_t G_t])

    @property
    def bias_norm(self) -> float:
        return float(self.bias.norm())


def outcome_rewards(enum: Enumeration, outcome: torch.Tensor) -> torch.Tensor:
    """Outcome reward ``R [M]`` placed at each response's last token: ``[M, L]``."""
    last = (enum.mask.sum(-1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(enum.mask)
    rewards[torch.arange(len(last)), last] = outcome.to(rewards.dtype)
    return rewards


def estimator_moments(enum: Enumeration, advantages: torch.Tensor, rewards: torch.Tensor) -> Moments:
    """Exact mean, second moment, variance and bias of ``ĝ = Σ_t a_t s_t``.

    advantages: ``[M, L]`` (zero off the mask); rewards: ``[M, L]`` token
    rewards, defining the true gradient ``∇J = E[Σ_t m_t s_t G_t]``.
    """
    advantages = advantages * enum.mask
    target = returns_to_go(rewards, enum.mask) * enum.mask
    mean = enum.score_sum(enum.probs[:, None] * advantages)
    bias = enum.score_sum(enum.probs[:, None] * (advantages - target))
    second = float((enum.probs * enum.gram_quadratic(advantages)).sum())
    return Moments(mean=mean, second_moment=second, variance=second - float(mean @ mean), bias=bias)


def _population_mean(values: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``E[w x] / E[w]`` over responses, per trailing position; 0 where ``E[w] = 0``."""
    p = probs.reshape(-1, *([1] * (values.dim() - 1)))
    numerator, denominator = (p * weights * values).sum(0), (p * weights).sum(0)
    return torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), 0.0)


# The population table: no baseline (plain REINFORCE), each cell of the estimator table (otb_ref.estimators;
# "grpo" is the uniform sequence cell, the mean E[R] that grpo and rloo estimate), and F4's optimum B**.
POPULATION_ESTIMATORS: dict[str, Estimator | None] = {"none": None, **population_cells(), "optimal": None}


def optimal_token_baseline(enum: Enumeration, rewards: torch.Tensor) -> torch.Tensor:
    """``B**_t = E[m_t <s_t, ĝ_0>] / E[m_t ||s_t||²]`` (F4), ``[L]``; 0 where the denominator is 0."""
    g0 = returns_to_go(rewards, enum.mask) * enum.mask  # a_t of plain REINFORCE
    inner = torch.einsum("mtu,mu->mt", enum.gram, g0) * enum.mask  # m_t <s_t, ĝ_0(y)> [M, L]
    energy = enum.token_energy_exact * enum.mask  # m_t ||s_t||² [M, L]
    numerator, denominator = enum.probs @ inner, enum.probs @ energy  # [L] each
    return torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), 0.0)


def population_baseline(enum: Enumeration, rewards: torch.Tensor, name: str) -> torch.Tensor:
    """The population baseline of ``name``: ``[L]`` for token estimators, a 0-d tensor for sequence ones."""
    if name == "none":
        return torch.zeros((), dtype=enum.mask.dtype)
    if name == "optimal":
        return optimal_token_baseline(enum, rewards)
    spec = POPULATION_ESTIMATORS[name]
    v, W = energies(  # sequence weight [M], realized energy [M, L]
        spec,
        enum.mask,
        old_log_probs=enum.log_probs,
        sum_pi_squared=enum.sum_pi_squared,
        grad_norms_sq=enum.sequence_energy_exact,
        cumulative_energy=enum.prefix_energy_exact,
    )
    G = returns_to_go(rewards, enum.mask)  # [M, L]
    if spec.granularity == "sequence":
        return _population_mean(G[:, 0], v, enum.probs)  # b = E[v R] / E[v]
    return _population_mean(G, W * enum.mask, enum.probs)  # B_t = E[m_t W_t G_t] / E[m_t W_t]


def population_advantages(enum: Enumeration, rewards: torch.Tensor, name: str) -> torch.Tensor:
    """``[M, L]`` advantages of the population estimator ``name``: ``m_t (G_t − B_t)`` or ``m_t (R − b)``."""
    target = returns_to_go(rewards, enum.mask)
    baseline = population_baseline(enum, rewards, name)
    if population_granularity(name) == "sequence":
        return (target[:, :1] - baseline) * enum.mask
    return (target - baseline) * enum.mask


def population_granularity(name: str) -> str:
    """``"sequence"`` or ``"token"`` (``"none"`` has no baseline; ``"optimal"`` is per token)."""
    spec = POPULATION_ESTIMATORS[name]
    return spec.granularity if spec is not None else ("none" if name == "none" else "token")
