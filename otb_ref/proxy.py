"""The Logit-Gradient Proxy (THEORY.md F6): token energies from forward passes.

For logits ``z`` and ``π = softmax(z / τ)`` the gradient of ``log π_y`` with
respect to the logits is ``(e_y − π) / τ`` and

    ||e_y − π||² = 1 − 2 π_y + Σ_v π_v²                               (F6)

so a token's energy needs only its log-probability and ``Σ_v π_v²``. The
constant ``1/τ²`` is dropped: it cancels in every baseline ratio.

``Σ_v π_v²`` is evaluated as ``Σ_v e_v² / (Σ_v e_v)²`` with
``e_v = exp(z_v − max z) ∈ [0, 1]``: no overflow at any logit scale, at least
one term equals one, ``-inf`` logits (a masked vocabulary) contribute zero.
This equals ``exp(logsumexp(2z) − 2 logsumexp(z))``.
"""

from __future__ import annotations

import torch

from otb_ref._checks import compute_dtype, positive_scalar, require_device, require_tensor

__all__ = ["sum_pi_squared", "token_energy", "logprobs_and_sum_pi_squared"]

# Logits elements per chunk when ``chunk_size`` is not given. On CPU a small
# chunk keeps the working set (one fp32 [chunk, V] buffer) in cache and the
# peak memory a few percent of the naive path; on GPUs a larger chunk keeps
# the matmul efficient.
_CHUNK_ELEMENTS = {"cpu": 1 << 22}
_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26


def _energy_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logsumexp_and_sum_pi_squared_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp(z), Σ softmax(z)²)`` over the last dim; overwrites ``z``.

    z: [..., V] floating. Rows with no finite maximum give NaN.
    """
    z_max = z.amax(dim=-1, keepdim=True)  # [..., 1]
    e = z.sub_(z_max).exp_()  # [..., V], values in [0, 1]
    s1 = e.sum(dim=-1)  # [...] >= 1
    s2 = e.square_().sum(dim=-1)  # [...] in [1, s1]
    logsumexp = z_max.squeeze(-1) + torch.log(s1)
    sum_sq = (s2 / s1.square()).clamp_(max=1.0)
    return logsumexp, sum_sq


def _raise_if_nan(name: str, result: torch.Tensor) -> None:
    if bool(torch.isnan(result).any()):
        raise ValueError(
            f"{name}: a row has NaN or +inf logits, or no finite logit at all "
            "(every entry -inf; or fp16 logits beyond ±65504); Σπ² is undefined there"
        )


def sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``Σ_v π_v²`` with ``π = softmax(logits / temperature)`` (F6).

    Args:
        logits: ``[..., V]``, bf16/fp16/fp32/fp64. ``-inf`` entries (masked
            vocabulary) are allowed; NaN, ``+inf`` and all-``-inf`` rows raise.
        temperature: ``τ > 0``.

    Returns:
        ``[...]`` (``logits.shape[:-1]``) in fp32, or fp64 for fp64 input;
        values in ``[1/V, 1]``. Exact for any logit scale. ``logits`` is not
        modified. Not differentiable (an energy, not a loss term).
    """
    require_tensor("logits", logits)
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating dtype, got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits: needs a non-empty last (vocabulary) dim, got {tuple(logits.shape)}")
    tau = positive_scalar("temperature", temperature)
    with torch.no_grad():
        z = logits.to(_energy_dtype(logits.dtype), copy=True)
        if tau != 1.0:
            z.div_(tau)
        _, result = _logsumexp_and_sum_pi_squared_(z)
    _raise_if_nan("logits", result)
    return result


def token_energy(log_probs: torch.Tensor, sum_pi_squared: torch.Tensor) -> torch.Tensor:
    """Per-token logit-gradient energy ``w = 1 − 2 π(y) + Σ_v π_v²`` (F6).

    Args:
        log_probs: ``[...]`` log-probability of each sampled token.
        sum_pi_squared: ``[...]`` same shape, from :func:`sum_pi_squared`.

    Returns:
        ``[...]`` in fp32 (fp64 if either input is fp64), clamped into
        ``[0, 2]`` (the exact value lies there; the clamp removes rounding).
    """
    require_tensor("log_probs", log_probs)
    require_tensor("sum_pi_squared", sum_pi_squared)
    if log_probs.shape != sum_pi_squared.shape:
        raise ValueError(
            f"sum_pi_squared: shape {tuple(sum_pi_squared.shape)} does not match "
            f"log_probs {tuple(log_probs.shape)}"
        )
    dtype = compute_dtype(log_probs, sum_pi_squared)
    pi_y = torch.exp(log_probs.detach().to(dtype))
    return torch.add(sum_pi_squared.detach().to(dtype), pi_y, alpha=-2.0).add_(1.0).clamp_(0.0, 2.0)


def _default_chunk_size(num_rows: int, vocab: int, device: torch.device) -> int:
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_ACCELERATOR)
    return max(1, min(num_rows, budget // max(vocab, 1)))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, inv_tau: float, dtype: torch.dtype) -> torch.Tensor:
    """``(hidden @ weightᵀ) / τ`` as a fresh ``[c, V]`` tensor of ``dtype``."""
    logits = hidden @ weight.T  # [c, V] in the input dtype
    logits = logits.to(dtype)  # no copy when already dtype: the matmul output is fresh
    if inv_tau != 1.0:
        logits.mul_(inv_tau)
    return logits


class _ChunkedLogProbs(torch.autograd.Function):
    """Chunked ``log π(y)`` and ``Σπ²``; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_tau, chunk_size):  # noqa: D401
        dtype = _energy_dtype(hidden.dtype)
        num_rows = hidden.shape[0]
        log_probs = torch.empty(num_rows, dtype=dtype, device=hidden.device)
        logsumexp = torch.empty_like(log_probs)
        sum_sq = torch.empty_like(log_probs)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            z = _chunk_logits(hidden[rows], weight, inv_tau, dtype)  # [c, V]
            target_logit = z.gather(1, targets[rows, None]).squeeze(1)  # [c]
            logsumexp[rows], sum_sq[rows] = _logsumexp_and_sum_pi_squared_(z)
            log_probs[rows] = target_logit - logsumexp[rows]
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.inv_tau = inv_tau
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(sum_sq)
        return log_probs, sum_sq

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, _grad_sum_sq):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = logsumexp.dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulate the weight gradient at least in fp32 across chunks.
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]  # [c, d]
            g = grad_log_probs[rows].to(dtype)  # [c]
            z = _chunk_logits(h, weight, ctx.inv_tau, dtype)  # [c, V]
            pi = z.sub_(logsumexp[rows, None]).exp_()  # [c, V] softmax
            # d log π_y / d z = (e_y − π) / τ, times the upstream gradient g.
            grad_z = pi.mul_(-g[:, None])
            grad_z.scatter_add_(1, targets[rows, None], g[:, None])
            grad_z = grad_z.mul_(ctx.inv_tau).to(hidden.dtype)  # [c, V]
            if need_hidden:
                grad_hidden[rows] = grad_z @ weight
            if need_weight:
                grad_weight += (grad_z.T @ h).to(dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def logprobs_and_sum_pi_squared(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` and ``Σπ²`` from an LM head, chunk by chunk.

    With logits ``z = hidden @ weightᵀ / τ`` (never materialised whole):
    ``log_probs = z_y − logsumexp(z)`` and ``sum_pi_squared = Σ_v softmax(z)_v²``
    (F6). Rows are processed ``chunk_size`` at a time, so at most one
    ``[chunk_size, V]`` logits buffer exists. Backward recomputes each chunk's
    logits from ``hidden`` and ``weight`` instead of storing them.

    Args:
        hidden: ``[..., d]`` final hidden states (bf16/fp16/fp32/fp64).
        weight: ``[V, d]`` LM-head weight, same dtype and device as ``hidden``.
        targets: ``[...]`` integer token ids in ``[0, V)``.
        temperature: ``τ > 0``, the sampling temperature.
        chunk_size: rows per chunk; default keeps one chunk's logits at about
            4M elements on CPU (64M on accelerators).

    Returns:
        ``(log_probs, sum_pi_squared)``, both shaped like ``targets``, fp32
        (fp64 for fp64 input). ``log_probs`` is differentiable with respect to
        ``hidden`` and ``weight``; ``sum_pi_squared`` is not.
    """
    require_tensor("hidden", hidden)
    require_tensor("weight", weight)
    require_tensor("targets", targets)
    if not hidden.is_floating_point():
        raise ValueError(f"hidden: expected a floating dtype, got {hidden.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [V, d], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden: last dim of shape {tuple(hidden.shape)} does not match weight's d = {weight.shape[1]}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    require_device("weight", weight, hidden.device, "hidden")
    require_device("targets", targets, hidden.device, "hidden")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"targets: expected integer token ids, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} does not match hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    vocab = weight.shape[0]
    if targets.numel() and (bool((targets < 0).any()) or bool((targets >= vocab).any())):
        raise ValueError(f"targets: token ids must lie in [0, {vocab}) (the rows of weight)")
    inv_tau = 1.0 / positive_scalar("temperature", temperature)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, d]
    flat_targets = targets.reshape(-1).long()  # [N]
    if chunk_size is None:
        chunk_size = _default_chunk_size(flat_hidden.shape[0], vocab, hidden.device)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    log_probs, sum_sq = _ChunkedLogProbs.apply(flat_hidden, weight, flat_targets, inv_tau, chunk_size)
    _raise_if_nan("hidden, weight", sum_sq)
    return log_probs.reshape(targets.shape), sum_sq.reshape(targets.shape)
