"""The mini-batch policy gradient's sampler and statistics, shared by gradient_variance, snr_gap and
variance_lr_pilot.

* :class:`Sample`, :func:`sample_batch`: P prompts x N responses from a policy (train.py's sampler and reward), with
  log π and Σπ² at the sampling policy.
* From R batch gradients: :func:`gram_matrices`, :func:`pair_means` (the U-statistics over pairs of different
  batches, bootstrap-weighted), :func:`statistics` (SNR, cosine, scale, bias, SNR∥, MSE against a reference),
  :func:`crossing` (the N at which an SNR curve reaches a target) and :func:`snr_statistics` (SNR with bootstrap
  draws, no reference).

The design of the measurements: the docstring of ``experiments/gradient_variance.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from otb_train.model import Policy
from otb_train.rollout import position_ids_from_mask
from otb_train.warm_start import sample_synthetic


@dataclass
class Sample:
    """P prompts x N_max responses, prompt-major rows; no padding inside a row before its last response token."""

    sequences: torch.Tensor  # [B, L + T] prompt (all prompts have the same length) then response
    mask: torch.Tensor  # [B, T] bool
    rewards: torch.Tensor  # [B, T] outcome reward on the last response token
    old_log_probs: torch.Tensor  # [B, T]
    sum_pi_squared: torch.Tensor  # [B, T]
    num_prompt: int
    group_size: int  # N_max


def sample_batch(lm, problems, group_size: int, replicate: int, max_new_tokens: int, seed: int, task: str) -> Sample:
    """``group_size`` responses to each problem (temperature 1, train.py's sampler and reward), with log π and Σπ²."""
    if len({len(problem.prompt) for problem in problems}) != 1:
        raise ValueError("prompts of different lengths: the per-row Jacobian assumes no left padding")
    drawn = sample_synthetic(lm, problems, group_size, task, seed, replicate, max_new_tokens)
    out, prompt_ids = drawn.rollout, drawn.prompt_ids
    lengths = out.response_mask.sum(dim=1)
    scores = torch.tensor(drawn.scores)[:, None]
    rewards = torch.zeros(out.response_mask.shape).scatter_(1, (lengths - 1)[:, None], scores)
    sequences = torch.cat([prompt_ids, out.response_ids], dim=1)
    attention = torch.cat([drawn.prompt_mask.bool(), out.response_mask], dim=1)
    with torch.no_grad():
        policy = Policy(lm, 1.0, None)
        log_probs, sum_pi_squared = policy(
            sequences, attention, position_ids_from_mask(attention), targets=out.response_ids
        )
    return Sample(sequences, out.response_mask, rewards, log_probs, sum_pi_squared, prompt_ids.shape[1], group_size)


def gram_matrices(grads: torch.Tensor, reference: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``own[e, n] = G G^T`` and ``cross[e, n] = G G_ref^T`` ([E, N, R, R] float64) of grads [R, E, N, P]."""
    ref = grads[:, reference[0], reference[1]].double()
    own = torch.zeros(*grads.shape[1:3], len(grads), len(grads), dtype=torch.float64)
    cross = torch.zeros_like(own)
    for e in range(grads.shape[1]):
        for n in range(grads.shape[2]):
            g = grads[:, e, n].double()
            own[e, n], cross[e, n] = g @ g.T, g @ ref.T
    return own, cross


def pair_means(matrices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For batch multiplicities ``weights`` [S, R] (ones: the sample itself; a bootstrap: resampled counts):
    the mean of ``M[r, s]`` over pairs of different batches, and the mean of ``M[r, r]``; each [S, *M.shape[:-2]].
    """
    r = matrices.shape[-1]
    diag = matrices.diagonal(dim1=-2, dim2=-1)  # [..., R]
    quad = torch.einsum("sr,...rq,sq->s...", weights, matrices, weights)
    own = torch.einsum("sr,...r->s...", weights.square(), diag)
    pairs = (r * r - weights.square().sum(dim=1)).clamp(min=1).view(-1, *[1] * (matrices.dim() - 2))
    return (quad - own) / pairs, torch.einsum("sr,...r->s...", weights, diag) / r


def statistics(own: torch.Tensor, cross: torch.Tensor, reference: tuple[int, int], weights) -> dict:
    """SNR, cosine, scale, relative bias, directional SNR∥ and MSE against ∇J = E g_ref for every (estimator, N),
    one row per weight vector: [S, E, N]. ``SNR∥ = ρ² / (1 − ρ²)``, ``ρ² = ⟨E g, ∇J⟩² / (‖∇J‖² E‖g‖²)``: scale-free,
    equal to SNR when E g is a positive multiple of ∇J, lower by direction error; ``MSE = E‖g − ∇J‖²`` =
    ``E‖g‖² − 2⟨E g, ∇J⟩ + ‖∇J‖²`` (unbiased: each term is a mean over batches or pairs of different batches).
    ``ref_noise`` is tr Cov(g_ref) / R over ‖∇J‖², the relative noise of ∇J's estimate by the mean of R batches."""
    signal, power = pair_means(own, weights)  # ||E g||² (unbiased), E ||g||²
    inner, _ = pair_means(cross, weights)  # <E g, g_ref>
    ref_signal = signal[:, reference[0], reference[1]][:, None, None]
    noise = power - signal  # tr Cov g
    both = signal * ref_signal
    cosine = torch.where(both > 0, inner / both.clamp(min=1e-300).sqrt(), math.nan).clamp(-1, 1)
    bias_sq = (signal - 2 * inner + ref_signal) / ref_signal
    rho_sq = torch.where(inner > 0, inner.square() / (ref_signal * power).clamp(min=1e-300), 0.0)
    mse = power - 2 * inner + ref_signal
    replicates = own.shape[-1]
    return {
        "rho_sq": rho_sq,
        "snr_par": torch.where(rho_sq < 1, rho_sq / (1 - rho_sq).clamp(min=1e-300), math.inf),
        "mse": mse,
        "mse_rel": mse / ref_signal,
        "ref_noise": noise[:, reference[0], reference[1]] / replicates / ref_signal[:, 0, 0],
        "snr": signal / noise,
        "signal": signal,
        "noise": noise,
        "cosine": cosine,
        "scale": inner / ref_signal,
        "bias": bias_sq.clamp(min=0).sqrt() + 0.0,  # + 0.0: no "-0"
        "bias_sq": bias_sq,
    }


def crossing(snr: torch.Tensor, target: torch.Tensor, group_sizes) -> torch.Tensor:
    """The N at which an SNR curve [S, N] first reaches ``target`` [S] (linear in log2 N between grid points);
    the smallest N when it is already there, ``inf`` when it never is."""
    logs = torch.tensor([math.log2(n) for n in group_sizes], dtype=snr.dtype)
    out = torch.full(target.shape, math.inf, dtype=snr.dtype)
    for s in range(len(target)):
        above = (snr[s] >= target[s]).nonzero()
        if len(above) == 0:
            continue
        k = int(above[0])
        if k == 0:
            out[s] = group_sizes[0]
            continue
        low, high = snr[s, k - 1], snr[s, k]
        fraction = float((target[s] - low) / (high - low))
        out[s] = 2 ** float(logs[k - 1] + fraction * (logs[k] - logs[k - 1]))
    return out


def snr_statistics(grads: torch.Tensor, bootstrap: int = 2000, seed: int = 0) -> dict:
    """From grads [R, E, N, P]: SNR, ‖E g‖² and tr Cov g per (estimator, N), and bootstrap draws of the SNR."""
    r = len(grads)
    own = torch.zeros(*grads.shape[1:3], r, r, dtype=torch.float64)
    for e in range(grads.shape[1]):
        for n in range(grads.shape[2]):
            g = grads[:, e, n].double()
            own[e, n] = g @ g.T
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(r, (bootstrap, r), generator=generator)
    weights = torch.zeros(bootstrap, r, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(bootstrap, r, dtype=torch.float64)
    )
    signal, power = pair_means(own, torch.ones(1, r, dtype=torch.float64))
    boot_signal, boot_power = pair_means(own, weights)
    return {
        "snr": (signal / (power - signal))[0],
        "signal": signal[0],
        "noise": (power - signal)[0],
        "boot_snr": boot_signal / (boot_power - boot_signal),
    }
