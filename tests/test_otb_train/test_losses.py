"""otb_train.losses: aggregation with global normalisers, the clipped surrogate, KL estimators."""

import math

import pytest
import torch

from otb_train.losses import AGGREGATIONS, aggregate, clipped_policy_loss, kl_penalty


def _batch(seed=0, rows=6, length=5):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, length, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([1, 5, 3, 2, 5, 4])[:rows]
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return values, mask


def test_aggregation_formulas():
    values, mask = _batch()
    m = mask.double()
    tokens, seqs = float(m.sum()), float(mask.shape[0])
    norm = dict(global_tokens=tokens, global_sequences=seqs)
    assert float(aggregate(values, mask, "token-mean", **norm)) == pytest.approx(float((values * m).sum() / tokens))
    assert float(aggregate(values, mask, "seq-mean-token-sum", **norm)) == pytest.approx(
        float((values * m).sum(1).sum() / seqs)
    )
    per_seq = (values * m).sum(1) / m.sum(1)
    assert float(aggregate(values, mask, "seq-mean-token-mean", **norm)) == pytest.approx(float(per_seq.mean()))
    values_with_nan = torch.where(mask, values, math.nan)  # masked entries are ignored, whatever they hold
    for mode in AGGREGATIONS:
        assert float(aggregate(values_with_nan, mask, mode, **norm)) == pytest.approx(
            float(aggregate(values, mask, mode, **norm))
        )
    with pytest.raises(ValueError, match="mode"):
        aggregate(values, mask, "mean", **norm)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_split_shares_sum_to_the_whole_batch_loss(mode):
    """Micro-batches (or ranks) each divide by the GLOBAL count: their shares add up to the full-batch loss."""
    values, mask = _batch(seed=1)
    norm = dict(global_tokens=float(mask.sum()), global_sequences=float(mask.shape[0]))
    whole = aggregate(values, mask, mode, **norm)
    parts = sum(aggregate(values[rows], mask[rows], mode, **norm) for rows in (slice(0, 1), slice(1, 4), slice(4, 6)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_clipped_policy_loss_on_policy_equals_reinforce_and_its_gradient():
    """With log π = log π_old the ratio is 1: loss = −mean(A), gradient = −A/N per token."""
    values, mask = _batch(seed=2)
    advantages = values
    old = -torch.rand(values.shape, dtype=torch.float64)
    log_probs = old.clone().requires_grad_(True)
    tokens = float(mask.sum())
    loss, stats = clipped_policy_loss(log_probs, old, advantages, mask, global_tokens=tokens, global_sequences=6.0)
    assert float(loss.detach()) == pytest.approx(float(-(advantages * mask).sum() / tokens))
    loss.backward()
    assert torch.allclose(log_probs.grad, torch.where(mask, -advantages / tokens, 0.0))
    assert float(stats["clipped_tokens"]) == 0.0 and float(stats["approx_kl_sum"]) == 0.0


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 4, dtype=torch.float64)
    log_ratio = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]], dtype=torch.float64))
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    log_probs = log_ratio.clone().requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = clipped_policy_loss(
        log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.3, global_tokens=4.0, global_sequences=1.0
    )
    # ratio 1.5, A>0: clipped at 1.3 (no gradient); ratio 1.5, A<0: unclipped (pessimistic) term;
    # ratio 0.5, A>0: unclipped; ratio 0.5, A<0: clipped at 0.8 (no gradient).
    expected = (-1.3 + 1.5 - 0.5 + 0.8) / 4
    assert float(loss.detach()) == pytest.approx(expected)
    loss.backward()
    assert log_probs.grad[0, 0] == 0 and log_probs.grad[0, 3] == 0
    assert log_probs.grad[0, 1] == pytest.approx(1.5 / 4) and log_probs.grad[0, 2] == pytest.approx(-0.5 / 4)
    assert float(stats["clipped_tokens"]) == 2.0


def test_kl_estimators():
    log_probs = torch.log(torch.tensor([0.5, 0.2, 0.9], dtype=torch.float64))
    ref = torch.log(torch.tensor([0.4, 0.3, 0.9], dtype=torch.float64))
    delta = ref - log_probs
    assert torch.allclose(kl_penalty(log_probs, ref, "k1"), -delta)
    assert torch.allclose(kl_penalty(log_probs, ref, "k2"), 0.5 * delta**2)
    k3 = kl_penalty(log_probs, ref, "k3")
    assert torch.allclose(k3, torch.exp(delta) - delta - 1) and bool((k3 >= 0).all()) and float(k3[2]) == 0.0
    # k3 is unbiased: E_π[exp(δ) − δ − 1] = KL(π || π_ref) for a categorical π.
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pi_ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    expected_k3 = float((pi * kl_penalty(pi.log(), pi_ref.log(), "k3")).sum())
    assert expected_k3 == pytest.approx(float((pi * (pi / pi_ref).log()).sum()))
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(log_probs, ref, "k4")
