"""Exact moments of the finite-group sample estimators (THEORY F7).

A prompt gets ``N`` i.i.d. responses ``y^1..y^N``; :func:`otb_ref.compute_advantages`
turns them into advantages ``A^i_t`` (each baseline built from the group), and
the group's gradient estimate is

    ĝ = (1/N) Σ_i Σ_t A^i_t s_t(y^i).

Enumerating all multisets of ``N`` responses, each with probability
``(orderings) × Π_i P(y^i)``, gives ``E ĝ``, ``E||ĝ||²``, the variance and the
bias ``E ĝ − ∇J`` exactly. The
advantages come from the library function itself, so these are the moments of
the code that trains, not of a re-derivation.
"""

from __future__ import annotations

import itertools
import math

import torch

from otb_ref.advantages import compute_advantages
from otb_ref.exact.moments import Moments, returns_to_go
from otb_ref.exact.policies import Enumeration

__all__ = ["group_moments", "MAX_TUPLES"]

MAX_TUPLES = 1 << 22
_TUPLE_CHUNK = 1 << 16


def _multisets(num_responses: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every multiset of ``N`` responses as a sorted tuple ``[K, N]``, with its number of orderings ``[K]``.

    ĝ does not depend on the order of the group (compute_advantages treats a
    group as a set), so summing over multisets weighted by ``N! / Π_k m_k!``
    equals summing over all ``M^N`` ordered tuples.
    """
    members = torch.tensor(
        list(itertools.combinations_with_replacement(range(num_responses), group_size)), dtype=torch.long
    )
    members = members.reshape(-1, group_size)
    repeats = torch.ones(members.shape[0], dtype=torch.float64)  # Π_k m_k! as the product of running counts
    for i in range(group_size):
        repeats *= (members[:, : i + 1] == members[:, i : i + 1]).sum(dim=1)
    return members, math.factorial(group_size) / repeats


def group_moments(enum: Enumeration, rewards: torch.Tensor, estimator: str, group_size: int, **flags) -> Moments:
    """Exact mean, variance and bias of the group estimator built by ``compute_advantages``.

    Args:
        enum: an enumeration that kept its scores (``enum.scores``).
        rewards: ``[M, L]`` token rewards of every response.
        estimator: a name of :data:`otb_ref.ESTIMATORS`; ``flags`` go to
            :func:`otb_ref.compute_advantages` (``leave_one_out``,
            ``std_normalize``, ``epsilon``, ...).
        group_size: ``N >= 1``; the number of multisets ``C(M + N − 1, N)``
            must not exceed :data:`MAX_TUPLES`.
    """
    if enum.scores is None:
        raise ValueError("enum: scores were not kept; call enumerate_policy(policy, keep_scores=True)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected a positive integer, got {group_size!r}")
    num_responses, length = enum.tokens.shape
    num_multisets = math.comb(num_responses + group_size - 1, group_size)
    if num_multisets > MAX_TUPLES:
        raise ValueError(
            f"group_size: {num_multisets} groups of {group_size} from {num_responses} responses exceed {MAX_TUPLES}"
        )
    all_members, all_orderings = _multisets(num_responses, group_size)

    inputs = {
        "old_log_probs": enum.log_probs,
        "sum_pi_squared": enum.sum_pi_squared,
        "grad_norms_sq": enum.sequence_energy_exact,
        "cumulative_energy": enum.prefix_energy_exact,
    }
    coefficients = torch.zeros_like(enum.mask)  # Σ_groups P · (1/N) Σ_i A^i at y^i: [M, L]
    second_moment = 0.0
    for start in range(0, num_multisets, _TUPLE_CHUNK):
        members = all_members[start : start + _TUPLE_CHUNK]  # [c, N]
        count = members.shape[0]
        rows = members.reshape(-1)  # [c·N] responses, group by group
        group_id = torch.arange(count).repeat_interleave(group_size)
        advantages, _ = compute_advantages(
            estimator,
            rewards[rows],
            enum.mask[rows],
            group_id,
            **{name: value[rows] for name, value in inputs.items()},
            **flags,
        )
        advantages = advantages.view(count, group_size, length)  # A^i_t
        group_prob = all_orderings[start : start + count] * enum.probs[members].prod(dim=1)  # [c]
        weighted = (group_prob[:, None, None] * advantages / group_size).reshape(-1, length)
        coefficients.index_add_(0, rows, weighted)
        estimate = torch.einsum("cnt,cntp->cp", advantages, enum.scores[members]) / group_size  # ĝ per group [c, P]
        second_moment += float((group_prob * estimate.square().sum(-1)).sum())

    target = enum.probs[:, None] * returns_to_go(rewards, enum.mask) * enum.mask
    mean = enum.score_sum(coefficients)
    bias = enum.score_sum(coefficients - target)
    return Moments(mean=mean, second_moment=second_moment, variance=second_moment - float(mean @ mean), bias=bias)
