"""Sampling responses with a KV cache: temperature, top-p, max new tokens, EOS.

Pure tensor code: the model is a callable, and the only cross-process hook is
an optional ``keep_going`` predicate (the trainer all-reduces "any row still
generating" through it, so every rank runs the same number of forward calls).

Rank-layout invariance: every random number is drawn up front, one uniform
per (row, new token) of the GLOBAL batch, from a generator seeded by
``(seed, step)`` (:func:`sampling_uniforms`). A rank takes its rows, and a
token is sampled by inverse CDF from its uniform. So row ``i`` receives the
same tokens whichever rank holds it and however many rows share a forward
call (up to float rounding in the logits: a different batch split can move a
probability by ~1e-7, which flips a token only when a uniform falls that
close to a CDF boundary).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["Rollout", "sampling_uniforms", "sample_tokens", "position_ids_from_mask", "generate"]

# forward(input_ids [B, k], attention_mask [B, L], position_ids [B, k], cache) -> (next-token logits [B, V], cache)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]]


class Rollout(NamedTuple):
    """Generated responses, right-padded.

    response_ids: ``[B, T]`` int64; ``pad_token_id`` after a row's EOS.
    response_mask: ``[B, T]`` bool; True for generated tokens, EOS included.
    finished: ``[B]`` bool; the row emitted EOS (else it was cut at ``max_new_tokens``).
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    finished: torch.Tensor


def sampling_uniforms(seed: int, step: int, num_rows: int, max_new_tokens: int) -> torch.Tensor:
    """``[num_rows, max_new_tokens]`` float64 uniforms in ``[0, 1)`` for the global batch of ``step``.

    A CPU generator seeded by ``(seed, step)``: the same numbers on every rank,
    for any world size, and independent of the global RNG state.
    """
    generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63))
    return torch.rand((num_rows, max_new_tokens), generator=generator, dtype=torch.float64)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Inverse-CDF sample from ``softmax(logits / τ)`` restricted to the top-p nucleus.

    Args:
        logits: ``[B, V]`` next-token logits (any floating dtype; computed in fp64).
        uniforms: ``[B]`` values in ``[0, 1)``.
        temperature: ``τ > 0``.
        top_p: keep the most probable tokens whose cumulative mass first reaches
            ``top_p`` (at least one token); ``1.0`` keeps the whole vocabulary.

    Returns:
        ``[B]`` int64 token ids: the first token (vocabulary order, or
        descending-probability order with ``top_p < 1``) whose cumulative
        probability exceeds ``u × (kept mass)``.
    """
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)  # [B, V]
    order = None
    if top_p < 1.0:
        probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more probable tokens
        probs = torch.where(mass_before < top_p, probs, 0.0)  # the first token always stays
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)  # [B, 1]
    # Never land on a zero-probability token (u·mass rounding to the total at the end of the CDF).
    index = torch.where(probs.gather(-1, index) > 0, index, (probs > 0).cumsum(-1).argmax(-1, keepdim=True))
    token = index if order is None else order.gather(-1, index)
    return token.squeeze(-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counting only attended tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_(min=0)


@torch.no_grad()
def generate(
    forward: ForwardFn,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    eos_token_ids: list[int] | tuple[int, ...],
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    keep_going: Callable[[bool], bool] | None = None,
) -> Rollout:
    """Sample one response per row of left-padded prompts, with a KV cache.

    Args:
        forward: model call, see ``ForwardFn``: the first call gets the whole
            prompt and ``cache=None``, later calls one new token and the
            returned cache. ``attention_mask`` covers prompt and response so far.
        prompt_ids: ``[B, P]`` int64, left-padded.
        prompt_mask: ``[B, P]`` 0/1 or bool, 0 on the left padding.
        uniforms: ``[B, ≥ max_new_tokens]`` from :func:`sampling_uniforms`.
        eos_token_ids: ids that end a response (kept in the response and mask).
        pad_token_id: written after EOS.
        max_new_tokens: length cap ``T_max``.
        temperature, top_p: see :func:`sample_tokens`.
        keep_going: ``keep_going(any_row_alive) -> bool``; the loop stops when
            it returns False (default: when no row is alive). Distributed
            callers reduce over ranks here so that all ranks stop together.

    Returns:
        :class:`Rollout` with ``T = `` the number of decoding steps run
        (``≤ max_new_tokens``).
    """
    batch_size = prompt_ids.shape[0]
    device = prompt_ids.device
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    attention_mask = prompt_mask.long()
    position_ids = position_ids_from_mask(attention_mask)
    logits, cache = forward(prompt_ids, attention_mask, position_ids, None)
    next_position = position_ids[:, -1:] + 1  # [B, 1]
    alive = torch.ones(batch_size, dtype=torch.bool, device=device)
    tokens, masks = [], []
    for t in range(max_new_tokens):
        token = sample_tokens(logits, uniforms[:, t].to(device), temperature, top_p)
        token = torch.where(alive, token, pad_token_id)
        tokens.append(token)
        masks.append(alive)
        alive = alive & ~torch.isin(token, eos)
        any_alive = bool(alive.any())
        if t + 1 == max_new_tokens or not (keep_going(any_alive) if keep_going else any_alive):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        logits, cache = forward(token[:, None], attention_mask, next_position, cache)
        next_position = next_position + 1
    response_mask = torch.stack(masks, dim=1)  # [B, T]
    return Rollout(torch.stack(tokens, dim=1), response_mask, ~alive)
