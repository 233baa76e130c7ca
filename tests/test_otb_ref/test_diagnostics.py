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


def _inputs(rows: int, with_is: bool = False) -> dict:
    """Rows of 3 tokens with π(y) = 1/2 and Σπ² = 1/2: w_t = 1 − 1 + 1/2 = 1/2, v = 3/2; advantage 1."""
    inputs = dict(
        advantages=torch.ones(rows, 3, dtype=torch.float64),
        response_mask=torch.ones(rows, 3),
        old_log_probs=torch.full((rows, 3), math.log(0.5), dtype=torch.float64),
        sum_pi_squared=torch.full((rows, 3), 0.5, dtype=torch.float64),
    )
    if with_is:
        inputs["rollout_is_weights"] = torch.ones(rows, 3, dtype=torch.float64)
    return inputs


def test_noise_is_zero_for_one_row_and_p_minus_s_over_b_minus_1_from_two():
    """The docstring's rule: noise = max(0, (P − S)/(B − 1)) and 0 for B = 1 (P = v a² = 3/2, S = 0.5² here)."""
    one = variance_proxy_metrics(**_inputs(1), grad_norm=0.5)
    assert one["variance_proxy/proxy3_pure_noise"] == 0.0
    assert one["variance_proxy/proxy2_total_power"] == pytest.approx(1.5, rel=1e-15)
    two = variance_proxy_metrics(**_inputs(2), grad_norm=0.5)
    assert two["variance_proxy/proxy3_pure_noise"] == pytest.approx((1.5 - 0.25) / 1, rel=1e-15)
    three = variance_proxy_metrics(**_inputs(3), grad_norm=0.5)
    assert three["variance_proxy/proxy3_pure_noise"] == pytest.approx((1.5 - 0.25) / 2, rel=1e-15)


@pytest.mark.parametrize("with_is", [False, True])
def test_an_empty_batch_gives_zero_metrics(with_is):
    """B = 0: every mean over no rows is reported as 0 (the docstring's convention), not NaN."""
    got = variance_proxy_metrics(**_inputs(0, with_is), grad_norm=None)
    assert got == {key: 0.0 for key in got} and len(got) == 5


@pytest.mark.parametrize("name", ["advantages", "old_log_probs", "sum_pi_squared", "rollout_is_weights"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_every_input_but_the_mask_must_be_finite_on_the_mask(name, bad):
    """A non-finite value at a generated token is refused, naming its argument; the same value off the mask is
    ignored (the validation rule of PORTING.md)."""
    inputs = _inputs(2, with_is=True)
    inputs[name] = inputs[name].clone()
    inputs[name][1, 2] = bad
    with pytest.raises(ValueError, match=f"^{name}"):
        variance_proxy_metrics(**inputs)
    inputs["response_mask"][1, 2] = 0
    variance_proxy_metrics(**inputs)


def test_negative_is_weights_are_refused():
    inputs = _inputs(2, with_is=True)
    inputs["rollout_is_weights"][0, 1] = -0.5
    with pytest.raises(ValueError, match="^rollout_is_weights"):
        variance_proxy_metrics(**inputs)


@pytest.mark.parametrize("shape", [(3,), (2, 3, 1)])
def test_advantages_must_be_batch_by_tokens(shape):
    inputs = _inputs(2)
    inputs["advantages"] = torch.ones(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="^advantages"):
        variance_proxy_metrics(**inputs)
