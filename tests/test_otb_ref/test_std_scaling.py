"""Std scaling (``std_normalize``) divides by the spread of what each cell's baseline centres (THEORY §3).

Sequence cells centre ``R``: GRPO's unbiased std of the group's returns. Token cells centre ``G_t`` per position:
the std pooled within positions. A group with zero spread is left unscaled. These tests assert theorems of that
definition; the loop oracle (conformance/ports/numpy_port.py, test_advantages.py) checks every value.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import rollout_batches

from otb_ref import ESTIMATORS, compute_advantages

pytestmark = pytest.mark.usefixtures("row_blocking")

# Cells whose baseline (ε = 0 for counts) is a weighted mean of the alive values it centres, weights > 0.
CONVEX = ["grpo", "rloo", "opo", "token_mean", "token_length"]


def _coordinates(batch, granularity: str, multi_turn: bool) -> dict:
    """{group id: list of alive columns}: R per group (sequence), or G_t per position / rank (token)."""
    mask = batch.mask.bool()
    G = (batch.rewards * batch.mask).flip(-1).cumsum(-1).flip(-1)
    groups: dict = {}
    for i, key in enumerate(batch.index):
        groups.setdefault(key, []).append(i)
    columns = {}
    for key, rows in groups.items():
        if granularity == "sequence":
            columns[key] = [[float(G[i, 0]) for i in rows]]
            continue
        alive = [G[i][mask[i]].tolist() if multi_turn else None for i in rows]
        T = mask.shape[1]
        if multi_turn:
            columns[key] = [[a[k] for a in alive if k < len(a)] for k in range(T)]
        else:
            columns[key] = [[float(G[i, t]) for i in rows if mask[i, t]] for t in range(T)]
    return columns


def _tie_totals(batch) -> None:
    """Dense rewards shifted so that every non-empty response's total is 0 (totals tie, tokens do not)."""
    lengths = batch.mask.sum(-1, keepdim=True)
    totals = (batch.rewards * batch.mask).sum(-1, keepdim=True)
    batch.rewards = torch.where(batch.mask.bool(), batch.rewards - totals / lengths.clamp(min=1), 0.0)


def _assert_bounded(batch, adv, granularity: str, multi_turn: bool) -> None:
    """``max_t |A_it| ≤ √(2 D_g)`` for every row of a group with two or more counted rows."""
    columns = _coordinates(batch, granularity, multi_turn)
    lengths = batch.mask.sum(-1)
    for i, key in enumerate(batch.index):
        members = [j for j, other in enumerate(batch.index) if other == key and (lengths[j] > 0 or not multi_turn)]
        if len(members) < 2:
            continue  # a group of one has no baseline and no std scaling: A = G
        dof = sum(max(len(c) - 1, 0) for c in columns[key])
        assert float(adv[i].abs().amax() if adv.shape[1] else 0.0) <= math.sqrt(2 * dof) * (1 + 1e-9) + 1e-12


@given(rollout_batches(), st.sampled_from(CONVEX), st.booleans(), st.booleans())
def test_std_scaled_include_self_advantages_are_bounded(batch, name, multi_turn, tie_totals):
    """Include-self convex baselines, groups of two or more: ``|A| ≤ √(2 D_g)``, ``D_g = Σ_p (n_gp − 1)₊`` (theorem).

    ``|G − B| ≤ range_p`` and ``range_p² ≤ 2 SS_p ≤ 2 σ_g² D_g``. The old definition (std of R for token cells)
    broke this by ~1e8 when totals tie while positions differ (``tie_totals``).
    """
    spec = ESTIMATORS[name]
    if tie_totals:
        _tie_totals(batch)
    flags = dict(leave_one_out=False, std_normalize=True)
    if spec.granularity == "token":
        flags["multi_turn"] = multi_turn
    adv, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **flags)
    _assert_bounded(batch, adv, spec.granularity, multi_turn and spec.granularity == "token")


@given(rollout_batches(holes=False, equal_lengths=True), st.sampled_from(CONVEX), st.booleans())
def test_std_scaled_leave_one_out_advantages_are_bounded(batch, name, tie_totals):
    """Leave-one-out, every row alive at every position: the others' mean lies in the column's range too."""
    if tie_totals:
        _tie_totals(batch)
    adv, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, leave_one_out=True, std_normalize=True)
    _assert_bounded(batch, adv, ESTIMATORS[name].granularity, False)


@st.composite
def equal_outcome_groups(draw):
    """Batches whose groups share one outcome reward: every alive ``G_t`` of a group is equal (zero spread)."""
    batch = draw(rollout_batches(dense_rewards=False, allow_empty=False))
    value = {key: draw(st.sampled_from([0.0, 1.0, -0.7, 3.0])) for key in set(batch.index)}
    at_last = batch.mask.bool() & (batch.mask.flip(-1).cumsum(-1).flip(-1) == 1)  # the last generated token
    outcome = torch.tensor([value[key] for key in batch.index], dtype=torch.float64)
    batch.rewards = torch.where(at_last, outcome[:, None], 0.0)
    return batch


@given(equal_outcome_groups(), st.sampled_from(sorted(ESTIMATORS)), st.booleans(), st.booleans(), st.booleans())
def test_zero_spread_leaves_advantages_unscaled(batch, name, leave_one_out, multi_turn, zero_tail):
    """Equal returns in a group: std scaling changes nothing (bitwise), for every cell and flag.

    The old code divided an energy-weighted baseline's ε residue ``G ε / (ΣW + ε)`` by ε (mean |A| = 1e8 for
    confident tokens)."""
    flags = dict(leave_one_out=leave_one_out)
    if ESTIMATORS[name].granularity == "token":
        flags.update(multi_turn=multi_turn, handle_zero_tail=zero_tail)
    plain, _ = compute_advantages(name, batch.rewards, batch.mask, batch.index, **batch.inputs, **flags)
    scaled, _ = compute_advantages(
        name, batch.rewards, batch.mask, batch.index, **batch.inputs, **flags, std_normalize=True
    )
    assert torch.equal(plain, scaled)


@given(rollout_batches(holes=False, equal_lengths=True, dense_rewards=False), st.booleans())
def test_token_std_with_outcome_reward_and_equal_lengths_is_grpo_std(batch, leave_one_out):
    """Outcome reward, equal lengths: ``G_t = R`` at every position, so the pooled token std is GRPO's and
    ``token_mean`` with std scaling equals ``grpo`` (``rloo`` with it, leave-one-out) (theorem)."""
    flags = dict(leave_one_out=leave_one_out, std_normalize=True, epsilon=1e-6)
    token, _ = compute_advantages("token_mean", batch.rewards, batch.mask, batch.index, **flags)
    sequence, _ = compute_advantages("grpo", batch.rewards, batch.mask, batch.index, **flags)
    torch.testing.assert_close(token, sequence, rtol=1e-12, atol=1e-12)


def _confident(batch_size: int, length: int, log_pi: float):
    """log π and Σπ² of a distribution with π_y = e^{log_pi} and the rest spread over 1000 tokens."""
    pi_y = math.exp(log_pi)
    sum_sq = pi_y**2 + (1 - pi_y) ** 2 / 1000
    full = lambda x: torch.full((batch_size, length), x, dtype=torch.float32)  # noqa: E731
    return full(log_pi), full(sum_sq)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_issue_case_all_correct_confident_responses(name, leave_one_out):
    """4 correct responses of 72 tokens, log π = −1e-4 (issue 22): |A| ≤ |R| = 1 (was 1e8 for otb)."""
    mask = torch.ones(4, 72)
    rewards = torch.zeros(4, 72)
    rewards[:, -1] = 1.0
    log_probs, sum_sq = _confident(4, 72, -1e-4)
    extra = dict(grad_norms_sq=torch.full((4,), 1e-6), cumulative_energy=torch.full((4, 72), 1e-6))
    adv, _ = compute_advantages(
        name, rewards, mask, [0] * 4, old_log_probs=log_probs, sum_pi_squared=sum_sq, **extra,
        leave_one_out=leave_one_out, std_normalize=True,
    )  # fmt: skip
    assert float(adv.abs().max()) <= 1.0


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_issue_case_dense_rewards_with_tied_totals(name, leave_one_out):
    """Rewards summing to 1 in every response, spread unevenly, log π = −0.5 (issue 22): |A| ≤ √(2 T (N − 1))
    up to the ε shrink of energy-weighted baselines (was 3e6 to 2.4e7)."""
    generator = torch.Generator().manual_seed(0)
    N, T = 4, 24
    raw = torch.rand(N, T, generator=generator, dtype=torch.float64) ** 3
    rewards = raw / raw.sum(-1, keepdim=True)
    mask = torch.ones(N, T)
    log_probs, sum_sq = _confident(N, T, -0.5)
    cumulative = torch.arange(1, T + 1, dtype=torch.float64).expand(N, T).contiguous()
    adv, _ = compute_advantages(
        name, rewards, mask, [0] * N, old_log_probs=log_probs.double(), sum_pi_squared=sum_sq.double(),
        grad_norms_sq=torch.ones(N, dtype=torch.float64), cumulative_energy=cumulative,
        leave_one_out=leave_one_out, std_normalize=True,
    )  # fmt: skip
    assert float(adv.abs().max()) <= 1.01 * math.sqrt(2 * T * (N - 1))
