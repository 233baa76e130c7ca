"""Exact gradient energies for the estimators that need them: ``||S||²`` per response ("eob") and ``||S_t||²`` at
every token ("otb_exact"), from the library's one-pass norms and its exact (torch.func) module."""

from __future__ import annotations

import torch
from torch import nn

from otb_ref import ESTIMATORS, row_grad_norms_sq


def exact_energies(
    estimator: str, lm: nn.Module, sequences, attention, mask, temperature: float
) -> dict[str, torch.Tensor]:
    """Exact ``||S||²`` [B] ("eob") or ``||S_t||²`` [B, T] ("otb_exact") of an unsharded ``lm`` (otb_ref.exact).

    otb_ref.exact uses the model's default positions 0..L-1, so each row is rotated to move its left
    padding to the end: then its real tokens sit at the same positions as in the policy's forward.
    """
    from otb_ref.exact import prefix_grad_norms_sq_fp64, sequence_grad_norms_sq_fp64

    num_prompt = sequences.shape[1] - mask.shape[1]
    left_pad = (~attention[:, :num_prompt]).sum(dim=1, keepdim=True)  # [B, 1]
    length = sequences.shape[1]
    index = (torch.arange(length, device=sequences.device) + left_pad) % length  # rotated[:, i] = row[:, index[:, i]]
    response = torch.cat([torch.zeros_like(attention[:, :num_prompt]), mask], dim=1)
    args = [lm] + [x.gather(1, index).long() for x in (sequences, response, attention)]
    if ESTIMATORS[estimator].granularity == "sequence":
        return {"grad_norms_sq": sequence_grad_norms_sq_fp64(*args, temperature=temperature).float()}
    rotated = prefix_grad_norms_sq_fp64(*args, temperature=temperature)  # [B, L] on the rotated grid
    return {"cumulative_energy": torch.zeros_like(rotated).scatter_(1, index, rotated)[:, num_prompt:].float()}


def sequence_norms(policy: nn.Module, sequences, attention, positions, response_ids, mask) -> torch.Tensor:
    """``||S_i||² = ||∇_θ Σ_t m_it log π(y_it)||²`` [B] for the rows given, in one forward + backward of the
    (possibly sharded) policy: otb_ref.row_grad_norms_sq on the policy's own forward and positions."""

    def log_likelihood():  # [B]
        log_probs, _ = policy(sequences, attention, positions, targets=response_ids, for_grad_norms=True)
        return (log_probs * mask).sum(dim=1)

    return row_grad_norms_sq(policy, log_likelihood)
