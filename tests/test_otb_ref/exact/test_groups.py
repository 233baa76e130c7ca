"""Finite groups (F7): leave-one-out is unbiased, include-self is scaled, N = 1 is REINFORCE."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import policy_cases, rollout_batches

from otb_ref import ESTIMATORS, compute_advantages
from otb_ref.exact.groups import group_moments
from otb_ref.exact.moments import estimator_moments, outcome_rewards, population_advantages, returns_to_go
from otb_ref.exact.policies import TreePolicy, enumerate_policy

# Exact float64 sums over <= C(M+N-1, N) groups (M <= 40, N <= 3): rounding far below 1e-10.
ATOL = 1e-10
SMALL = dict(max_vocab=3, max_horizon=3, max_responses=40)


@given(policy_cases(**SMALL), st.sampled_from(sorted(ESTIMATORS)), st.integers(2, 3), st.booleans())
def test_f7_leave_one_out_unbiased(case, name, group_size, multi_turn):
    """Every estimator with leave_one_out (any energy, ε > 0) has E ĝ = ∇J exactly."""
    flags = dict(leave_one_out=True, std_normalize=False)
    if ESTIMATORS[name].granularity == "token":
        flags["multi_turn"] = multi_turn
    moments = group_moments(case.enum, case.rewards, name, group_size, **flags)
    assert moments.bias_norm < ATOL


@given(rollout_batches(), st.booleans())
def test_f7_include_self_mean_is_scaled_leave_one_out(batch, use_token_mean):
    """Sample by sample: R_i − mean = ((N−1)/N)(R_i − mean_{−i}) (ε = 0), per group of size N.

    The per-position uniform mean obeys the same identity when every response is alive (equal lengths, no holes).
    """
    sizes = {key: batch.index.count(key) for key in batch.index}
    scale = torch.tensor(
        [(sizes[key] - 1) / sizes[key] if sizes[key] > 1 else 1.0 for key in batch.index], dtype=torch.float64
    )
    mask = torch.ones_like(batch.mask) if use_token_mean else batch.mask
    name = "token_mean" if use_token_mean else "grpo"
    include, _ = compute_advantages(name, batch.rewards * mask, mask, batch.index, std_normalize=False, epsilon=0.0)
    leave_out, _ = compute_advantages(
        name, batch.rewards * mask, mask, batch.index, std_normalize=False, leave_one_out=True, epsilon=0.0
    )
    torch.testing.assert_close(include, scale[:, None] * leave_out, rtol=1e-12, atol=1e-12)


@given(policy_cases(**SMALL), st.integers(2, 3))
def test_f7_include_self_mean_expectation_is_scaled_gradient(case, group_size):
    """Exactly: E ĝ(include-self mean) = ((N−1)/N) ∇J, while leave-one-out gives ∇J."""
    truth = estimator_moments(case.enum, population_advantages(case.enum, case.rewards, "none"), case.rewards).mean
    include = group_moments(case.enum, case.rewards, "grpo", group_size, std_normalize=False, epsilon=0.0).mean
    torch.testing.assert_close(include, (group_size - 1) / group_size * truth, rtol=0, atol=ATOL)


@given(policy_cases(**SMALL), st.sampled_from(sorted(ESTIMATORS)))
def test_f7_singleton_group_is_reinforce(case, name):
    """N = 1: no baseline; mean and variance are those of plain REINFORCE (Σ_t s_t G_t, or S R at sequence level)."""
    returns = returns_to_go(case.rewards, case.enum.mask)
    plain = returns[:, :1] if ESTIMATORS[name].granularity == "sequence" else returns
    reinforce = estimator_moments(case.enum, plain * case.enum.mask, case.rewards)
    moments = group_moments(case.enum, case.rewards, name, 1)
    torch.testing.assert_close(moments.mean, reinforce.mean, rtol=0, atol=ATOL)
    assert abs(moments.variance - reinforce.variance) < ATOL


def test_f7_std_normalization_biases():
    """proofs/F7 counterexample: one token, uniform π over {a, b, c}, R = (0, 1, 10), N = 2, ε = 0.

    E ĝ = (κ/9)(−2, 0, 2) with κ = 1/√2 (unbiased std), not parallel to ∇J = (1/9)(−11, −8, 19).
    """
    policy = TreePolicy(3, 1, eos=False)
    policy.theta = torch.zeros_like(policy.theta)
    enum = enumerate_policy(policy, keep_scores=True)
    rewards = outcome_rewards(enum, torch.tensor([0.0, 1.0, 10.0]))
    moments = group_moments(enum, rewards, "grpo", 2, epsilon=0.0)
    torch.testing.assert_close(
        moments.mean, torch.tensor([-2.0, 0.0, 2.0], dtype=torch.float64) / (9 * 2**0.5), rtol=0, atol=1e-14
    )
    truth = estimator_moments(enum, rewards[:, :1] * enum.mask, rewards).mean
    torch.testing.assert_close(truth, torch.tensor([-11.0, -8.0, 19.0], dtype=torch.float64) / 9, rtol=0, atol=1e-14)


@given(
    policy_cases(max_vocab=3, max_horizon=2, max_responses=12), st.sampled_from(["grpo", "otb", "rloo", "otb_exact"])
)
def test_multisets_equal_ordered_tuples(case, name):
    """Summing over multisets with their orderings equals the plain loop over all M^N ordered tuples."""
    enum, group_size = case.enum, 3
    inputs = {
        "old_log_probs": enum.log_probs,
        "sum_pi_squared": enum.sum_pi_squared,
        "grad_norms_sq": enum.sequence_energy_exact,
        "cumulative_energy": enum.prefix_energy_exact,
    }
    mean = torch.zeros(enum.num_params, dtype=torch.float64)
    second = 0.0
    for members in itertools.product(range(enum.tokens.shape[0]), repeat=group_size):
        rows = torch.tensor(members)
        advantages, _ = compute_advantages(
            name, case.rewards[rows], enum.mask[rows], [0] * group_size, **{k: v[rows] for k, v in inputs.items()}
        )
        estimate = torch.einsum("nt,ntp->p", advantages, enum.scores[rows]) / group_size
        prob = float(enum.probs[rows].prod())
        mean += prob * estimate
        second += prob * float(estimate @ estimate)
    moments = group_moments(enum, case.rewards, name, group_size)
    torch.testing.assert_close(moments.mean, mean, rtol=0, atol=ATOL)
    assert abs(moments.second_moment - second) < ATOL
    assert abs(moments.variance - (second - float(mean @ mean))) < ATOL


@pytest.mark.parametrize("group_size", [2, 3])  # M + N odd and even (M = 7 responses)
def test_the_multiset_cap_is_inclusive(group_size, monkeypatch):
    """group_moments refuses more than MAX_TUPLES multisets, comb(M + N − 1, N) for M responses and groups of N,
    and runs at exactly the cap."""
    from otb_ref.exact import groups

    enum = enumerate_policy(TreePolicy(vocab=3, horizon=2, seed=3), keep_scores=True)
    rewards = outcome_rewards(enum, (enum.tokens[:, 0] == 1).double())
    count = math.comb(enum.tokens.shape[0] + group_size - 1, group_size)
    monkeypatch.setattr(groups, "MAX_TUPLES", count)
    group_moments(enum, rewards, "grpo", group_size)
    monkeypatch.setattr(groups, "MAX_TUPLES", count - 1)
    with pytest.raises(ValueError, match=f"^group_size: {count} groups of {group_size}"):
        group_moments(enum, rewards, "grpo", group_size)


def test_multisets_taken_a_few_at_a_time_give_the_same_moments(monkeypatch):
    """_TUPLE_CHUNK only bounds memory: the 28 multisets of 2 from 7 responses in chunks of 3 give the moments of one
    chunk (the same fp64 terms summed in another grouping: rtol 1e-12)."""
    from otb_ref.exact import groups

    enum = enumerate_policy(TreePolicy(vocab=3, horizon=2, seed=3), keep_scores=True)
    rewards = outcome_rewards(enum, (enum.tokens[:, 0] == 1).double())
    whole = group_moments(enum, rewards, "otb", 2)
    monkeypatch.setattr(groups, "_TUPLE_CHUNK", 3)
    chunked = group_moments(enum, rewards, "otb", 2)
    torch.testing.assert_close(chunked.mean, whole.mean, rtol=1e-12, atol=1e-14)
    assert chunked.second_moment == pytest.approx(whole.second_moment, rel=1e-12)


@pytest.mark.parametrize("group_size", [0, -1, 2.0])
def test_group_size_must_be_a_positive_integer(group_size):
    enum = enumerate_policy(TreePolicy(vocab=3, horizon=2, seed=8), keep_scores=True)
    rewards = outcome_rewards(enum, (enum.tokens[:, 0] == 1).double())
    with pytest.raises(ValueError, match="^group_size: expected a positive integer"):
        group_moments(enum, rewards, "grpo", group_size)
