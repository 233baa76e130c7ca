"""Sampling responses with a KV cache: temperature, top-p, max new tokens, EOS.

Pure tensor code: the model is a callable, and the only cross-process hook is
an optional ``keep_going`` predicate (the trainer all-reduces "any row still
generating" through it, so every rank runs the same number of forward calls).

Rank-layout invariance: every random number is drawn up front, one uniform
per (row, new token) of the GLOBAL batch, from a generator seeded by
``(seed, step)`` (:func:`sampling_uniforms`). A rank takes its rows, and a
token is sampled by inverse CDF from its uniform. A row's token is a function
of that row's logits and uniform alone (every operation of
:func:`sample_tokens` is row-wise), so row ``i`` receives the same tokens
whichever rank holds it and however many rows share a forward call (up to
float rounding in the logits: a different batch split can move a probability
by ~1e-7, which flips a token only when a uniform falls that close to a CDF
boundary).

No host synchronisation per token: the uniforms move to the device once, and
"is any row still generating" is read (and ``keep_going`` called) only every
``check_every`` tokens; the result is trimmed to exactly what a check after
every token gives (:func:`generate`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "Rollout",
    "sampling_uniforms",
    "sample_tokens",
    "draw_disagreement_probability",
    "position_ids_from_mask",
    "generate",
]

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


def sample_tokens(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Inverse-CDF sample from ``softmax(logits / τ)`` restricted to the top-p nucleus.

    Args:
        logits: ``[B, V]`` next-token logits (any floating dtype).
        uniforms: ``[B]`` values in ``[0, 1)``.
        temperature: ``τ > 0``.
        top_p: keep the most probable tokens whose cumulative mass first reaches
            ``top_p`` (at least one token); ``1.0`` keeps the whole vocabulary.
        dtype: the precision of the whole computation: probabilities, nucleus,
            CDF and ``u × mass``. ``float64`` (default) samples the model's
            distribution to rounding; ``float32`` is cheaper, but over a
            151,936-token vocabulary it picked a different token than float64 in
            1.2% of draws (0.2% with top-p 0.9; benchmarks/gpu_train_paths.py,
            H100), i.e. it samples a slightly different distribution.

    Returns:
        ``[B]`` int64 token ids.

    The rule, exactly, with every quantity (``top_p`` and ``u`` too) rounded to ``dtype``:
    ``p = softmax(logits / τ)``;
    with ``top_p < 1`` the tokens are put in descending-``p`` order (equal
    probabilities keep vocabulary order) and token ``i`` is kept iff the mass
    of the tokens before it, ``c_{i-1}`` (the running sum), is ``< top_p``;
    the kept ``p`` are summed into the CDF ``c`` (``c_V`` = kept mass ``M``),
    ``x = u × M``, and the token is the first ``i`` with ``c_i > x``: token
    ``i`` owns ``[c_{i-1}, c_i)``, so a tie ``x == c_i`` goes to the next
    token with positive probability. ``x ≥ M`` (``u`` rounded up) gives the
    first token where the CDF reaches ``M``, which never has probability 0.

    Float32 vs float64: both follow this rule on their own rounded CDFs. They
    pick different tokens only when ``x`` falls between the float32 and the
    float64 value of a boundary ``c_i``, or when a nucleus boundary ``c_{i-1}``
    lies between them and ``top_p``. The chance per draw is
    ``Σ_i |c32_i − c64_i| / M``: each ``|c32_i − c64_i|`` is at most about
    ``(i + 2) × 2⁻²⁴ × M``, and is far smaller in practice.
    """
    probs = torch.softmax(logits.to(dtype) / temperature, dim=-1)  # [B, V]
    order = None
    if top_p < 1.0:
        probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive running sum: c_{i-1}
        probs = torch.where(mass_before < top_p, probs, 0.0)  # the first token always stays
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1] kept mass M
    target = uniforms.to(device=cdf.device, dtype=dtype).unsqueeze(-1) * total  # [B, 1]
    index = torch.searchsorted(cdf, target, right=True)  # first c_i > x (V when x >= M)
    top = torch.searchsorted(cdf, total, right=False)  # first c_i >= M: the last token with a non-empty interval
    index = torch.minimum(index, top)
    token = index if order is None else order.gather(-1, index)
    return token.squeeze(-1)


def draw_disagreement_probability(
    logits_a: torch.Tensor, logits_b: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[B]``: per row, the probability over ``u ~ U[0, 1)`` that :func:`sample_tokens` (float64, ``top_p = 1``)
    draws different tokens from ``logits_a`` and from ``logits_b`` with the same uniform ``u``.

    Token ``i`` owns ``u ∈ [c_{i-1}, c_i) / M`` under each distribution's CDF ``c`` (mass ``M``), so the draw is the
    number of normalised CDF values ``≤ u``; the two draws differ on the intervals between the merged breakpoints of
    both CDFs where those counts differ, and the probability is those intervals' total length. Exact up to the
    float64 rounding of the CDFs (``c_i / M`` here against ``u × M`` in the sampler: ~1e-16 per boundary). It is
    at most ``Σ_i |c_i − c'_i| / M`` (the coupling bound), often far less.
    """
    cdfs = [torch.softmax(x.double() / temperature, dim=-1).cumsum(dim=-1) for x in (logits_a, logits_b)]
    a, b = (c / c[:, -1:] for c in cdfs)  # [B, V] each, ending at 1
    points = torch.cat([torch.zeros_like(a[:, :1]), a, b], dim=-1).clamp(0.0, 1.0).sort(dim=-1).values  # [B, 2V+1]
    middle = (points[:, 1:] + points[:, :-1]) / 2  # one u inside each interval between breakpoints
    differ = torch.searchsorted(a, middle, right=True) != torch.searchsorted(b, middle, right=True)
    return ((points[:, 1:] - points[:, :-1]) * differ).sum(dim=-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counting only attended tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_(min=0)


def _per_token_stop(alive_after: torch.Tensor, start: int, end: int, keep: Callable[[bool], bool]) -> int | None:
    """Replay the per-token checks that were skipped for columns ``start .. end - 1``.

    ``alive_after[:, s]``: rows still generating after column ``s``. Calls
    ``keep(any row alive after s)`` in column order, as a check after every
    token would have, and returns ``s + 1`` at the first False (else None).
    One host read for the whole window.
    """
    if end <= start:
        return None
    for offset, any_alive in enumerate(alive_after[:, start:end].any(dim=0).tolist()):
        if not keep(any_alive):
            return start + offset + 1
    return None


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
    check_every: int = 16,
    sample_dtype: torch.dtype = torch.float64,
    drop_finished: bool = False,
) -> Rollout:
    """Sample one response per row of left-padded prompts, with a KV cache.

    Args:
        forward: model call, see ``ForwardFn``: the first call gets the whole
            prompt and ``cache=None``, later calls one new token and the
            returned cache. ``attention_mask`` covers prompt and response so far
            (a view of one preallocated mask; every response position is 1).
        prompt_ids: ``[B, P]`` int64, left-padded.
        prompt_mask: ``[B, P]`` 0/1 or bool, 0 on the left padding.
        uniforms: ``[B, ≥ max_new_tokens]`` from :func:`sampling_uniforms`.
        eos_token_ids: ids that end a response (kept in the response and mask).
        pad_token_id: written after EOS.
        max_new_tokens: length cap ``T_max``.
        temperature, top_p: see :func:`sample_tokens`.
        keep_going: ``keep_going(any_row_alive) -> bool``; the loop stops when
            it returns False (default: when no row is alive). Distributed
            callers reduce over ranks here so that all ranks stop together. It
            must be monotone (once False, False for every later column), as
            any "is a row alive" predicate is.
        check_every: read "any row alive" (one host sync) and call
            ``keep_going`` only after every ``check_every``-th token. Finished
            rows keep emitting masked pad meanwhile. When the loop stops, the
            skipped checks of the last window are replayed in order (the same
            ``keep_going`` calls on every rank), and the result is trimmed to
            the first False: the returned tensors equal those of
            ``check_every=1`` exactly, at the cost of up to
            ``check_every - 1`` extra forward calls.
        sample_dtype: precision of :func:`sample_tokens` (default ``float64``; see there).
        drop_finished: at a check where at most half of the rows being decoded are alive, decode only the alive
            ones from then on (``forward.select_rows(rows)`` keeps its cache's rows; a ``forward`` without
            ``select_rows``, e.g. the model's own, is never narrowed). Each row's tokens are still a function of
            its own logits and uniforms; only the batch its logits are computed in gets smaller, so kernels may
            round differently (as between ranks). Off by default.

    Returns:
        :class:`Rollout` with ``T = `` the number of decoding steps a check
        after every token would have run (``≤ max_new_tokens``).
    """
    if check_every < 1:
        raise ValueError(f"check_every: expected >= 1, got {check_every}")
    batch_size, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    keep = keep_going if keep_going is not None else bool
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    uniforms = uniforms[:, :max_new_tokens].to(device)  # one copy, not one per token
    attention_mask = torch.ones(batch_size, prompt_len + max_new_tokens, dtype=torch.long, device=device)
    attention_mask[:, :prompt_len] = prompt_mask.long()
    position_ids = position_ids_from_mask(attention_mask[:, :prompt_len])
    logits, cache = forward(prompt_ids, attention_mask[:, :prompt_len], position_ids, None)
    next_position = position_ids[:, -1:] + 1  # [B, 1]
    tokens = torch.full((batch_size, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    masks = torch.zeros(batch_size, max_new_tokens, dtype=torch.bool, device=device)
    alive_after = torch.zeros(batch_size, max_new_tokens, dtype=torch.bool, device=device)
    alive = torch.ones(batch_size, dtype=torch.bool, device=device)
    rows: slice | torch.Tensor = slice(None)  # the batch rows being decoded (all, until drop_finished narrows)
    narrow = drop_finished and hasattr(forward, "select_rows")
    checked, stop = 0, None  # columns before `checked` passed their check; `stop`: a check said stop after it
    for t in range(max_new_tokens):
        token = sample_tokens(logits, uniforms[:, t], temperature, top_p, sample_dtype)
        token = torch.where(alive, token, pad_token_id)
        tokens[rows, t], masks[rows, t] = token, alive
        alive = alive & ~torch.isin(token, eos)
        alive_after[rows, t] = alive
        if t + 1 == max_new_tokens:
            break
        if (t + 1) % check_every == 0:
            alive_rows = int(alive.sum())  # the check's one host read
            if not keep(alive_rows > 0):
                stop = t
                break
            checked = t + 1
            if narrow and alive_rows <= alive.shape[0] // 2 and alive.shape[0] > 1:  # the alive rows only from here
                # none alive here while keep_going goes on (another rank's rows): one row, pad from now on, stays
                keep_rows = alive.nonzero().squeeze(1) if alive_rows else alive.new_zeros(1, dtype=torch.long)
                forward.select_rows(keep_rows)
                rows = keep_rows if isinstance(rows, slice) else rows[keep_rows]
                token, alive, next_position = token[keep_rows], alive[keep_rows], next_position[keep_rows]
                uniforms, attention_mask = uniforms[keep_rows], attention_mask[keep_rows]
        logits, cache = forward(token[:, None], attention_mask[:, : prompt_len + t + 1], next_position, cache)
        next_position = next_position + 1
    last = stop if stop is not None else max_new_tokens - 1  # the last column never checked itself
    length = _per_token_stop(alive_after, checked, last, keep) or last + 1
    return Rollout(tokens[:, :length], masks[:, :length], ~alive_after[:, length - 1])
