"""Side by side with the authors' implementation (verl 0.9.1, installed by .ci/run).

The verl functions are run, not copied: this file imports them. Skipped with a
reason where verl is not installed (`pip install -e ".[verl]"`).
"""

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from optional import import_or_skip
from strategies import rollout_batches

import otb_ref
from otb_ref import readable

pytestmark = pytest.mark.usefixtures("row_blocking")

core_algos = import_or_skip("verl.trainer.ppo.core_algos", reason="verl not installed (pip install -e .[verl])")

# fp64: the same arithmetic up to summation order. fp32: the 1e-6 contract.
TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-6, atol=1e-6)}


def _verl_index(index):
    return np.array(index, dtype=object)


@given(rollout_batches(), st.booleans(), st.booleans(), st.booleans(), st.sampled_from([torch.float32, torch.float64]))
def test_otb_matches_verl(batch, multi_turn, handle_zero_tail, with_is, dtype):
    """compute_(multi_turn_)optimal_token_baseline_advantage: same advantages and returns as verl."""
    args = (
        batch.rewards.to(dtype),
        batch.mask.to(dtype),
        None,
        batch.old_log_probs.to(dtype),
        batch.sum_pi_squared.to(dtype),
    )
    is_weights = batch.rollout_is_weights.to(dtype) if with_is else None
    ours_fn = (
        otb_ref.compute_multi_turn_optimal_token_baseline_advantage
        if multi_turn
        else otb_ref.compute_optimal_token_baseline_advantage
    )
    theirs_fn = (
        core_algos.compute_multi_turn_optimal_token_baseline_advantage
        if multi_turn
        else core_algos.compute_optimal_token_baseline_advantage
    )
    ours = ours_fn(
        args[0], args[1], batch.index, *args[3:], rollout_is_weights=is_weights, handle_zero_tail=handle_zero_tail
    )
    theirs = theirs_fn(
        args[0].clone(),
        args[1].clone(),
        _verl_index(batch.index),
        *(a.clone() for a in args[3:]),
        rollout_is_weights=None if is_weights is None else is_weights.clone(),
        handle_zero_tail=handle_zero_tail,
    )
    torch.testing.assert_close(ours[1], theirs[1].to(ours[1].dtype), **TOLERANCES[dtype])  # returns: the same
    # Advantages: verl's baseline is Σ W G / (Σ W + ε), otb_ref's (Σ W G + ε Ḡ) / (Σ W + ε) (THEORY §3): they differ
    # by ε |Ḡ| / (Σ W + ε) ≤ ε max_j |G_t^j| / (Σ_j W_t^j + ε) at each position, besides rounding.
    tol = TOLERANCES[dtype]
    bound = _epsilon_share(batch, is_weights, multi_turn) + tol["atol"] + tol["rtol"] * theirs[0].abs().double()
    assert bool(((ours[0].double() - theirs[0].double()).abs() <= bound).all())


def _epsilon_share(batch, is_weights, multi_turn, epsilon=1e-8):
    """``ε max_j |G_t^j| / (Σ_j W_t^j + ε)`` over each row's group at its coordinate (rank with multi-turn), [B, T]."""
    mask = batch.mask.double()
    rho = None if is_weights is None else is_weights.double() * mask
    _, W = readable.energies(
        otb_ref.ESTIMATORS["otb"],
        mask,
        old_log_probs=batch.old_log_probs.double() * mask,
        sum_pi_squared=batch.sum_pi_squared.double() * mask,
        rollout_is_weights=rho,
    )
    weight, size = W * mask, readable.returns_to_go(batch.rewards.double(), mask).abs() * mask
    if multi_turn:
        slot = readable.generated_token_rank(mask)
        weight, size = readable.to_slots(weight, slot), readable.to_slots(size, slot)
    same = torch.tensor([[a == b for b in batch.index] for a in batch.index], dtype=torch.bool)
    total = same.double() @ weight  # Σ_j W_t^j
    largest = torch.stack([size[row].max(dim=0).values for row in same])  # max_j |G_t^j|
    share = epsilon * largest / (total + epsilon)
    return share.gather(1, slot.clamp(max=mask.shape[1] - 1)) if multi_turn and mask.shape[1] else share


def test_otb_differs_from_verl_by_the_epsilon_share_on_a_degenerate_group():
    """Four responses with R = 1 and deterministic tokens (π(y) = 1, Σπ² = 1: every energy is exactly 0; confident
    fp32 tokens come close, their energies cancel to rounding). verl's Σ W G / (Σ W + ε) leaks to 0 and gives A = 1;
    otb_ref's baseline is the members' mean, A = 0 (PORTING.md)."""
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = 1.0
    mask = torch.ones(4, 3)
    log_probs, sum_pi_squared = torch.zeros(4, 3), torch.ones(4, 3)
    ours, _ = otb_ref.compute_optimal_token_baseline_advantage(rewards, mask, [0] * 4, log_probs, sum_pi_squared)
    theirs, _ = core_algos.compute_optimal_token_baseline_advantage(
        rewards, mask, _verl_index([0] * 4), log_probs, sum_pi_squared
    )
    assert float(ours.abs().max()) == 0.0
    assert float((theirs - 1.0).abs().max()) < 1e-6


def test_otb_defaults_match_verl():
    """Same named parameters, order and defaults (verl's registry-only **kwargs aside)."""
    import inspect

    for name in ["compute_optimal_token_baseline_advantage", "compute_multi_turn_optimal_token_baseline_advantage"]:
        ours, theirs = (
            {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.kind != p.VAR_KEYWORD}
            for fn in (getattr(otb_ref, name), getattr(core_algos, name))
        )
        assert list(ours.items()) == list(theirs.items())


@given(rollout_batches(dense_rewards=False), st.booleans())
def test_grpo_matches_verl(batch, std_normalize):
    """GRPO (std scaling on/off) with verl's epsilon 1e-6; a singleton differs by 1/(1+1e-6) there, hence rtol 2e-6."""
    ours, _ = otb_ref.compute_advantages(
        "grpo", batch.rewards, batch.mask, batch.index, std_normalize=std_normalize, epsilon=1e-6
    )
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        batch.rewards.clone(),
        batch.mask.clone(),
        _verl_index(batch.index),
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=std_normalize,
    )
    # Groups of two or more whose returns are all equal (zero spread): their mean's rounding (<= 2 ulp of |R|) is
    # left unscaled here (THEORY §3) and divided by std + ε ≈ 1e-6 in verl: up to 2 · 2.2e-16 · |R| / 1e-6 apart.
    R = (batch.rewards * batch.mask).sum(-1)
    members = [[j for j, k in enumerate(batch.index) if k == key] for key in batch.index]
    equal = torch.tensor([len(rows) > 1 and bool((R[rows] == R[rows[0]]).all()) for rows in members])
    theirs = theirs.to(ours.dtype)
    torch.testing.assert_close(ours[~equal], theirs[~equal], rtol=2e-6, atol=1e-12)
    bound = 4.5e-10 * R.abs().max().item() + 1e-12
    torch.testing.assert_close(ours[equal], theirs[equal], rtol=0, atol=bound if std_normalize else 1e-12)


@given(rollout_batches(dense_rewards=False))
def test_rloo_and_opo_match_verl(batch):
    """RLOO (leave-one-out mean) and OPO (length-weighted mean) as in verl (ε = 0 there)."""
    index = _verl_index(batch.index)
    for ours_name, theirs_fn in [
        ("rloo", core_algos.compute_rloo_outcome_advantage),
        ("opo", core_algos.compute_opo_outcome_advantage),
    ]:
        ours, _ = otb_ref.compute_advantages(ours_name, batch.rewards, batch.mask, batch.index, epsilon=0.0)
        theirs, _ = theirs_fn(batch.rewards.clone(), batch.mask.clone(), index)
        # verl's OPO divides 0/0 for a group whose responses are all empty; otb_ref gives baseline 0 there.
        defined = torch.isfinite(theirs)
        torch.testing.assert_close(ours[defined], theirs[defined].to(ours.dtype), rtol=1e-10, atol=1e-10)


@given(rollout_batches(), st.booleans(), st.one_of(st.none(), st.floats(0.0, 3.0)))
def test_variance_proxy_metrics_match_verl(batch, with_is, grad_norm):
    """variance_proxy_metrics equals verl's compute_variance_proxy_metrics key by key."""
    metric_utils = pytest.importorskip("verl.trainer.ppo.metric_utils")
    from verl import DataProto

    advantages, _ = otb_ref.compute_advantages("otb", batch.rewards, batch.mask, batch.index, **batch.inputs)
    tensors = {
        "advantages": advantages,
        "response_mask": batch.mask,
        "old_log_probs": batch.old_log_probs,
        "sum_pi_squared": batch.sum_pi_squared,
    }
    if with_is:
        tensors["rollout_is_weights"] = batch.rollout_is_weights
        # verl recovers the unweighted energy as (w ρ²) / clamp(ρ², 1e-10): for ρ_t < 1e-5 on the mask that
        # under-counts w_t, while ours uses w_t itself (test_variance_proxy_with_tiny_is_weights_keeps_the_energy).
        assume(not bool(((batch.rollout_is_weights.square() < 1e-10) & batch.mask.bool()).any()))
    theirs = metric_utils.compute_variance_proxy_metrics(
        DataProto.from_dict(tensors={k: v.clone() for k, v in tensors.items()}), gradient_norm=grad_norm
    )
    ours = otb_ref.variance_proxy_metrics(
        advantages,
        batch.mask,
        batch.old_log_probs,
        batch.sum_pi_squared,
        rollout_is_weights=batch.rollout_is_weights if with_is else None,
        grad_norm=grad_norm,
    )
    assert set(ours) == set(theirs)
    for key in ours:
        assert ours[key] == pytest.approx(float(theirs[key]), rel=1e-6, abs=1e-6), key


def test_variance_proxy_with_tiny_is_weights_keeps_the_energy():
    """A valid ρ_t below 1e-5 (where verl's clamp-based recovery of w_t differs): P = mean(ρ̄² a² Σ_t w_t) exactly."""
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    old_log_probs = torch.log(torch.tensor([[0.5, 0.25], [0.2, 0.9]], dtype=torch.float64))
    sum_pi_squared = torch.tensor([[0.5, 0.3], [0.4, 0.85]], dtype=torch.float64)
    rho = torch.tensor([[1e-7, 1.0], [1.0, 1.0]], dtype=torch.float64)
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    expected = ((rho.mean(dim=1) ** 2) * advantages.mean(dim=1) ** 2 * w.sum(dim=1)).mean()
    got = otb_ref.variance_proxy_metrics(advantages, mask, old_log_probs, sum_pi_squared, rollout_is_weights=rho)
    assert got["variance_proxy/proxy2_total_power"] == pytest.approx(float(expected), rel=1e-12)
