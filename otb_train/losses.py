"""Policy-gradient losses: clipped importance ratio, loss aggregation, KL to a reference.

Pure tensor code. Distributed and gradient-accumulated training needs the
loss of the WHOLE global batch, ``L = Σ_{ranks, micro-batches} ℓ``; so each
function takes the global normaliser (token or sequence count, summed over
ranks and micro-batches by the caller) instead of averaging locally. Then the
sum of the per-micro-batch gradients over micro-batches and ranks is exactly
the gradient of the global loss, however the batch is split.

Aggregation modes (``m`` the response mask, ``ℓ_{i,t}`` per-token losses):

    token-mean            Σ_{i,t} m ℓ / N_tokens
    seq-mean-token-sum    Σ_i (Σ_t m ℓ) / N_seqs
    seq-mean-token-mean   Σ_i (Σ_t m ℓ / Σ_t m) / N_seqs
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "aggregate", "clipped_policy_loss", "kl_penalty"]

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, *, global_tokens: float, global_sequences: float
) -> torch.Tensor:
    """This micro-batch's share of a globally normalised loss (see the module docstring).

    Args:
        values: ``[B, T]`` per-token losses (any value where ``mask`` is 0).
        mask: ``[B, T]`` 0/1 or bool response mask.
        mode: one of ``AGGREGATIONS``.
        global_tokens: ``Σ m`` over the global batch (all ranks, all micro-batches).
        global_sequences: number of responses in the global batch.

    Returns:
        0-dim tensor in ``values.dtype``.
    """
    valid = mask.bool()
    masked = torch.where(valid, values, 0.0)
    if mode == "token-mean":
        return masked.sum() / max(float(global_tokens), 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(float(global_sequences), 1.0)
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
        return per_sequence.sum() / max(float(global_sequences), 1.0)
    raise ValueError(f"mode: unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token-mean",
    global_tokens: float,
    global_sequences: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with asymmetric clipping (``clip_high`` > ``clip_low`` is DAPO's clip-higher).

    ``r = exp(log π − log π_old)``,
    ``ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1 − clip_low, 1 + clip_high))``, aggregated by ``aggregation``.

    Args:
        log_probs: ``[B, T]`` log π_θ(y_t), differentiable.
        old_log_probs: ``[B, T]`` log π_old(y_t) (no gradient).
        advantages: ``[B, T]``.
        mask: ``[B, T]`` response mask.
        clip_low, clip_high: ``ε_low, ε_high ≥ 0``.
        aggregation, global_tokens, global_sequences: see :func:`aggregate`.

    Returns:
        ``(loss, stats)``: the 0-dim loss share, and token SUMS over this
        micro-batch (for the caller to all-reduce and divide by the global
        token count): ``clipped_tokens`` (tokens whose clipped term was
        chosen) and ``approx_kl_sum`` (``Σ ½ (log r)²``).
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, log_probs - old_log_probs.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, valid, aggregation, global_tokens=global_tokens, global_sequences=global_sequences)
    with torch.no_grad():
        stats = {
            "clipped_tokens": ((clipped > unclipped) & valid).sum().to(torch.float64),
            "approx_kl_sum": (0.5 * log_ratio.square() * valid).sum().to(torch.float64),
        }
    return loss, stats


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ || π_ref)`` from sampled tokens, ``[B, T]``.

    With ``δ = log π_ref − log π_θ``: ``k1 = −δ`` (unbiased, high variance),
    ``k2 = ½ δ²``, ``k3 = exp(δ) − δ − 1`` (unbiased, ≥ 0; Schulman's
    low-variance estimator). Differentiable w.r.t. ``log_probs``.
    """
    delta = ref_log_probs.detach() - log_probs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.expm1(delta.clamp(max=20.0)) - delta
    raise ValueError(f"estimator: unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
