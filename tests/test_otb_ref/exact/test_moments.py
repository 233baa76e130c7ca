"""Population baselines: unbiasedness (F1), the quadratic gaps (F3, F4), prefix optimality (F5)."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import policy_cases

from otb_ref.exact.moments import (
    POPULATION_ESTIMATORS,
    estimator_moments,
    outcome_rewards,
    population_advantages,
    population_baseline,
    returns_to_go,
)
from otb_ref.exact.policies import TreePolicy, enumerate_policy

# Exact float64 sums over <= 400 responses of terms of size <= ~100: rounding well below 1e-10.
ATOL = 1e-10


def _variance(case, advantages):
    return estimator_moments(case.enum, advantages, case.rewards).variance


def _sequence_advantages(case, b):
    """a_t = m_t (R − b): the estimator S (R − b) of F3."""
    total = returns_to_go(case.rewards, case.enum.mask)[:, :1]
    return (total - b) * case.enum.mask


def _token_advantages(case, baseline):
    """a_t = m_t (G_t − B_t) for a constant vector B."""
    return (returns_to_go(case.rewards, case.enum.mask) - baseline) * case.enum.mask


@given(policy_cases())
def test_f1_population_baselines_unbiased(case):
    """Every population baseline (constants per position or per sequence) leaves E ĝ = ∇J."""
    for name in POPULATION_ESTIMATORS:
        moments = estimator_moments(case.enum, population_advantages(case.enum, case.rewards, name), case.rewards)
        assert moments.bias_norm < ATOL, name


@given(policy_cases(), st.lists(st.floats(-5, 5), min_size=1, max_size=4))
def test_f3_quadratic_gap(case, offsets):
    """Var(b) = Var(b*) + (b − b*)² E||S||² for ĝ_b = S (R − b), b* = EOB."""
    enum = case.enum
    b_star = float(population_baseline(enum, case.rewards, "eob"))
    var_star = _variance(case, _sequence_advantages(case, b_star))
    energy = float(enum.probs @ enum.sequence_energy_exact)
    for offset in offsets:
        b = b_star + offset
        assert abs(_variance(case, _sequence_advantages(case, b)) - (var_star + offset**2 * energy)) < ATOL * (
            1 + offset**2
        )


@given(policy_cases(), st.integers(0, 2**31 - 1))
def test_f4_separable_gap(case, seed):
    """Var(B) = Var(B**) + Σ_t E[m_t ||s_t||²] (B_t − B**_t)² for any constant vector B."""
    enum = case.enum
    optimal = population_baseline(enum, case.rewards, "optimal")
    var_optimal = _variance(case, _token_advantages(case, optimal))
    weights = enum.probs @ enum.token_energy_exact  # E[m_t ||s_t||²] [L]
    for _ in range(3):
        other = torch.randn(optimal.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
        seed += 1
        predicted = var_optimal + float((weights * (other - optimal) ** 2).sum())
        assert abs(_variance(case, _token_advantages(case, other)) - predicted) < ATOL * (
            1 + float(other.abs().max()) ** 2
        )


@given(policy_cases())
def test_f4_orderings(case):
    """Var(B**) <= every token-level constant baseline; outcome reward: Var(B**) <= Var(EOB) <= Var(any constant)."""
    enum = case.enum
    variance = {
        name: _variance(case, population_advantages(enum, case.rewards, name)) for name in POPULATION_ESTIMATORS
    }
    slack = ATOL * (1 + max(abs(v) for v in variance.values()))
    for name in ["none", "token_mean", "token_length", "otb", "otb_exact"]:
        assert variance["optimal"] <= variance[name] + slack, name
    variance["sequence_none"] = _variance(case, _sequence_advantages(case, 0.0))  # S R: b = 0 in F3's family
    for name in ["sequence_none", "grpo", "opo", "sequence_proxy"]:  # F3: EOB is optimal among constants for S (R − b)
        assert variance["eob"] <= variance[name] + slack, name
    if case.outcome:  # then S (R − b) is the token estimator with B = (b, ..., b)
        for name in ["grpo", "opo", "sequence_proxy", "eob"]:
            assert variance["optimal"] <= variance[name] + slack, name


@given(policy_cases(), st.floats(-5, 5))
def test_f5_otb_exact_is_prefix_optimal(case, offset):
    """B^OTB_t (exact energies) minimises b ↦ E[m_t ||S_t||² (G_t − b)²], with gap (b − B_t)² E[m_t ||S_t||²]."""
    enum = case.enum
    returns = returns_to_go(case.rewards, enum.mask)
    energy = enum.prefix_energy_exact  # m_t ||S_t||²
    otb = population_baseline(enum, case.rewards, "otb_exact")  # [L]

    def objective(b):
        return enum.probs @ (energy * (returns - b) ** 2)  # [L]

    predicted = objective(otb) + offset**2 * (enum.probs @ energy)
    torch.testing.assert_close(objective(otb + offset), predicted, rtol=0, atol=ATOL * (1 + offset**2))


@given(policy_cases(eos=False, outcome=True))
def test_f5_otb_exact_equals_eob_at_last_position(case):
    """Equal lengths and outcome reward: B^OTB_L (exact energies) = b* (EOB)."""
    otb = population_baseline(case.enum, case.rewards, "otb_exact")
    eob = population_baseline(case.enum, case.rewards, "eob")
    assert abs(float(otb[-1]) - float(eob)) < ATOL


class _ScalarPolicy:
    """π(a | h) = σ(θ) at every prefix, one shared parameter; tokens a = 0, b = 1, no EOS (proofs/F5, E1)."""

    vocab, horizon, eos = 2, 3, False

    def __init__(self):
        self.theta = torch.zeros(1, dtype=torch.float64)

    def logits(self, theta, tokens):
        a = theta.expand(*tokens.shape, 1)
        return torch.cat([a, torch.zeros_like(a)], dim=-1)


def test_f5_otb_exact_can_exceed_eob_and_no_baseline():
    """proofs/F5 E1, exactly: Var(OTB exact) = 29/288 > Var(0) = 18/288 > Var(EOB) = 16.5/288 > Var(B**) = 4.5/288."""
    enum = enumerate_policy(_ScalarPolicy(), keep_scores=True)
    words = ["".join("ab"[t] for t in row.tolist()) for row in enum.tokens]
    rewards = outcome_rewards(enum, torch.tensor([1.0 if w in ("abb", "baa") else 0.0 for w in words]))

    def var(name):
        return estimator_moments(enum, population_advantages(enum, rewards, name), rewards).variance

    torch.testing.assert_close(
        population_baseline(enum, rewards, "otb_exact"), torch.tensor([1 / 4, 0, 1 / 12], dtype=torch.float64)
    )
    torch.testing.assert_close(
        population_baseline(enum, rewards, "optimal"), torch.tensor([-1 / 4, 1 / 4, 1 / 4], dtype=torch.float64)
    )
    for name, expected in [
        ("otb_exact", 29 / 288),
        ("none", 18 / 288),
        ("eob", 16.5 / 288),
        ("optimal", 4.5 / 288),
        ("otb", 22.5 / 288),
    ]:
        assert abs(var(name) - expected) < 1e-14, name


@given(policy_cases(kinds=("tree",), eos=False, outcome=True))
def test_f5_tree_otb_between_bstar_and_eob(case):
    """proofs/F5 E2: tree policy, outcome reward, equal lengths: Var(B**) <= Var(OTB) <= Var(EOB)
    (exact = proxy energies there)."""
    variance = {
        n: _variance(case, population_advantages(case.enum, case.rewards, n))
        for n in ["optimal", "otb", "otb_exact", "eob"]
    }
    slack = ATOL * (1 + abs(variance["eob"]))
    for name in ["otb", "otb_exact"]:
        assert variance["optimal"] <= variance[name] + slack
        assert variance[name] <= variance["eob"] + slack


def test_population_baselines_take_names_built_at_run_time():
    """A name read from a config is equal to the literal, not the same object: "optimal" and "none" still work."""
    enum = enumerate_policy(TreePolicy(vocab=3, horizon=2, seed=4))
    rewards = outcome_rewards(enum, (enum.tokens[:, 0] == 1).double())
    for name in ("optimal", "none"):
        torch.testing.assert_close(
            population_baseline(enum, rewards, "".join(name)), population_baseline(enum, rewards, name), rtol=0, atol=0
        )


def test_population_granularity_of_the_names_outside_the_table():
    """ "none" has no baseline, "optimal" (B**_t) is per token; table estimators carry their own granularity."""
    from otb_ref.exact.moments import population_granularity

    assert population_granularity("none") == "none" and population_granularity("optimal") == "token"
    assert population_granularity("".join("none")) == "none"  # a name built at run time
    assert population_granularity("grpo") == "sequence" and population_granularity("otb") == "token"
