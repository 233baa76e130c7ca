"""Variance diagnostics (§5) against their definitions, written out as loops."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import rollout_batches

from otb_ref import compute_advantages, variance_proxy_metrics


@given(rollout_batches(), st.booleans(), st.one_of(st.none(), st.floats(0.0, 3.0)))
def test_metrics_match_definitions(batch, with_is, grad_norm):
    """P = mean_i(W_i a_i²) (ρ̄_i² P-weights with IS), S = ||ḡ||², noise = max(0, (P − S)/(B − 1))."""
    advantages, _ = compute_advantages("otb", batch.rewards, batch.mask, batch.index, **batch.inputs)
    rho = batch.rollout_is_weights if with_is else None
    got = variance_proxy_metrics(
        advantages, batch.mask, batch.old_log_probs, batch.sum_pi_squared, rollout_is_weights=rho, grad_norm=grad_norm
    )
    B, T = advantages.shape
    power = a_sq = w_sum = 0.0
    for i in range(B):
        valid = [t for t in range(T) if batch.mask[i, t]]
        a = sum(float(advantages[i, t]) for t in valid) / max(len(valid), 1)
        w = [
            min(max(1 - 2 * math.exp(float(batch.old_log_probs[i, t])) + float(batch.sum_pi_squared[i, t]), 0.0), 2.0)
            for t in valid
        ]
        if with_is:
            rho_i = sum(float(rho[i, t]) for t in valid) / max(len(valid), 1)
            power += rho_i**2 * a**2 * sum(w)
            w_sum += sum(wt * float(rho[i, t]) ** 2 for wt, t in zip(w, valid))
        else:
            power += a**2 * sum(w)
            w_sum += sum(w)
        a_sq += a**2
    power, a_sq, w_sum = power / B, a_sq / B, w_sum / B
    signal = 0.0 if grad_norm is None else grad_norm**2
    noise = 0.0 if grad_norm is None or B < 2 else max(0.0, (power - signal) / (B - 1))
    expected = {
        "proxy1_signal_strength": signal,
        "proxy2_total_power": power,
        "proxy3_pure_noise": noise,
        "expected_a_squared": a_sq,
        "expected_w": w_sum,
    }
    for key, value in expected.items():
        assert got[f"variance_proxy/{key}"] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_metrics_reject_bad_input():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="^sum_pi_squared"):
        variance_proxy_metrics(a, torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="^grad_norm"):
        variance_proxy_metrics(a, torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3), grad_norm=-1.0)
    with pytest.raises(ValueError, match="^advantages"):
        variance_proxy_metrics(
            a.masked_fill(a == 0, float("nan")), torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
        )
