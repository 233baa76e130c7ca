"""The edge rules of THEORY §3, on the readable form, the fast path and the verl-compatible wrappers.

Every baseline is a convex combination of its members' values, ``B = (Σ a G + ε Ḡ) / (Σ a + ε)`` (Ḡ the members'
plain mean; Ḡ where the denominator is 0), so, whatever the energies (confident tokens whose energies cancel to 0,
all-zero IS weights, ε = 0):
* without std scaling, ``|A| = |G − B|`` never exceeds the spread of the members' values at its coordinate;
* a group whose members' returns are equal gets ``A = 0`` (up to rounding);
* with std scaling, ``|A| ≤ √(2 D_g)`` (proofs/F7, remark "What σ is"), tied totals included.
Exempt by convention (B = 0): groups of one, a leave-one-out row with no other member alive at its coordinate,
and ``handle_zero_tail``'s tail.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import rollout_batches

from otb_ref import (
    ESTIMATORS,
    compute_advantages,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    readable,
)


def _coordinates(mask: torch.Tensor, multi_turn: bool) -> list[list[int]]:
    """Each row's coordinate per position: generated-token rank (multi-turn) or the position; -1 off the mask."""
    out = []
    for row in mask.tolist():
        rank = itertools.count()
        out.append([(next(rank) if multi_turn else t) if m else -1 for t, m in enumerate(row)])
    return out


def _members_and_exempt(mask, index, granularity, leave_one_out, multi_turn, zero_tail):
    """For each valid (i, t): the rows whose values the baseline averages (i included, for the spread) and whether
    the position is exempt (B = 0 by convention)."""
    batch, length = mask.shape
    coords = _coordinates(mask, multi_turn and granularity == "token")
    lengths = [int(x) for x in mask.sum(-1).tolist()]
    counted = [lengths[i] > 0 or not multi_turn for i in range(batch)]
    groups = {}
    for i, key in enumerate(index):
        if counted[i]:
            groups.setdefault(key, []).append(i)
    result = {}
    for i in range(batch):
        rows = groups.get(index[i], [])
        for t in range(length):
            if coords[i][t] < 0:
                continue
            if granularity == "sequence":
                alive = [(j, 0) for j in rows]
            else:
                alive = [(j, coords[j].index(coords[i][t])) for j in rows if coords[i][t] in coords[j]]
            others = [j for j, _ in alive if j != i]
            ordered = sorted((lengths[j] for j in rows), reverse=True)
            tail = (
                zero_tail
                and len(rows) >= 2
                and ordered[0] > ordered[1]
                and lengths[i] == ordered[0]
                and (coords[i][t] if multi_turn else t) >= ordered[1]
            )
            exempt = len(rows) < 2 or (leave_one_out and not others) or tail
            result[i, t] = (alive, exempt)
    return result


def _values(granularity, rewards, mask):
    G = readable.returns_to_go(rewards.double(), (mask != 0).double())
    return G[:, :1].expand_as(G) if granularity == "sequence" else G


def _estimates(name, batch, flags, inputs):
    """The fast path and the readable form (and verl's wrappers for OTB with their defaults' flags)."""
    out = {
        "fast": compute_advantages(name, batch.rewards, batch.mask, batch.index, **inputs, **flags)[0],
        "readable": readable.advantages(name, batch.rewards, batch.mask, batch.index, **inputs, **flags)[0],
    }
    if name == "otb" and not flags["leave_one_out"] and not flags["std_normalize"]:
        wrapper = (
            compute_multi_turn_optimal_token_baseline_advantage
            if flags["multi_turn"]
            else compute_optimal_token_baseline_advantage
        )
        out["verl_wrapper"] = wrapper(
            batch.rewards,
            batch.mask,
            batch.index,
            inputs["old_log_probs"],
            inputs["sum_pi_squared"],
            rollout_is_weights=inputs.get("rollout_is_weights"),
            handle_zero_tail=flags["handle_zero_tail"],
            epsilon=flags["epsilon"],
        )[0]
    return out


@given(
    rollout_batches(uniform_mix=0.0),
    st.sampled_from(sorted(ESTIMATORS)),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.0, 1e-8, 1e-2]),
    st.sampled_from(["ordinary", "confident", "zero_is"]),
)
def test_f7_without_std_every_advantage_is_within_its_members_spread(
    batch, name, leave_one_out, multi_turn, zero_tail, with_is, epsilon, energies
):
    """|G − B| ≤ max − min of the members' values at the coordinate (THEORY §3), for every estimator and flag,
    with energies as drawn, confident (log π = −1e−4, energies ~1e−8 and rounding), or all IS weights 0.
    Tolerance: rounding of fp64 sums, 1e-9 (1 + max|G|) (the leave-one-out "all minus own" form loses ~1e-16 of
    the own weight; energies here are >= 1e-10 or exactly 0)."""
    spec = ESTIMATORS[name]
    token = spec.granularity == "token"
    flags = dict(
        leave_one_out=leave_one_out,
        std_normalize=False,
        multi_turn=multi_turn and token,
        handle_zero_tail=zero_tail and token,
        epsilon=epsilon,
    )
    inputs = dict(batch.inputs)
    if energies == "confident":
        inputs["old_log_probs"] = torch.full_like(batch.old_log_probs, -1e-4)
        top = math.exp(-1e-4)
        inputs["sum_pi_squared"] = torch.full_like(batch.sum_pi_squared, top**2 + (1 - top) ** 2)
    if spec.energy in ("length", "proxy") and (with_is or energies == "zero_is"):
        inputs["rollout_is_weights"] = batch.rollout_is_weights * (energies != "zero_is")
    G = _values(spec.granularity, batch.rewards, batch.mask)
    scale = 1e-9 * (1.0 + (float(G.abs().max()) if G.numel() else 0.0))
    cells = _members_and_exempt(
        batch.mask, batch.index, spec.granularity, leave_one_out, flags["multi_turn"], flags["handle_zero_tail"]
    )
    for form, adv in _estimates(name, batch, flags, inputs).items():
        for (i, t), (alive, exempt) in cells.items():
            if exempt:
                assert float(adv[i, t]) == pytest.approx(float(G[i, t]), abs=scale), (form, i, t)
                continue
            values = [float(G[j, u]) for j, u in alive]
            assert abs(float(adv[i, t])) <= max(values) - min(values) + scale, (form, i, t, values)


CONFIDENT = math.exp(-1e-4)


def _equal_outcome_batch(dtype, confident: bool, lengths=(5, 5, 5, 5, 3, 5, 4, 5)):
    batch, length = len(lengths), max(lengths)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)
    rewards = torch.zeros(batch, length, dtype=dtype)
    rewards[torch.arange(batch), torch.tensor(lengths) - 1] = 1.0
    if confident:
        log_probs = torch.full((batch, length), -1e-4, dtype=dtype)
        sum_pi_squared = torch.full((batch, length), CONFIDENT**2 + (1 - CONFIDENT) ** 2, dtype=dtype)
    else:
        g = torch.Generator().manual_seed(0)
        log_probs = -torch.rand(batch, length, generator=g, dtype=torch.float64).to(dtype) * 2
        sum_pi_squared = (log_probs.double().exp() ** 2 + 0.1).clamp(max=1.0).to(dtype)
    index = [0] * (batch // 2) + [1] * (batch - batch // 2)
    return rewards, mask, index, log_probs, sum_pi_squared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("confident", [True, False])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_f7_equal_outcome_groups_get_no_advantage(dtype, confident, name):
    """Groups of four responses, all with R = 1 (varying lengths): |A| ≤ 1e-3 under every flag, outside the exempt
    positions (before the rule: A = 1 under sequence_proxy and otb with confident fp32 tokens, |A| up to 1e7 with
    std scaling)."""
    rewards, mask, index, log_probs, sum_pi_squared = _equal_outcome_batch(dtype, confident)
    token = ESTIMATORS[name].granularity == "token"
    inputs = dict(
        old_log_probs=log_probs,
        sum_pi_squared=sum_pi_squared,
        grad_norms_sq=torch.full((len(index),), 1e-12, dtype=dtype),
        cumulative_energy=torch.full_like(rewards, 1e-12) * mask,
    )
    if ESTIMATORS[name].energy in ("length", "proxy"):
        inputs["rollout_is_weights"] = torch.ones_like(rewards)
    for loo, std, mt, zt, eps in itertools.product(
        [False, True], [False, True], [False, True], [False, True], [0.0, 1e-8]
    ):
        if not token and (mt or zt):
            continue
        flags = dict(leave_one_out=loo, std_normalize=std, multi_turn=mt, handle_zero_tail=zt, epsilon=eps)
        cells = _members_and_exempt(mask, index, ESTIMATORS[name].granularity, loo, mt, zt)
        keep = torch.zeros_like(mask, dtype=torch.bool)
        for (i, t), (_, exempt) in cells.items():
            keep[i, t] = not exempt
        for form in ("fast", "readable"):
            fn = compute_advantages if form == "fast" else readable.advantages
            adv = fn(name, rewards, mask, index, **inputs, **flags)[0]
            worst = float(adv.abs()[keep].max())
            assert worst <= 1e-3, (form, flags, worst)


def _tied_dense(dtype, seed=0):
    """fp32/fp64 dense rewards in [0, 1] whose totals are 1 up to rounding, confident tokens, 2 groups of 4."""
    rng = np.random.default_rng(seed)
    rewards = np.zeros((8, 6))
    for i in range(8):
        parts = rng.uniform(size=6)
        rewards[i] = parts / parts.sum()
    rewards = torch.tensor(rewards).to(dtype)
    mask = torch.ones_like(rewards)
    log_probs = torch.full_like(rewards, -1e-4)
    sum_pi_squared = torch.full_like(rewards, CONFIDENT**2 + (1 - CONFIDENT) ** 2)
    return rewards, mask, [0] * 4 + [1] * 4, log_probs, sum_pi_squared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_f7_std_scaling_of_tied_totals_stays_within_the_bound(dtype, name):
    """Totals that tie only up to rounding (e.g. 1.0 vs 0.99999988 in fp32): |A| ≤ √(2 D_g) after std scaling for
    every estimator (before the rule: |A| = 1.3e7 under sequence_proxy), so also ≤ 100 for rewards in [0, 1].
    D_g = Σ_p (n_p − 1)₊: N − 1 = 3 for sequence cells, 6 positions × 3 for token cells.

    fp32 inputs: B and σ are formed in fp64, whose rounding is ~1e-9 of an fp32 ulp: the bound holds as stated.
    fp64 inputs whose totals differ by a few fp64 ulps: B, x̄ and σ are rounded at the scale of the spread itself,
    so the bound holds up to that rounding (measured: up to 1.3 × √(2 D_g)); asserted: 2 × √(2 D_g) ≤ 100."""
    rewards, mask, index, log_probs, sum_pi_squared = _tied_dense(dtype)
    token = ESTIMATORS[name].granularity == "token"
    inputs = dict(
        old_log_probs=log_probs,
        sum_pi_squared=sum_pi_squared,
        grad_norms_sq=torch.full((8,), 1e-12, dtype=dtype),
        cumulative_energy=torch.full_like(rewards, 1e-12),
    )
    bound = math.sqrt(2 * (18 if token else 3)) * (1.0 if dtype == torch.float32 else 2.0)
    for loo, eps in itertools.product([False, True], [0.0, 1e-8]):
        flags = dict(leave_one_out=loo, std_normalize=True, epsilon=eps)
        for fn in (compute_advantages, readable.advantages):
            adv = fn(name, rewards, mask, index, **inputs, **flags)[0]
            assert float(adv.abs().max()) <= bound, (fn.__name__, flags, float(adv.abs().max()))
