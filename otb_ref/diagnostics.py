"""Forward-only variance diagnostics (THEORY.md §5).

With a scalar advantage per response ``a_i`` (masked mean over its tokens) and
its proxy sequence weight ``v_i = Σ_t m_t w_t`` (``w_t`` the logit-gradient proxy, F6),
the per-response squared gradient norm is approximated by ``v_i a_i²``:

    total power   P = mean_i(v_i a_i²)          ≈ E||ĝ_i||²
    signal        S = ||ḡ||²                    (from the measured gradient norm)
    noise         (P − S) / (N − 1)             ≈ variance of the batch-mean gradient

These are the quantities the authors log; keys and conventions follow their
implementation so that dashboards compare directly.
"""

from __future__ import annotations

import torch

from otb_ref import _checks
from otb_ref.proxy import token_energy

__all__ = ["variance_proxy_metrics"]


def _masked_row_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over each row's valid entries; 0 for an empty row. ``[B, T] -> [B]``."""
    total = torch.where(valid, values, 0.0).sum(dim=-1)
    count = valid.sum(dim=-1)
    return total / count.clamp(min=1)


def variance_proxy_metrics(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    grad_norm: float | None = None,
) -> dict[str, float]:
    """Signal, total power and noise of the policy gradient from forward quantities (§5).

    Args:
        advantages: ``[B, T]`` advantages used in the loss.
        response_mask: ``[B, T]`` 0/1 mask of generated tokens.
        old_log_probs: ``[B, T]`` log π(y_t).
        sum_pi_squared: ``[B, T]`` Σ_v π_v².
        rollout_is_weights: optional ``[B, T]`` truncated IS weights ``ρ̄_t``.
            Then ``P = mean_i(ρ̄_i² a_i² v_i)`` with ``ρ̄_i`` the row's mean
            weight and ``v_i`` the unweighted energy, and ``expected_w`` uses
            ``ρ̄_t²``-weighted energies (the authors' convention). verl recovers
            ``v_i`` as ``Σ_t (w_t ρ̄_t²) / max(ρ̄_t², 1e-10)``, which under-counts
            ``w_t`` where ``ρ̄_t < 1e-5``; here ``v_i`` is exact.
        grad_norm: measured norm of the batch-mean gradient ``||ḡ||``.

    Returns:
        ``{"variance_proxy/proxy1_signal_strength": S,
        "variance_proxy/proxy2_total_power": P,
        "variance_proxy/proxy3_pure_noise": max(0, (P − S)/(B − 1)),
        "variance_proxy/expected_a_squared": mean_i a_i²,
        "variance_proxy/expected_w": mean_i v_i}``; signal and noise are 0
        when ``grad_norm`` is not given, noise is 0 for ``B = 1``; an empty batch (``B = 0``) gives 0 for
        every mean.
    """
    _checks.require_tensor("advantages", advantages)
    if advantages.dim() != 2:
        raise ValueError(f"advantages: expected shape [B, T], got {tuple(advantages.shape)}")
    shape = tuple(advantages.shape)
    named = {"response_mask": response_mask, "old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared}
    if rollout_is_weights is not None:
        named["rollout_is_weights"] = rollout_is_weights
    for name, value in named.items():
        _checks.require_tensor(name, value)
        _checks.require_shape(name, value, shape, "advantages")
        _checks.require_device(name, value, advantages.device, "advantages")
    valid = _checks.binary_mask("response_mask", response_mask)
    for name, value in {"advantages": advantages, **named}.items():
        if name != "response_mask":
            _checks.require_finite(name, value, where=valid)
    if rollout_is_weights is not None:
        _checks.require_in_range(
            "rollout_is_weights", rollout_is_weights, 0.0, float("inf"), where=valid, rule="must be >= 0"
        )
    if grad_norm is not None:
        grad_norm = _checks.nonnegative_scalar("grad_norm", grad_norm)

    dtype = _checks.compute_dtype(advantages, old_log_probs, sum_pi_squared, rollout_is_weights)
    with torch.no_grad():
        w = torch.where(valid, token_energy(old_log_probs.to(dtype), sum_pi_squared.to(dtype)), 0.0)  # [B, T]
        a = _masked_row_mean(advantages.to(dtype), valid)  # [B]
        energy = w.sum(dim=-1)  # [B]
        if rollout_is_weights is None:
            total_power = (energy * a.square()).mean()
            expected_w = energy.mean()
        else:
            rho = rollout_is_weights.to(dtype)
            rho_row = _masked_row_mean(rho, valid)  # [B]
            total_power = (rho_row.square() * a.square() * energy).mean()
            expected_w = torch.where(valid, w * rho.square(), 0.0).sum(dim=-1).mean()
        batch_size = shape[0]
        signal = grad_norm**2 if grad_norm is not None else 0.0
        noise = 0.0
        if grad_norm is not None and batch_size > 1:
            noise = max(0.0, (float(total_power) - signal) / (batch_size - 1))
        return {
            "variance_proxy/proxy1_signal_strength": float(signal),
            "variance_proxy/proxy2_total_power": float(total_power) if batch_size else 0.0,
            "variance_proxy/proxy3_pure_noise": float(noise),
            "variance_proxy/expected_a_squared": float(a.square().mean()) if batch_size else 0.0,
            "variance_proxy/expected_w": float(expected_w) if batch_size else 0.0,
        }
