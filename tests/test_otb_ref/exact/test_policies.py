"""Enumeration and the score facts F1, F2, F6 (exact, float64)."""

import itertools

import pytest
import torch
from hypothesis import given
from strategies import policy_cases

from otb_ref.exact.policies import SharedPolicy, TreePolicy, enumerate_policy, enumerate_responses

# Exact sums over <= 400 responses of float64 terms of size <= ~10: rounding ~1e-14.
ATOL = 1e-11


@given(policy_cases())
def test_enumeration_is_a_distribution_and_gram_is_scores_gram(case):
    """P sums to 1; K = S Sᵀ per response; masks are prefixes that end at EOS or L."""
    enum = case.enum
    assert abs(float(enum.probs.sum()) - 1.0) < 1e-12
    torch.testing.assert_close(enum.gram, enum.scores @ enum.scores.transpose(1, 2), rtol=0, atol=ATOL)
    lengths = enum.mask.sum(-1).long()
    assert bool((enum.mask == (torch.arange(enum.mask.shape[1]) < lengths[:, None]).double()).all())


def test_enumeration_counts_and_eos():
    """Responses end at their first EOS or at the horizon; all are distinct."""
    tokens, mask = enumerate_responses(3, 3)
    assert tokens.shape[0] == 1 + 2 + 3 * 4
    rows = {tuple(t[: int(m.sum())].tolist()) for t, m in zip(tokens, mask)}
    assert len(rows) == tokens.shape[0]
    for row in rows:
        assert 0 not in row[:-1] and (row[-1] == 0 or len(row) == 3)
    tokens, mask = enumerate_responses(2, 3, eos=False)
    assert tokens.shape[0] == 8 and bool((mask == 1).all())


@given(policy_cases(max_vocab=3, max_horizon=3))
def test_scores_match_autograd_loop(case):
    """Per-token scores from vmap(jacrev) equal one autograd.grad per token."""
    enum = case.enum
    policy = enum.policy
    for y in range(min(enum.tokens.shape[0], 6)):
        for t in range(int(enum.mask[y].sum())):
            theta = policy.theta.detach().clone().requires_grad_(True)
            log_softmax = torch.log_softmax(policy.logits(theta, enum.tokens[y]), dim=-1)
            (grad,) = torch.autograd.grad(log_softmax[t, enum.tokens[y, t]], theta)
            torch.testing.assert_close(enum.scores[y, t], grad, rtol=0, atol=ATOL)


@given(policy_cases())
def test_f1_score_has_zero_mean(case):
    """E[s_t | h_t] = 0 for every prefix: Σ_y P(y) m_t s_t 1{h_t = h} = 0 for every (t, h)."""
    enum = case.enum
    sums: dict = {}
    for y, t in itertools.product(range(enum.tokens.shape[0]), range(enum.tokens.shape[1])):
        if enum.mask[y, t]:
            key = (t, tuple(enum.tokens[y, :t].tolist()))
            sums[key] = sums.get(key, 0) + enum.probs[y] * enum.scores[y, t]
    assert sums
    for key, total in sums.items():
        assert float(total.abs().max()) < ATOL, key


@given(policy_cases())
def test_f2_martingale_orthogonality(case):
    """E[m_j m_t <s_j, s_t>] = 0 for j ≠ t, hence E||S_t||² = E Σ_{j≤t} ||s_j||²."""
    enum = case.enum
    expected_gram = torch.einsum("m,mtu->tu", enum.probs, enum.gram)  # [L, L]
    off_diagonal = expected_gram - torch.diag(torch.diagonal(expected_gram))
    assert float(off_diagonal.abs().max()) < ATOL
    # S_t = Σ_{j≤t} m_j s_j, unmasked: a response that ended before t keeps its whole score.
    # (The masked m_t ||S_t||² is NOT covered: m_t depends on tokens before t.)
    prefix_sq = torch.diagonal(enum.gram.cumsum(1).cumsum(2), dim1=1, dim2=2)  # ||S_t||² [M, L]
    lhs = enum.probs @ prefix_sq
    rhs = enum.probs @ enum.token_energy_exact.cumsum(-1)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=ATOL)


def test_f2_fails_once_weighted_by_outcome():
    """With a shared parameter, E[R <s_1, s_2>] ≠ 0: orthogonality needs the weight to be prefix-measurable."""
    policy = SharedPolicy(2, 2, eos=False, seed=0)
    policy.theta = torch.zeros_like(policy.theta)  # uniform policy; only the shared bias b has a score
    enum = enumerate_policy(policy, keep_scores=True)
    same = (enum.tokens[:, 0] == enum.tokens[:, 1]).double()  # R = 1{y_1 = y_2}
    weighted = float((enum.probs * same * enum.gram[:, 0, 1]).sum())
    assert abs(weighted - 0.25) < 1e-12  # P(y_1 = y_2) · <s_1, s_2> = 1/2 · 1/2
    assert float((enum.probs * enum.gram[:, 0, 1]).sum()) == 0.0  # unweighted: F2


@given(policy_cases(kinds=("tree",)))
def test_f6_tree_policy_proxy_is_exact(case):
    """Tree policy: ||s_t||² = 1 − 2π_t + Σπ² and ||S_t||² = W_t (realized energy), response by response."""
    enum = case.enum
    torch.testing.assert_close(enum.token_energy_exact, enum.energy, rtol=0, atol=ATOL)
    torch.testing.assert_close(enum.prefix_energy_exact, enum.prefix_energy_proxy, rtol=0, atol=ATOL)


def test_tree_and_shared_policies_differ_on_the_proxy():
    """The shared policy is a genuine test of the approximation: its proxy is not exact."""
    enum = enumerate_policy(SharedPolicy(3, 3, seed=1))
    assert float((enum.prefix_energy_exact - enum.prefix_energy_proxy).abs().max()) > 1e-3
    enum = enumerate_policy(TreePolicy(3, 3, seed=1))
    assert float((enum.prefix_energy_exact - enum.prefix_energy_proxy).abs().max()) < ATOL


def test_shared_policy_logits_are_its_documented_formula():
    """SharedPolicy: logits_t = U tanh(E[y_{t−1}] + P_t) + b with y_0 = BOS (id V), θ packed as E, P, U, b."""
    policy = SharedPolicy(vocab=3, horizon=4, width=2, seed=5)
    v, d, length = 3, 2, 4
    sizes = [(v + 1) * d, length * d, v * d, v]
    E, P, U, b = (t.view(shape) for t, shape in zip(policy.theta.split(sizes), [(v + 1, d), (length, d), (v, d), (v,)]))
    tokens = torch.tensor([[0, 2, 1, 1], [2, 2, 0, 1]])
    previous = torch.tensor([[v, 0, 2, 1], [v, 2, 2, 0]])
    expected = torch.stack(
        [torch.stack([U @ torch.tanh(E[p] + P[t]) + b for t, p in enumerate(row)]) for row in previous]
    )
    torch.testing.assert_close(policy.logits(policy.theta, tokens), expected, rtol=1e-15, atol=1e-15)


def test_enumeration_keeps_the_scores_of_a_small_policy_by_default():
    """keep_scores (default: when small): a policy of a few hundred responses keeps s_t; False drops them."""
    policy = TreePolicy(vocab=3, horizon=3, seed=1)
    assert enumerate_policy(policy).scores is not None
    assert enumerate_policy(policy, keep_scores=False).scores is None


@pytest.mark.parametrize("vocab, horizon", [(1, 2), (3, 0)])
def test_a_vocabulary_of_one_token_or_a_horizon_of_zero_is_refused(vocab, horizon):
    with pytest.raises(ValueError, match="^vocab: need >= 2 tokens and horizon >= 1"):
        enumerate_responses(vocab, horizon)


def test_a_small_jacobian_chunk_budget_gives_the_same_enumeration(monkeypatch):
    """Scores are taken in chunks of at most _JACOBIAN_CHUNK_ELEMENTS numbers (at least one response per chunk):
    memory only, the same Gram matrices."""
    from otb_ref.exact import policies

    policy = SharedPolicy(vocab=3, horizon=3, seed=2)
    want = enumerate_policy(policy).gram
    monkeypatch.setattr(policies, "_JACOBIAN_CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(enumerate_policy(policy).gram, want, rtol=1e-14, atol=1e-14)


def test_a_shared_policy_of_width_zero_draws_every_token_from_softmax_of_its_bias():
    """Width 0 leaves the bias alone (θ = b, 3 parameters for 3 positions): logits = b at every position, so a
    response's probability is the product of softmax(b) over its tokens."""
    policy = SharedPolicy(vocab=3, horizon=3, width=0, seed=4)
    enum = enumerate_policy(policy)
    p = torch.softmax(policy.theta, dim=0)
    torch.testing.assert_close(enum.probs, (p[enum.tokens] ** enum.mask).prod(-1), rtol=1e-12, atol=0)


def test_theta_is_scale_times_standard_normal_draws_one_logit_vector_per_prefix():
    """TreePolicy: θ_h ∈ R^V for every prefix h of fewer than L non-EOS tokens (Σ_t (V − 1)^t of them), drawn as
    scale × N(0, 1) from the seed."""
    vocab, horizon = 3, 3
    policy = TreePolicy(vocab=vocab, horizon=horizon, seed=6)
    assert policy.theta.numel() == vocab * sum((vocab - 1) ** t for t in range(horizon))
    for short in (0, 1):  # no prefix below a horizon of 0 (such a policy has no position), one below 1
        assert TreePolicy(vocab, short).theta.numel() == vocab * short
    torch.testing.assert_close(TreePolicy(vocab, horizon, scale=2.5, seed=6).theta, 2.5 * policy.theta, rtol=0, atol=0)
    torch.testing.assert_close(SharedPolicy(3, 2, scale=0.5, seed=6).theta, 0.5 * SharedPolicy(3, 2, seed=6).theta)


def test_off_the_mask_sum_pi_squared_is_one_and_the_energy_zero():
    """Enumeration's conventions past a response's end: Σπ² = 1, proxy energy w = 0, log π = 0."""
    enum = enumerate_policy(TreePolicy(vocab=3, horizon=3, seed=7))
    off = enum.mask == 0
    assert bool(off.any())
    assert bool((enum.sum_pi_squared[off] == 1.0).all() and (enum.energy[off] == 0).all())
    assert bool((enum.log_probs[off] == 0).all())


@pytest.mark.parametrize("vocab, eos", [(3, True), (4, True), (3, False)])
def test_tree_policy_gives_every_prefix_its_own_logits_and_policies_have_eos_by_default(vocab, eos):
    """TreePolicy is tabular: two positions share a logit row iff their prefixes (tokens before them) are equal, and
    every row of the table belongs to a prefix (the prefix's code, in base V − 1 with EOS or V without, is a
    bijection onto the rows). By default both policies have an EOS token, so responses come in several lengths."""
    policy = TreePolicy(vocab=vocab, horizon=3, eos=eos)
    tokens, mask = enumerate_responses(vocab, 3, eos)
    theta = torch.arange(policy.theta.numel(), dtype=torch.float64)  # row r of the table holds Vr, ..., Vr + V − 1
    rows = (policy.logits(theta, tokens)[..., 0] / vocab).long()  # [M, L] table row used at each position
    owner = {}
    for response, length in zip(tokens.tolist(), mask.sum(-1).long().tolist()):
        for t in range(length):
            owner.setdefault(tuple(response[:t]), set()).add(int(rows[tokens.tolist().index(response), t]))
    assert all(len(used) == 1 for used in owner.values())  # equal prefixes: one row
    used = sorted(next(iter(used)) for used in owner.values())
    assert used == list(range(policy.theta.numel() // vocab))  # different prefixes: different rows, and no row spare
    for default in (TreePolicy(3, 3), SharedPolicy(3, 3)):
        assert len(set(enumerate_policy(default).mask.sum(-1).tolist())) > 1
