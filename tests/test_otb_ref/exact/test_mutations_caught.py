"""Facts checked against independent definitions, so that plausible one-line mistakes fail (tools/mutations.py).

Each test recomputes its expected value from the definition in ``docs/THEORY.md`` (or the proof it names)
by a plain loop over the enumerated responses, from the policy's logits and the per-token scores
``enum.scores``, never from the library function under test. In particular:

* population token baselines are ``B_t = E[m_t W_t G_t] / E[m_t W_t]`` with the realized cumulative energy
  ``W_t`` (F5), not the per-token ``w_t`` (which, in a tree policy, is ``B**`` itself);
* variances are ``E||ĝ − E ĝ||²`` (centered), not the second moment;
* ``E ĝ_0`` is ``∇_θ J`` by autograd through the enumerated probabilities (F1, remark);
* finite groups are enumerated as ordered tuples and their baselines rebuilt from F7's formula.

All float64 and exact (no sampling). Tolerances are stated where used; at most 120 responses, or ``40²``
ordered pairs, or ``15³`` ordered triples are summed, so a sum's rounding is ``<= n · 1.1e-16`` relative to
the sum of its absolute terms.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import oracle_advantages
from strategies import PolicyCase, policy_cases, rollout_batches

from otb_ref import ESTIMATORS, compute_advantages
from otb_ref.exact.groups import group_moments
from otb_ref.exact.moments import (
    POPULATION_ESTIMATORS,
    estimator_moments,
    outcome_rewards,
    population_advantages,
    population_baseline,
)
from otb_ref.exact.policies import SharedPolicy, TreePolicy, enumerate_policy

MEDIUM = dict(max_responses=120)  # population tests: plain Python loops over <= 120 responses
SMALL = dict(max_vocab=3, max_horizon=3, max_responses=40)  # groups: <= 40² ordered pairs


# ---------------------------------------------------------------------------------------------------------------
# Independent ingredients: plain Python lists, from the policy's logits and the per-token scores.
# ---------------------------------------------------------------------------------------------------------------


def _lists(case: PolicyCase):
    """``(P [M], m [M][L], r [M][L])`` as Python floats."""
    enum = case.enum
    return enum.probs.tolist(), enum.mask.tolist(), (case.rewards * enum.mask).tolist()


def _returns_to_go(m, r):
    """``G_t = Σ_{k >= t} m_k r_k`` by a loop."""
    length = len(m[0])
    return [[sum(r[y][k] * m[y][k] for k in range(t, length)) for t in range(length)] for y in range(len(m))]


def _proxy_energies(enum):
    """``w_t = ||e_{y_t} − π_t||²`` (F6's left-hand side) from the policy's logits, 0 off the mask: ``[M][L]``."""
    with torch.no_grad():
        pi = torch.softmax(enum.policy.logits(enum.policy.theta, enum.tokens), dim=-1)  # [M, L, V]
        one_hot = torch.nn.functional.one_hot(enum.tokens, pi.shape[-1]).to(pi.dtype)
        return ((one_hot - pi).square().sum(-1) * enum.mask).tolist()


def _smallest_proxy_energy(enum) -> float:
    """The smallest ``w_t`` on the mask (``inf`` for an empty mask)."""
    return min(
        (w for row, mrow in zip(_proxy_energies(enum), enum.mask.tolist()) for w, m in zip(row, mrow) if m),
        default=math.inf,
    )


def _prefix_norms_sq(enum):
    """``(||S_t||² [M][L], ||S||² [M])`` from the per-token scores (not from the Gram matrix)."""
    prefix = enum.scores.cumsum(dim=1)  # S_t [M, L, P]
    return (prefix.square().sum(-1) * enum.mask).tolist(), prefix[:, -1].square().sum(-1).tolist()


# THEORY §3 at population level, written out here (not read from the library's POPULATION_ESTIMATORS, which a
# mistake such as "otb" -> ("sequence", "exact") would change on both sides).
DEFINITIONS = {
    "none": ("none", "none"),
    "grpo": ("sequence", "uniform"),  # the mean E[R] (grpo and rloo alike at population level)
    "opo": ("sequence", "length"),
    "sequence_proxy": ("sequence", "proxy"),
    "eob": ("sequence", "exact"),
    "token_mean": ("token", "uniform"),
    "token_length": ("token", "length"),
    "otb": ("token", "proxy"),
    "otb_exact": ("token", "exact"),
}
TOKEN_POPULATION = [n for n, (g, _) in DEFINITIONS.items() if g == "token"]
SEQUENCE_POPULATION = [n for n, (g, _) in DEFINITIONS.items() if g != "token"]


def test_f5_every_population_estimator_has_a_definition_here():
    assert set(POPULATION_ESTIMATORS) == set(DEFINITIONS) | {"optimal"}


def _population_definition(case: PolicyCase, name: str):
    """The population baseline of ``name`` by its definition (THEORY §3, F3, F5): a float or a list over t."""
    probs, m, r = _lists(case)
    g = _returns_to_go(m, r)
    num_responses, length = len(m), len(m[0])
    granularity, energy = DEFINITIONS[name]
    w = _proxy_energies(case.enum)
    prefix_sq, sequence_sq = _prefix_norms_sq(case.enum)

    def ratio(pairs):  # E[v x] / E[v] over (P(y) v, x), 0 when E[v] = 0
        numerator, denominator = sum(a * x for a, x in pairs), sum(a for a, _ in pairs)
        return numerator / denominator if denominator > 0 else 0.0

    if granularity == "none":
        return 0.0
    if granularity == "sequence":
        weight = {
            "uniform": lambda y: 1.0,
            "length": lambda y: sum(m[y]),  # T
            "proxy": lambda y: sum(w[y]),  # Σ_t w_t
            "exact": lambda y: sequence_sq[y],  # ||S||²
        }[energy]
        return ratio([(probs[y] * weight(y), g[y][0]) for y in range(num_responses)])
    weight = {
        "uniform": lambda y, t: 1.0,
        "length": lambda y, t: sum(m[y][: t + 1]),  # W_t = Σ_{j<=t} m_j
        "proxy": lambda y, t: sum(w[y][: t + 1]),  # realized energy W_t = Σ_{j<=t} m_j w_j (cumulative)
        "exact": lambda y, t: prefix_sq[y][t],  # ||S_t||²
    }[energy]
    return [ratio([(probs[y] * weight(y, t), g[y][t]) for y in range(num_responses) if m[y][t]]) for t in range(length)]


def _bstar_definition(case: PolicyCase):
    """``B**_t = E[m_t <s_t, ĝ_0>] / E[m_t ||s_t||²]`` (F4) from the scores, ``[L]`` (0 where the denominator is 0)."""
    enum = case.enum
    probs, m, r = _lists(case)
    g = torch.tensor(_returns_to_go(m, r), dtype=torch.float64)
    reinforce = torch.einsum("mt,mtp->mp", g * enum.mask, enum.scores)  # ĝ_0(y) [M, P]
    inner = torch.einsum("mtp,mp->mt", enum.scores, reinforce).tolist()  # <s_t, ĝ_0> [M][L]
    token_sq = enum.scores.square().sum(-1).tolist()  # ||s_t||²
    out = []
    for t in range(len(m[0])):
        c = sum(probs[y] * inner[y][t] for y in range(len(m)) if m[y][t])
        a = sum(probs[y] * token_sq[y][t] for y in range(len(m)) if m[y][t])
        out.append(c / a if a > 0 else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def _estimates(enum, advantages):
    """``ĝ(y) = Σ_t a_t(y) s_t(y)`` for every response: ``[M, P]``."""
    return torch.einsum("mt,mtp->mp", advantages * enum.mask, enum.scores)


def _policy_gradient(enum, rewards):
    """``∇_θ J`` with ``J(θ) = Σ_y P_θ(y) Σ_t m_t r_t(y)``, by autograd through the enumerated probabilities."""
    policy = enum.policy
    theta = policy.theta.detach().clone().requires_grad_(True)
    log_pi = torch.log_softmax(policy.logits(theta, enum.tokens), dim=-1).gather(-1, enum.tokens[..., None])[..., 0]
    prob = torch.exp((log_pi * enum.mask).sum(-1))  # P_θ(y) [M]
    (grad,) = torch.autograd.grad((prob * (rewards * enum.mask).sum(-1)).sum(), theta)
    return grad


def _parity_case(policy) -> PolicyCase:
    """Outcome reward ``R = 1`` when the response holds an odd number of token 1 (as in
    ``python -m experiments.exact_table``)."""
    enum = enumerate_policy(policy, keep_scores=True)
    ones = ((enum.tokens == 1).double() * enum.mask).sum(-1)
    return PolicyCase(enum, outcome_rewards(enum, (ones % 2 == 1).double()), True)


def _dense_case(policy, seed: int = 0) -> PolicyCase:
    """Causal dense rewards: ``r_t`` from a random table over prefixes ``y_1..y_t``."""
    enum = enumerate_policy(policy, keep_scores=True)
    generator = torch.Generator().manual_seed(seed)
    table: dict = {}
    rewards = torch.zeros_like(enum.mask)
    for y in range(enum.tokens.shape[0]):
        for t in range(int(enum.mask[y].sum())):
            key = tuple(enum.tokens[y, : t + 1].tolist())
            rewards[y, t] = table.setdefault(key, float(torch.randn((), generator=generator, dtype=torch.float64)))
    return PolicyCase(enum, rewards, False)


# Fixed cases (besides hypothesis' draws), so that every mutation is caught whatever the profile draws:
# parameter-shared and tree policies, with EOS (variable lengths) and without, outcome and dense rewards.
FIXED_CASES = {
    "shared_eos_parity": lambda: _parity_case(SharedPolicy(3, 3, width=3, seed=1)),
    "shared_fixed_length_dense": lambda: _dense_case(SharedPolicy(3, 3, eos=False, seed=2), seed=2),
    "tree_eos_dense": lambda: _dense_case(TreePolicy(3, 3, seed=3), seed=3),
    "tree_fixed_length_parity": lambda: _parity_case(TreePolicy(3, 3, eos=False, seed=4)),
}


# ---------------------------------------------------------------------------------------------------------------
# F3, F5: population baselines equal their definitions (catches M7 and M11).
# ---------------------------------------------------------------------------------------------------------------


def _check_population_baselines(case: PolicyCase, names):
    """Library baseline and advantages of each name against the loop definition.

    Tolerance: the library's proxy energy is ``1 − 2π_y + Σπ²``, the definition's ``Σ_v (δ_{v y} − π_v)²``;
    they differ by ~1e-16 absolute (the library's form cancels as ``π_y → 1``), i.e. relatively by ``1e-16 / w``.
    A population mean divides by ``E[m_t W_t]``, a sum over every response alive at ``t``, which stays far above
    1e-8 in the policies drawn even where one response's ``w`` is ~1e-12 (a shared policy's logits can be large),
    so a weighted mean of returns moves by <= 2 · 1e-8 · max|G|; sums of <= 120 terms add 120 · 1.1e-16
    relative. 1e-7 (1 + max|G|) covers both; the mutations change B by O(1). A finite group's denominator is a
    sum over two or three responses and can be ~1e-12: test_f7_leave_one_out_with_is_weights_matches_f7_and_is_unbiased
    compares with the loop only where every ``w >= 1e-8``.
    """
    enum = case.enum
    probs, m, r = _lists(case)
    g = _returns_to_go(m, r)
    tol = 1e-7 * (1.0 + max(abs(x) for row in g for x in row))
    for name in names:
        expected = torch.tensor(_population_definition(case, name), dtype=torch.float64)
        got = population_baseline(enum, case.rewards, name)
        torch.testing.assert_close(got, expected, rtol=0, atol=tol, msg=lambda msg: f"{name}: {msg}")
        granularity = DEFINITIONS[name][0]
        returns = torch.tensor(g, dtype=torch.float64)
        target = returns[:, :1] if granularity == "sequence" else returns  # R or G_t
        advantages = (target - expected) * enum.mask  # m_t (G_t − B_t), or m_t (R − b)
        got_advantages = population_advantages(enum, case.rewards, name)
        torch.testing.assert_close(got_advantages, advantages, rtol=0, atol=tol, msg=lambda msg: f"{name}: {msg}")


@pytest.mark.parametrize("fixed", sorted(FIXED_CASES))
def test_f5_population_token_baselines_are_realized_energy_ratios(fixed):
    """``B_t = E[m_t W_t G_t] / E[m_t W_t]``, ``W_t`` cumulative: 1, ``Σ_{j<=t} m_j``, ``Σ_{j<=t} m_j w_j``,
    ``||S_t||²``.

    Catches M7 (per-token ``w_t`` for "otb": in a tree policy that is ``B**``, which no inequality test can
    tell apart) and M11 (EOB's constant for "otb": wrong shape and value).
    """
    _check_population_baselines(FIXED_CASES[fixed](), TOKEN_POPULATION)


@given(policy_cases(**MEDIUM))
def test_f5_population_token_baselines_match_the_loop(case):
    """Same as above on drawn tree/shared policies, EOS or fixed length, outcome or dense rewards."""
    _check_population_baselines(case, TOKEN_POPULATION)


@given(policy_cases(**MEDIUM))
def test_f3_population_sequence_baselines_match_the_loop(case):
    """``b = E[v R] / E[v]`` with ``v`` = 1, ``T``, ``Σ_t w_t``, ``||S||²`` (EOB, F3); "none" is 0."""
    _check_population_baselines(case, SEQUENCE_POPULATION)


@pytest.mark.parametrize("fixed", ["shared_eos_parity", "tree_eos_dense"])
def test_f5_population_token_baselines_with_holes(fixed):
    """The same definitions with tool-output holes (see _with_holes): there ``W_t = Σ_{j<=t} m_j`` differs from
    the position count ``t`` and between responses, so "token_length" is no longer "token_mean" in disguise.
    """
    case = _with_holes(FIXED_CASES[fixed]())
    mask = case.enum.mask
    assert bool(((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any())  # there are interior holes
    _check_population_baselines(case, TOKEN_POPULATION)
    length = population_baseline(case.enum, case.rewards, "token_length")
    uniform = population_baseline(case.enum, case.rewards, "token_mean")
    assert float((length - uniform).abs().max()) > 1e-3


@given(policy_cases(eos=True, **MEDIUM))
def test_f5_population_token_baselines_with_holes_match_the_loop(case):
    """Token baselines against their definitions on drawn policies with holes (catches W_t := 1 for "length")."""
    _check_population_baselines(_with_holes(case), TOKEN_POPULATION)


def test_f3_population_sequence_baselines_fixed_cases():
    """Sequence baselines (mean, OPO, sequence proxy, EOB) against their definitions on the fixed cases."""
    for fixed in sorted(FIXED_CASES):
        _check_population_baselines(FIXED_CASES[fixed](), SEQUENCE_POPULATION)


def test_f5_mutant_per_token_energy_equals_bstar_in_a_tree_policy():
    """Why M7 survived the inequality tests: with per-token ``w_t`` a tree policy's "OTB" is ``B**`` itself.

    So the correct OTB must differ from ``B**`` here, while ``E[m_t w_t G_t] / E[m_t w_t] = B**_t``.
    Tolerance as in :func:`_check_population_baselines`.
    """
    case = FIXED_CASES["tree_fixed_length_parity"]()
    enum = case.enum
    probs, m, r = _lists(case)
    g = _returns_to_go(m, r)
    w = _proxy_energies(enum)
    per_token = []  # E[m_t w_t G_t] / E[m_t w_t]: the M7 mutant's "OTB"
    for t in range(len(m[0])):
        alive = [y for y in range(len(m)) if m[y][t]]
        per_token.append(sum(probs[y] * w[y][t] * g[y][t] for y in alive) / sum(probs[y] * w[y][t] for y in alive))
    bstar = _bstar_definition(case)
    torch.testing.assert_close(torch.tensor(per_token, dtype=torch.float64), bstar, rtol=0, atol=1e-7)
    otb = population_baseline(enum, case.rewards, "otb")
    assert float((otb - bstar).abs().max()) > 1e-3  # the real OTB is a running mean of B** (E2), not B**


# ---------------------------------------------------------------------------------------------------------------
# F4 and E2: B** from the scores; OTB as the running energy-weighted mean of B**.
# ---------------------------------------------------------------------------------------------------------------


@given(policy_cases(**MEDIUM))
def test_f4_bstar_matches_its_definition_from_the_scores(case):
    """``B**_t = E[m_t <s_t, ĝ_0>] / E[m_t ||s_t||²]`` computed from ``s_t`` itself, not from the Gram matrix.

    Tolerance: sums of <= 120 products of float64 scores; a ratio's relative rounding ~1e-13. Positions whose
    ``E[m_t ||s_t||²]`` is tiny are ill-conditioned, so the error is measured relative to 1 + max|B**|.
    """
    expected = _bstar_definition(case)
    got = population_baseline(case.enum, case.rewards, "optimal")
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9 * (1.0 + float(expected.abs().max())))


def _check_e2(case: PolicyCase):
    """proofs/F5 E2 step 3: ``B^OTB_t = Σ_{j<=t} a_j B**_j / Σ_{j<=t} a_j``, ``a_j = E[m_j ||s_j||²]``.

    ``a_j`` from the scores (``E||s_j||²``; ``m_j = 1``: equal lengths), ``B**`` from its definition. Exact and
    proxy energies coincide in a tree policy (F6 (iv), ``τ = 1``). At ``t = L`` this is EOB's ``b*`` (F5 (b)).
    Tolerance: as in :func:`_check_population_baselines` (the proxy path), on returns ``R`` of size <= ~2.
    """
    enum = case.enum
    a = enum.probs @ enum.scores.square().sum(-1)  # a_t [L]
    bstar = _bstar_definition(case)
    running = (a * bstar).cumsum(0) / a.cumsum(0)
    scale = 1e-7 * (1.0 + float(case.rewards.abs().max()))
    for name in ["otb", "otb_exact"]:
        got = population_baseline(enum, case.rewards, name)
        torch.testing.assert_close(got, running, rtol=0, atol=scale, msg=lambda msg: f"{name}: {msg}")
    eob = population_baseline(enum, case.rewards, "eob")
    assert abs(float(running[-1]) - float(eob)) < scale


@given(policy_cases(kinds=("tree",), eos=False, outcome=True, **MEDIUM))
def test_e2_tree_otb_is_the_running_energy_weighted_mean_of_bstar(case):
    """E2 step 3 on drawn tree policies with outcome reward and equal lengths (catches M7: it gives ``B**``)."""
    _check_e2(case)


def test_e2_running_mean_fixed_case():
    """E2 step 3 on a fixed tree policy (V = 3, L = 3, parity reward), with OTB visibly different from B**."""
    case = FIXED_CASES["tree_fixed_length_parity"]()
    _check_e2(case)
    otb = population_baseline(case.enum, case.rewards, "otb")
    assert float((otb - _bstar_definition(case)).abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# F1: E ĝ_0 = ∇J by autograd; E[s_t | h_t] = 0 normalised by P(h).
# ---------------------------------------------------------------------------------------------------------------


@given(policy_cases(**MEDIUM))
def test_f1_reinforce_mean_is_the_autograd_policy_gradient(case):
    """``E ĝ_0 = ∇_θ Σ_y P_θ(y) Σ_t r_t(y)`` (proofs/F1 remark), and every population baseline keeps that mean.

    Checks estimator_moments' mean and bias and returns_to_go against autograd (no shared code path).
    Tolerance: both sides are sums of <= 120 · L terms of size <= max|r| L · max||s|| (~1e2): rounding
    ~1e-11; 1e-9 (1 + ||∇J||) leaves margin.
    """
    enum = case.enum
    truth = _policy_gradient(enum, case.rewards)
    tol = 1e-9 * (1.0 + float(truth.norm()))
    for name in POPULATION_ESTIMATORS:
        moments = estimator_moments(enum, population_advantages(enum, case.rewards, name), case.rewards)
        torch.testing.assert_close(moments.mean, truth, rtol=0, atol=tol, msg=lambda msg: f"{name}: {msg}")
        torch.testing.assert_close(moments.bias, moments.mean - truth, rtol=0, atol=tol)


def test_f1_reinforce_mean_fixed_cases():
    """The same on the fixed cases, where ``∇J`` is far from 0 (so a wrong mean cannot hide in the tolerance)."""
    for fixed in sorted(FIXED_CASES):
        case = FIXED_CASES[fixed]()
        truth = _policy_gradient(case.enum, case.rewards)
        assert float(truth.norm()) > 1e-2, fixed
        moments = estimator_moments(case.enum, population_advantages(case.enum, case.rewards, "none"), case.rewards)
        torch.testing.assert_close(moments.mean, truth, rtol=0, atol=1e-10 * (1 + float(truth.norm())))


@given(policy_cases(**MEDIUM))
def test_f1_conditional_score_mean_normalised_by_the_prefix_probability(case):
    """``E[s_t | h_t = h] = Σ_{y ⊃ h} P(y) s_t(y) / P(h) = 0`` for every alive prefix, however rare ``h`` is.

    (test_f1_score_has_zero_mean sums ``P(y) s_t`` without dividing by ``P(h)``: for a prefix of probability
    1e-6 a conditional mean of 1 would pass.) Tolerance: ``P(y)/P(h) <= 1``, so each conditional mean is a
    convex combination of <= 120 scores, rounded to ~120 · 1.1e-16 · max|s|; 1e-11 (1 + max|s|).
    """
    enum = case.enum
    probs = enum.probs.tolist()
    mass: dict = {}
    sums: dict = {}
    for y in range(enum.tokens.shape[0]):
        for t in range(int(enum.mask[y].sum())):
            key = (t, tuple(enum.tokens[y, :t].tolist()))
            mass[key] = mass.get(key, 0.0) + probs[y]
            sums[key] = sums.get(key, 0.0) + probs[y] * enum.scores[y, t]
    tol = 1e-11 * (1.0 + float(enum.scores.abs().max()))
    for key, total in sums.items():
        assert mass[key] > 0, key
        assert float((total / mass[key]).abs().max()) < tol, (key, mass[key])


# ---------------------------------------------------------------------------------------------------------------
# F4: the variance is centered (catches M6: variance replaced by the second moment).
# ---------------------------------------------------------------------------------------------------------------


def _check_centered(case: PolicyCase):
    """estimator_moments' mean, second moment and variance against ``Σ_y P(y) ĝ(y)`` and ``Σ_y P ||ĝ − E ĝ||²``.

    Tolerance: the library forms ``E||ĝ||² − ||E ĝ||²`` (cancellation), the test the centered sum; both are
    sums of <= 120 terms, exact to ~1e-13 (1 + E||ĝ||²); 1e-10 (1 + E||ĝ||²) leaves margin.
    """
    enum = case.enum
    for name in POPULATION_ESTIMATORS:
        advantages = population_advantages(enum, case.rewards, name)
        estimates = _estimates(enum, advantages)  # [M, P]
        mean = enum.probs @ estimates
        second = float(enum.probs @ estimates.square().sum(-1))
        centered = float(enum.probs @ (estimates - mean).square().sum(-1))
        moments = estimator_moments(enum, advantages, case.rewards)
        tol = 1e-10 * (1.0 + second)
        torch.testing.assert_close(moments.mean, mean, rtol=0, atol=tol)
        assert abs(moments.second_moment - second) < tol, name
        assert abs(moments.variance - centered) < tol, (name, moments.variance, centered)


@given(policy_cases(**MEDIUM))
def test_f4_variance_is_the_centered_second_moment(case):
    """``Var ĝ = E||ĝ − E ĝ||²`` (THEORY §1) for every population estimator."""
    _check_centered(case)


def test_f4_variance_is_centered_where_the_mean_is_not_zero():
    """Fixed cases with ``||E ĝ||² > 1e-4``: a variance computed as ``E||ĝ||²`` is off by that much (M6)."""
    for fixed in sorted(FIXED_CASES):
        case = FIXED_CASES[fixed]()
        moments = estimator_moments(case.enum, population_advantages(case.enum, case.rewards, "none"), case.rewards)
        assert float(moments.mean @ moments.mean) > 1e-4, fixed
        _check_centered(case)


# ---------------------------------------------------------------------------------------------------------------
# F7: finite groups enumerated as ordered tuples.
# ---------------------------------------------------------------------------------------------------------------


def _inputs(enum):
    return {
        "old_log_probs": enum.log_probs,
        "sum_pi_squared": enum.sum_pi_squared,
        "grad_norms_sq": enum.sequence_energy_exact,
        "cumulative_energy": enum.prefix_energy_exact,
    }


def _ordered_groups(enum, rewards, name, group_size, rho=None, **flags):
    """Every ordered tuple of ``N`` responses: ``(members [K, N], probability [K], advantages [K, N, L])``.

    One call of compute_advantages with one group id per tuple; ``rho [M, L]`` are rollout IS weights.
    """
    num_responses, length = enum.tokens.shape
    members = torch.tensor(list(itertools.product(range(num_responses), repeat=group_size)), dtype=torch.long)
    rows = members.reshape(-1)
    group_id = torch.arange(members.shape[0]).repeat_interleave(group_size)
    extra = {} if rho is None else {"rollout_is_weights": rho[rows]}
    advantages, _ = compute_advantages(
        name,
        rewards[rows],
        enum.mask[rows],
        group_id,
        **{k: v[rows] for k, v in _inputs(enum).items()},
        **extra,
        **flags,
    )
    return members, enum.probs[members].prod(dim=1), advantages.view(-1, group_size, length)


def _group_estimates(enum, members, advantages):
    """``ĝ = (1/N) Σ_i Σ_t A^i_t s_t(y^i)`` per tuple: ``[K, P]``."""
    return torch.einsum("knt,kntp->kp", advantages, enum.scores[members]) / members.shape[1]


@given(policy_cases(max_vocab=3, max_horizon=2, max_responses=12), st.sampled_from(sorted(ESTIMATORS)), st.booleans())
def test_f7_group_variance_is_the_centered_second_moment(case, name, leave_one_out):
    """group_moments' mean and variance against the centered sum over all ``M^N`` ordered tuples (N = 2).

    Tolerance: sums of <= 144 tuples, ~1e-13 relative to E||ĝ||²; 1e-10 (1 + E||ĝ||²).
    """
    enum = case.enum
    members, prob, advantages = _ordered_groups(enum, case.rewards, name, 2, leave_one_out=leave_one_out)
    estimates = _group_estimates(enum, members, advantages)
    mean = prob @ estimates
    second = float(prob @ estimates.square().sum(-1))
    moments = group_moments(enum, case.rewards, name, 2, leave_one_out=leave_one_out)
    tol = 1e-10 * (1.0 + second)
    torch.testing.assert_close(moments.mean, mean, rtol=0, atol=tol)
    assert abs(moments.variance - float(prob @ (estimates - mean).square().sum(-1))) < tol


def test_f7_group_variance_is_centered_where_the_mean_is_not_zero():
    """A fixed case (leave-one-out, so ``E ĝ = ∇J``, ``||∇J||² > 1e-4``): the variance is not the second moment."""
    case = _parity_case(SharedPolicy(3, 2, seed=1))
    enum = case.enum
    members, prob, advantages = _ordered_groups(enum, case.rewards, "rloo", 2)
    estimates = _group_estimates(enum, members, advantages)
    mean = prob @ estimates
    assert float(mean @ mean) > 1e-4
    moments = group_moments(enum, case.rewards, "rloo", 2)
    assert abs(moments.variance - float(prob @ (estimates - mean).square().sum(-1))) < 1e-12


def _is_weights(enum, seed: int = 0) -> torch.Tensor:
    """Rollout IS weights ``ρ̄ [M, L]`` in [0, 2): a fixed function of each response (allowed by proofs/F7 (a))."""
    return torch.rand(enum.tokens.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


# (granularity, energy) of the estimators that take IS weights, written out (not read from the library).
IS_DEFINITIONS = {
    "opo": ("sequence", "length"),
    "sequence_proxy": ("sequence", "proxy"),
    "token_length": ("token", "length"),
    "otb": ("token", "proxy"),
}
IS_ESTIMATORS = sorted(IS_DEFINITIONS)


def _leave_one_out_definition(case: PolicyCase, name: str, members, rho, epsilon: float):
    """F7 (a)'s leave-one-out baselines with IS factors, by loops: advantages ``[K][N][L]``.

    ``W_t^j = Σ_{k<=t} m_k ρ̄_k² w_k`` (w = 1 for "length", the proxy otherwise); ``v_j = W_L^j``;
    ``B̂_t^{−i} = Σ_{j≠i} m_t^j W_t^j G_t^j / (Σ_{j≠i} m_t^j W_t^j + ε)`` (ε for the proxy only).
    """
    _, m, r = _lists(case)
    g = _returns_to_go(m, r)
    granularity, energy = IS_DEFINITIONS[name]
    w = _proxy_energies(case.enum) if energy == "proxy" else m
    rho = rho.tolist()
    eps = epsilon if energy == "proxy" else 0.0
    length = len(m[0])
    energy_to = [  # W_t^y
        [sum(m[y][k] * rho[y][k] ** 2 * w[y][k] for k in range(t + 1)) for t in range(length)] for y in range(len(m))
    ]
    out = []
    for group in members.tolist():
        rows = []
        for i, y in enumerate(group):
            others = [z for j, z in enumerate(group) if j != i]
            row = []
            for t in range(length):
                if not m[y][t]:
                    row.append(0.0)
                    continue
                # THEORY §3: B = (Σ a G + ε Ḡ) / (Σ a + ε) over the others alive (Ḡ their plain mean; Ḡ if 0/0).
                alive = others if granularity == "sequence" else [z for z in others if m[z][t]]
                p = 0 if granularity == "sequence" else t
                a = [energy_to[z][-1] if granularity == "sequence" else energy_to[z][t] for z in alive]
                mean = sum(g[z][p] for z in alive) / len(alive) if alive else 0.0
                num = sum(a_z * g[z][p] for a_z, z in zip(a, alive)) + eps * mean
                den = sum(a) + eps
                row.append(g[y][p] - (num / den if den > 0 else mean))
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=torch.float64)


@given(
    policy_cases(max_vocab=3, max_horizon=3, max_responses=15),
    st.sampled_from(IS_ESTIMATORS),
    st.sampled_from([0.0, 1e-8]),
)
def test_f7_leave_one_out_with_is_weights_matches_f7_and_is_unbiased(case, name, epsilon):
    """Leave-one-out with rollout IS weights (``ρ̄²`` inside the others' energies), ``ε ∈ {0, 1e-8}``, N = 3.

    (N = 3: with N = 2 a leave-one-out mean has one term and its weight cancels.) The advantages equal F7's
    formula computed by loops, and ``E ĝ = ∇J`` (autograd) exactly. Tolerance: proxy energies by two formulas
    (see _check_population_baselines) inside ratios of <= 2 terms: 1e-7 (1 + max|R|), valid when every ``w_t``
    is >= 1e-8 (else that comparison is skipped: with two others' energies ~1e-12 and ε = 0 the library's ~1e-16
    absolute error in ``w`` moves the ratio by ~1e-4, and hypothesis found such a shared policy); the mean is a
    sum over <= 15³ tuples: 1e-9 (1 + ||∇J||), for every example.
    """
    enum = case.enum
    rho = _is_weights(enum)
    members, prob, advantages = _ordered_groups(
        enum, case.rewards, name, 3, rho=rho, leave_one_out=True, std_normalize=False, epsilon=epsilon
    )
    # The loop comparison's tolerance needs every w >= 1e-8 (see _check_population_baselines); unbiasedness
    # does not (the weights, rounded or not, are functions of the others only).
    if IS_DEFINITIONS[name][1] != "proxy" or _smallest_proxy_energy(enum) >= 1e-8:
        expected = _leave_one_out_definition(case, name, members, rho, epsilon)
        scale = 1.0 + float(case.rewards.abs().sum(-1).max())
        torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-7 * scale)
    truth = _policy_gradient(enum, case.rewards)
    mean = prob @ _group_estimates(enum, members, advantages)
    torch.testing.assert_close(mean, truth, rtol=0, atol=1e-9 * (1.0 + float(truth.norm())))


def test_f7_leave_one_out_with_is_weights_fixed_case():
    """The IS factor changes the baseline here (so dropping ``ρ̄²`` or its square is visible), for each estimator."""
    case = _dense_case(SharedPolicy(3, 3, seed=5), seed=5)
    enum = case.enum
    rho = _is_weights(enum, seed=5)
    scale = 1.0 + float(case.rewards.abs().sum(-1).max())
    for name in IS_ESTIMATORS:
        members, _, advantages = _ordered_groups(enum, case.rewards, name, 3, rho=rho, leave_one_out=True)
        expected = _leave_one_out_definition(case, name, members, rho, 1e-8)
        torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-7 * scale)  # as in the test above
        _, _, unweighted = _ordered_groups(enum, case.rewards, name, 3, leave_one_out=True)
        assert float((advantages - unweighted).abs().max()) > 1e-2, name


def _kappa_mean(p: float, others: int, alone: float) -> float:
    """``E[κ_t]`` with ``k ~ Binomial(others, p)`` alive others, ``κ = k / (k + 1)`` (``alone`` when ``k = 0``)."""
    total = 0.0
    for k in range(others + 1):
        weight = math.comb(others, k) * p**k * (1 - p) ** (others - k)
        total += weight * (k / (k + 1) if k else alone)
    return total


@given(policy_cases(eos=True, **SMALL), st.integers(2, 3), st.booleans())
def test_f7_include_self_token_mean_shrinks_each_position_by_its_own_factor(case, group_size, zero_tail):
    """proofs/F7 remark (varying lengths): ``E ĝ_self = Σ_t E[κ_t] E[m_t s_t G_t]``, ``κ_t = k/(k+1)``.

    ``k`` = other responses alive at ``t``, Binomial(N − 1, P(m_t = 1)). With ``handle_zero_tail`` a response
    alone at ``t`` is the unique longest beyond the second-longest (no holes here), its baseline is zeroed and
    its advantage is ``G_t``: ``κ = 1`` when ``k = 0``. Uniform weights divide exactly, so ε plays no part.
    Tolerance: sums over <= 40³ multisets; 1e-10 (1 + ||∇J||).
    """
    enum = case.enum
    _, m, r = _lists(case)
    g = torch.tensor(_returns_to_go(m, r), dtype=torch.float64)
    alive = enum.probs @ enum.mask  # P(m_t = 1) [L]
    per_position = torch.einsum("m,mt,mtp->tp", enum.probs, g * enum.mask, enum.scores)  # E[m_t s_t G_t] [L, P]
    factors = [_kappa_mean(float(p), group_size - 1, 1.0 if zero_tail else 0.0) for p in alive]
    expected = torch.tensor(factors, dtype=torch.float64) @ per_position
    moments = group_moments(
        enum, case.rewards, "token_mean", group_size, leave_one_out=False, handle_zero_tail=zero_tail, epsilon=0.0
    )
    torch.testing.assert_close(moments.mean, expected, rtol=0, atol=1e-10 * (1.0 + float(per_position.norm())))


def test_f7_include_self_token_mean_factor_fixed_case():
    """A fixed case with variable lengths, where the per-position factors differ (not one multiple of ∇J)."""
    case = _dense_case(TreePolicy(3, 3, seed=6, scale=0.3), seed=6)
    enum = case.enum
    alive = enum.probs @ enum.mask
    assert float(alive.min()) < 0.9  # lengths vary: the factors differ by position
    _, m, r = _lists(case)
    g = torch.tensor(_returns_to_go(m, r), dtype=torch.float64)
    per_position = torch.einsum("m,mt,mtp->tp", enum.probs, g * enum.mask, enum.scores)
    for zero_tail in (False, True):
        factors = [_kappa_mean(float(p), 1, 1.0 if zero_tail else 0.0) for p in alive]
        factors = torch.tensor(factors, dtype=torch.float64)
        moments = group_moments(enum, case.rewards, "token_mean", 2, handle_zero_tail=zero_tail)
        torch.testing.assert_close(moments.mean, factors @ per_position, rtol=0, atol=1e-12)


def _with_holes(case: PolicyCase) -> PolicyCase:
    """Tool-output holes: position ``t >= 1`` is masked when ``y_{t−1} = 1`` (a function of the prefix ``h_t``).

    Scores, Gram matrices and rewards are zeroed there, so the estimator is ``Σ_t m'_t s_t (G'_t − B_t)`` and
    ``group_moments``' target ``E[Σ_t m'_t s_t G'_t]`` is its baseline-free mean (F1 (b) with ``m'_t``).
    """
    enum = case.enum
    hole = torch.zeros_like(enum.mask)
    hole[:, 1:] = (enum.tokens[:, :-1] == 1).double()
    mask = enum.mask * (1 - hole)
    pair = mask[:, :, None] * mask[:, None, :]
    holed = dataclasses.replace(
        enum,
        mask=mask,
        log_probs=enum.log_probs * mask,
        energy=enum.energy * mask,
        gram=enum.gram * pair,
        scores=enum.scores * mask[..., None],
        sum_pi_squared=torch.where(mask > 0, enum.sum_pi_squared, 1.0),
    )
    return PolicyCase(holed, case.rewards * mask, case.outcome)


@given(policy_cases(eos=True, **SMALL), st.sampled_from(sorted(ESTIMATORS)), st.booleans(), st.booleans())
def test_f7_leave_one_out_unbiased_with_holes_and_zero_epsilon(case, name, multi_turn, zero_tail):
    """F7 (a) for every ``ε >= 0``: ``ε = 0``, holes inside responses, multi-turn alignment and the zero tail.

    Tolerance as test_f7_leave_one_out_unbiased (sums over <= 40³ multisets), 1e-10, scaled by the estimator's
    RMS size ``1 + sqrt(E||ĝ||²)``: with ``ε = 0`` a baseline is a ratio of tiny energies, and one random example gave
    a bias of 1.02e-10 from rounding alone (an absolute 1e-10 then failed on a fresh clone).
    """
    holed = _with_holes(case)
    flags = dict(leave_one_out=True, std_normalize=False, epsilon=0.0)
    if ESTIMATORS[name].granularity == "token":
        flags.update(multi_turn=multi_turn, handle_zero_tail=zero_tail)
    for group_size in (2, 3):
        moments = group_moments(holed.enum, holed.rewards, name, group_size, **flags)
        assert moments.bias_norm < 1e-10 * (1 + moments.second_moment**0.5), group_size


def test_f7_holes_case_has_holes():
    """The hole construction above does make interior holes (guard against a vacuous test)."""
    holed = _with_holes(_parity_case(SharedPolicy(3, 3, seed=1)))
    mask = holed.enum.mask
    interior = (mask[:, :-1] == 0) & (mask[:, 1:] == 1)
    assert bool(interior.any())


# ---------------------------------------------------------------------------------------------------------------
# §4 details checked by hand: handle_zero_tail, multi-turn slots, ε = 0 with zero energies and holes.
# ---------------------------------------------------------------------------------------------------------------


def test_f7_handle_zero_tail_by_hand():
    """Group of two, lengths 3 and 1, outcome rewards 1 and 0, include-self token mean (ε irrelevant: counts).

    t = 0: both alive, baseline 1/2: advantages 1/2 and −1/2. t = 1, 2: only the long one is alive, so its
    include-self baseline is its own return 1 and its advantage 0; with handle_zero_tail the baseline beyond
    the second-longest length (1) is zeroed and the advantage is the return 1. With a tie for the longest,
    nothing is zeroed. The multi-turn variant with a hole gives the same numbers at generated-token slots.
    """
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    plain, _ = compute_advantages("token_mean", rewards, mask, [0, 0])
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64))
    tail, _ = compute_advantages("token_mean", rewards, mask, [0, 0], handle_zero_tail=True)
    torch.testing.assert_close(tail, torch.tensor([[0.5, 1.0, 1.0], [-0.5, 0.0, 0.0]], dtype=torch.float64))
    # A tie for the longest (3, 3, 1): no unique longest, nothing zeroed.
    tie_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    tie_mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    plain, _ = compute_advantages("token_mean", tie_rewards, tie_mask, [0, 0, 0])
    tail, _ = compute_advantages("token_mean", tie_rewards, tie_mask, [0, 0, 0], handle_zero_tail=True)
    torch.testing.assert_close(tail, plain, rtol=0, atol=0)
    torch.testing.assert_close(plain[:, 1:], torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
    # Multi-turn: a hole (tool output) at column 1 of the long response; slots 0, 1, 2 = columns 0, 2, 3.
    mt_rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mt_mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    for zero_tail, later in [(False, 0.0), (True, 1.0)]:
        adv, _ = compute_advantages(
            "token_mean", mt_rewards, mt_mask, [0, 0], multi_turn=True, handle_zero_tail=zero_tail
        )
        want = torch.tensor([[0.5, 0.0, later, later], [-0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
        torch.testing.assert_close(adv, want, rtol=0, atol=0)


def test_f7_multi_turn_aligns_by_generated_token_by_hand():
    """Multi-turn: the k-th generated token of one response is compared with the k-th of the other.

    Rows (mask, per-token reward): A = (1, 0, 1), rewards (0, 0, 2); B = (1, 1, 0), rewards (0, 4, 0).
    Generated slots: A at columns 0, 2; B at 0, 1. G (at generated tokens): A = (2, 2), B = (4, 4).
    token_length, leave-one-out: W at slot k is k + 1 for both, so A's baseline at every slot is B's G = 4
    and B's is A's = 2. Advantages: A = (−2, ·, −2), B = (2, 2, ·). Absolute alignment differs: at column 1
    only B is alive and at column 2 only A, so their leave-one-out baselines there are 0.
    """
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.0, 4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, _ = compute_advantages("token_length", rewards, mask, [7, 7], leave_one_out=True, multi_turn=True)
    torch.testing.assert_close(adv, torch.tensor([[-2.0, 0.0, -2.0], [2.0, 2.0, 0.0]], dtype=torch.float64))
    adv, _ = compute_advantages("token_length", rewards, mask, [7, 7], leave_one_out=True)
    torch.testing.assert_close(adv, torch.tensor([[-2.0, 0.0, 2.0], [2.0, 4.0, 0.0]], dtype=torch.float64))


def test_f7_zero_epsilon_zero_energy_is_plain_mean_not_nan():
    """ε = 0 and a position where every energy is 0 (π(y) = 1, Σπ² = 1): 0/0 is the members' plain mean (THEORY §3),
    not NaN and not 0.

    Two responses, two tokens; at t = 0 both are certain (w = 0), at t = 1 both have w = 1/2 (π = (1/2, 1/2)).
    OTB: W_0 = 0 for both: baseline the plain mean of G_0 = (1 + 3)/2. W_1 = 1/2 for both: the same mean of G_1.
    """
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    log_probs = torch.tensor([[0.0, math.log(0.5)], [0.0, math.log(0.5)]], dtype=torch.float64)
    sum_pi_squared = torch.tensor([[1.0, 0.5], [1.0, 0.5]], dtype=torch.float64)
    adv, _ = compute_advantages(
        "otb", rewards, mask, [0, 0], old_log_probs=log_probs, sum_pi_squared=sum_pi_squared, epsilon=0.0
    )
    # w = 1 − 2 exp(log 1/2) + 1/2 is 1/2 to one ulp: atol 1e-15 on values of size 3.
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    adv, _ = compute_advantages(
        "otb",
        rewards,
        mask,
        [0, 0],
        old_log_probs=log_probs,
        sum_pi_squared=sum_pi_squared,
        epsilon=0.0,
        leave_one_out=True,
    )
    # Leave-one-out: at both positions the baseline is the other's G (a mean of one member).
    torch.testing.assert_close(adv, torch.tensor([[-2.0, -2.0], [2.0, 2.0]], dtype=torch.float64), rtol=0, atol=1e-15)


@given(rollout_batches(), st.sampled_from(sorted(ESTIMATORS)), st.booleans(), st.booleans(), st.booleans())
def test_f7_zero_epsilon_with_holes_matches_loop(batch, name, leave_one_out, multi_turn, zero_tail):
    """ε = 0 (no guard in any denominator) with holes: compute_advantages equals the loop oracle, all finite.

    Tolerance as tests/test_otb_ref/test_advantages.py (TOL): energies >= 6e-6 in these batches, leave-one-out
    subtraction loses <= 1e-16 / 6e-6 relative; rtol = atol = 1e-9.
    """
    flags = dict(leave_one_out=leave_one_out, std_normalize=False, epsilon=0.0)
    if ESTIMATORS[name].granularity == "token":
        flags.update(multi_turn=multi_turn, handle_zero_tail=zero_tail)
    got, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs, **flags)
    want, _ = oracle_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs, **flags)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@given(rollout_batches(), st.sampled_from(["grpo", "token_mean", "opo", "token_length"]), st.booleans())
def test_f7_counts_divide_exactly_whatever_epsilon(batch, name, leave_one_out):
    """proofs/F7 remark: uniform and length weights divide exactly (ε only guards energy sums), so (b) holds as
    written for every ε: the advantages with ε = 0.5 are those with ε = 0 (std scaling off: it does read ε).

    Tolerance: the same arithmetic on both sides, bit for bit.
    """
    flags = dict(leave_one_out=leave_one_out, std_normalize=False)
    with_is = name in ("opo", "token_length")  # length energy: Σ ρ̄², a sum that still divides exactly
    inputs = dict(batch.inputs, rollout_is_weights=batch.rollout_is_weights) if with_is else {}
    exact, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **inputs, epsilon=0.0, **flags)
    guarded, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **inputs, epsilon=0.5, **flags)
    torch.testing.assert_close(guarded, exact, rtol=0, atol=0)
