"""The Logit-Gradient Proxy (THEORY.md F6): token energies from forward passes.

For logits ``z`` and ``π = softmax(z / τ)`` the gradient of ``log π_y`` with
respect to the logits is ``(e_y − π) / τ`` and

    ||e_y − π||² = 1 − 2 π_y + Σ_v π_v²                               (F6)

so a token's energy needs only its log-probability and ``Σ_v π_v²``. The
constant ``1/τ²`` is dropped: it cancels in every baseline ratio (up to ``ε``,
which it rescales).

``Σ_v π_v²`` is evaluated as ``Σ_v e_v² / (Σ_v e_v)²`` with
``e_v = exp(z_v − max z) ∈ [0, 1]``: no overflow at any logit scale, at least
one term equals one, ``-inf`` logits (a masked vocabulary) contribute zero.
This equals ``exp(logsumexp(2z) − 2 logsumexp(z))``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from otb_ref._checks import compute_dtype, positive_scalar, require_device, require_tensor, require_token_ids

__all__ = ["sum_pi_squared", "token_energy", "logprobs_and_sum_pi_squared", "FUSED_CHUNK_ROWS"]

# Logits elements per chunk when ``chunk_size`` is not given. On CPU a small
# chunk keeps the working set (one fp32 [chunk, V] buffer) in cache and the
# peak memory a few percent of the naive path; on GPUs a larger chunk keeps
# the matmul efficient.
_CHUNK_ELEMENTS = {"cpu": 1 << 22}
_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26


def _logsumexp_and_sum_pi_squared_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp(z), Σ softmax(z)²)`` over the last dim; overwrites ``z``.

    z: [..., V] floating. Rows with no finite maximum give NaN.
    """
    z_max = z.amax(dim=-1, keepdim=True)  # [..., 1]
    e = z.sub_(z_max).exp_()  # [..., V], values in [0, 1]
    s1 = e.sum(dim=-1)  # [...] >= 1
    s2 = e.square_().sum(dim=-1)  # [...] in [1, s1]
    logsumexp = z_max.squeeze(-1) + torch.log(s1)
    sum_pi_squared = (s2 / s1.square()).clamp_(max=1.0)
    return logsumexp, sum_pi_squared


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
        z = logits.to(compute_dtype(logits), copy=True)
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
        ``[...]`` in fp32 (fp64 if either input is fp64), evaluated as
        ``(1 − 2π) + Σπ²`` in that dtype and clamped into ``[0, 2]`` (the
        exact value lies there when log π and Σπ² come from one
        distribution; the clamp removes rounding, and inputs that do not).

    Accuracy: the error is a few units of the last place of 1 (~1e-15 in fp64, ~5e-7 in fp32), absolute. As
    ``π(y) → 1`` the form cancels (``Σπ²`` itself is only known to that precision near 1), so an energy ``w``
    carries a relative error of about ``1e-15 / w`` (fp64) or ``5e-7 / w`` (fp32). Realized energies ``W_t``
    sum many tokens and the baselines add ``ε`` to their denominators, so this matters only for groups whose
    every response is near-deterministic up to ``t`` with ``ε = 0``.
    """
    require_tensor("log_probs", log_probs)
    require_tensor("sum_pi_squared", sum_pi_squared)
    if log_probs.shape != sum_pi_squared.shape:
        raise ValueError(
            f"sum_pi_squared: shape {tuple(sum_pi_squared.shape)} does not match log_probs {tuple(log_probs.shape)}"
        )
    dtype = compute_dtype(log_probs, sum_pi_squared)
    pi_y = torch.exp(log_probs.detach().to(dtype))
    # (1 − 2π) + Σπ², clamped; in π's buffer: −2π + 1 is 1 − 2π to the bit (doubling and negation are exact)
    return pi_y.mul_(-2.0).add_(1.0).add_(sum_pi_squared.detach().to(dtype)).clamp_(0.0, 2.0)


# ---------------------------------------------------------------------------
# The chunk helpers of the eager LM heads: this module's, chunked over rows,
# and otb_ref.grad_norms.lm_head_log_probs, chunked over the vocabulary.
# ---------------------------------------------------------------------------


def default_chunk_size(num_chunked: int, width: int, device: torch.device) -> int:
    """How many of ``num_chunked`` slices to take per chunk when each is ``width`` elements wide.

    The chunk's largest buffer (``[chunk, width]``) stays within about 4M elements on CPU (64M on accelerators);
    at least 1, at most ``num_chunked``. The row-chunked head chunks rows of ``V`` logits; the vocabulary-chunked
    head (``grad_norms``) chunks vocabulary rows of ``max(B·T, B·d)`` entries.
    """
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_ACCELERATOR)
    return max(1, min(num_chunked, budget // max(width, 1)))


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, inv_tau: float, dtype: torch.dtype) -> torch.Tensor:
    """``(hidden @ weightᵀ) / τ`` as a fresh ``[c, V]`` tensor of ``dtype`` (the compute dtype).

    hidden: ``[c, d]``; weight: ``[V, d]`` (all of an LM head's rows, or a chunk of them), hidden's dtype. The
    matmul runs in the input dtype, its output is rounded once to ``dtype``, then scaled by ``inv_tau = 1/τ``.
    """
    logits = hidden @ weight.T  # [c, V] in the input dtype
    logits = logits.to(dtype)  # no copy when already dtype: the matmul output is fresh
    if inv_tau != 1.0:
        logits.mul_(inv_tau)
    return logits


def chunk_logits_grad_(
    z: torch.Tensor,
    logsumexp: torch.Tensor,
    grad_log_probs: torch.Tensor,
    target_columns: torch.Tensor,
    target_grads: torch.Tensor,
    inv_tau: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The gradient of ``Σ_i g_i log π_i(y_i)`` w.r.t. the raw logits, ``g (e_y − π) / τ``, from ``z`` (F6).

    Overwrites ``z`` (``[c, V']``, from :func:`chunk_logits`: the logits / τ in the compute dtype, all of the
    vocabulary or a chunk of it): ``π = exp(z − logsumexp)``, ``z ← −g π``, then ``+ g`` at each row's target
    column, then ``× 1/τ``; returned rounded once to ``dtype`` (the input dtype). ``logsumexp`` and
    ``grad_log_probs`` (``g``): ``[c]`` in z's dtype. ``target_columns``: ``[c]`` int64, the column of ``y`` in
    ``z``; ``target_grads``: ``[c]``, ``g`` where ``y`` lies in this chunk of the vocabulary, else 0 (then the
    column is any valid one). The fused path's :func:`fused_logits_grad_` computes the same formula in the form
    ``torch.compile`` fuses (its own rounding: it stays apart so that its compiled kernel is unchanged).
    """
    grad = z.sub_(logsumexp[:, None]).exp_().mul_(-grad_log_probs[:, None])  # −g π, π = softmax(z)
    grad.scatter_add_(1, target_columns[:, None], target_grads[:, None])  # + g e_y
    return grad.mul_(inv_tau).to(dtype)  # d log π_y / d logits = (e_y − π) / τ


class _ChunkedLogProbs(torch.autograd.Function):
    """Chunked ``log π(y)`` and ``Σπ²``; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_tau, chunk_size):  # noqa: D401
        dtype = compute_dtype(hidden)
        num_rows = hidden.shape[0]
        log_probs = torch.empty(num_rows, dtype=dtype, device=hidden.device)
        logsumexp = torch.empty_like(log_probs)
        sum_pi_squared = torch.empty_like(log_probs)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            z = chunk_logits(hidden[rows], weight, inv_tau, dtype)  # [c, V]
            target_logit = z.gather(1, targets[rows, None]).squeeze(1)  # [c]
            logsumexp[rows], sum_pi_squared[rows] = _logsumexp_and_sum_pi_squared_(z)
            log_probs[rows] = target_logit - logsumexp[rows]
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.inv_tau = inv_tau
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(sum_pi_squared)
        return log_probs, sum_pi_squared

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, _grad_sum_pi_squared):
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
            z = chunk_logits(h, weight, ctx.inv_tau, dtype)  # [c, V]
            grad_z = chunk_logits_grad_(z, logsumexp[rows], g, targets[rows], g, ctx.inv_tau, hidden.dtype)  # [c, V]
            if need_hidden:
                grad_hidden[rows] = grad_z @ weight
            if need_weight:
                grad_weight += (grad_z.T @ h).to(dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


# ---------------------------------------------------------------------------
# The fused path: per chunk one matmul in the input dtype, then ONE pass over
# its logits (forward: a reduction; backward: the logits' gradient written in
# place). The two functions below are plain torch, run as they are on CPU
# (tests compare them with the eager path) and through torch.compile on
# accelerators, where each becomes one kernel that reads the chunk's logits
# once instead of the eager path's ~6 fp32 passes.
# ---------------------------------------------------------------------------

# Rows per chunk of the fused path when ``chunk_size`` is not given. The
# chunk's logits ([rows, V] in the input dtype, 1.16 GiB at 4096 x 152064
# bf16) are the only large buffer of forward and backward. Measured with
# `python benchmarks/run.py --gpu` on an H100 at T = 8192, d = 3584,
# V = 152064, bf16 (benchmarks/results/gpu_NVIDIA-H100-80GB-HBM3.jsonl):
# forward + backward 0.95 / 0.90 / 0.84 / 0.71x the naive full-logits path at
# 1024 / 2048 / 4096 / 8192 rows (fewer chunks: fewer recomputed matmuls, and
# larger K in the weight gradient's), forward 1.24-1.31x the LM-head matmul
# alone; at T = 16384 the peak beyond inputs and gradients is 1.16 GiB at
# 4096 rows and 2.32 GiB at 8192 (over the 2 GiB budget). Hence 4096.
FUSED_CHUNK_ROWS = 4096

IMPLEMENTATIONS = ("auto", "eager", "fused")


def fused_chunk_statistics(
    logits: torch.Tensor, targets: torch.Tensor, inv_tau: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log π(y), logsumexp(z), Σ_v π_v²)`` of one chunk, each ``[c]`` fp32, from one read of its logits.

    With ``z = logits / τ`` in fp32, ``m = max_v z_v``, ``e_v = exp(z_v − m)``,
    ``s₁ = Σ_v e_v`` and ``s₂ = Σ_v e_v²``:

        logsumexp = m + log s₁,   Σπ² = s₂ / s₁²,   log π(y) = z_y − logsumexp

    (the stable form of F6; the same operations as the eager path, so equal
    to it on CPU). ``logits``: ``[c, V]`` (bf16/fp16/fp32); ``targets``: ``[c]`` int64.
    """
    z = logits.float() * inv_tau  # [c, V]
    z_max = z.amax(dim=-1, keepdim=True)  # [c, 1]
    e = torch.exp(z - z_max)  # [c, V] in [0, 1]
    s1 = e.sum(dim=-1)  # [c] >= 1
    s2 = (e * e).sum(dim=-1)  # [c] in [1, s1]
    logsumexp = z_max.squeeze(-1) + torch.log(s1)
    sum_pi_squared = (s2 / s1.square()).clamp(max=1.0)
    log_prob = z.gather(1, targets[:, None]).squeeze(1) - logsumexp
    return log_prob, logsumexp, sum_pi_squared


def fused_logits_grad_(
    logits: torch.Tensor, targets: torch.Tensor, logsumexp: torch.Tensor, grad_log_probs: torch.Tensor, inv_tau: float
) -> torch.Tensor:
    """In place: ``logits ← g (e_y − π) / τ``, the gradient of ``Σ_i g_i log π_i(y_i)`` w.r.t. the raw logits.

    ``π = exp(z − logsumexp)`` with ``z = logits / τ`` in fp32; the result is
    rounded once to the logits' dtype. ``logits``: ``[c, V]``; ``targets``,
    ``logsumexp`` (from :func:`fused_chunk_statistics`), ``grad_log_probs``
    (``g``, fp32): ``[c]``. Returns ``logits``.
    """
    pi = torch.exp(logits.float() * inv_tau - logsumexp[:, None])  # [c, V] softmax(z)
    vocab = torch.arange(logits.shape[1], device=logits.device)
    is_target = vocab[None, :] == targets[:, None]  # [c, V] the one-hot e_y
    scale = (grad_log_probs * inv_tau)[:, None]  # [c, 1] g / τ
    return logits.copy_((is_target.float() - pi) * scale)


class _FusedKernels(NamedTuple):
    statistics: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    logits_grad_: Callable[..., torch.Tensor]


def _compile_rows_dynamic(fn: Callable) -> Callable:
    """``torch.compile(fn)`` whose tensor arguments' first (row) dimension is dynamic.

    ``fullgraph``: the function must become whole kernels, never fall back
    to eager in parts (whose fp32 temporaries would be 8x the memory). The
    row count varies (the last chunk is shorter): one kernel serves all.
    """
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return call


@functools.cache
def _compiled_kernels() -> _FusedKernels:
    """The two fused functions through ``torch.compile``, built once, on first use on an accelerator."""
    return _FusedKernels(_compile_rows_dynamic(fused_chunk_statistics), _compile_rows_dynamic(fused_logits_grad_))


def _fused_kernels(device: torch.device) -> _FusedKernels:
    """Compiled on accelerators; the plain functions on CPU (what the tests compare with the eager path)."""
    if device.type == "cpu":
        return _FusedKernels(fused_chunk_statistics, fused_logits_grad_)
    return _compiled_kernels()


class _FusedChunkedLogProbs(torch.autograd.Function):
    """Chunked ``log π(y)`` and ``Σπ²`` with one pass over each chunk's logits; backward recomputes them.

    Backward, per chunk: ``Z = h Wᵀ``, ``Z ← g (e_y − π) / τ`` in place, then
    ``∂h = Z W`` and ``∂W += Zᵀ h``. The chunks run last to first: with
    ``keep_last`` the last chunk's logits stay from forward (the buffer
    forward held anyway) and only the others are recomputed, one matmul saved.
    ``∂W`` is accumulated in the input dtype (``addmm_``: each chunk's product
    is summed in fp32 inside the matmul and rounded once into the running
    sum), so nothing beyond the returned gradients and one chunk of logits is
    allocated; an fp32 accumulator would add 4 bytes x V x d (2.0 GiB at
    152064 x 3584).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_tau, chunk_size, keep_last):  # noqa: D401
        kernels = _fused_kernels(hidden.device)
        num_rows = hidden.shape[0]
        log_probs = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(log_probs)
        sum_pi_squared = torch.empty_like(log_probs)
        logits = None
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = None  # free the previous chunk before the next matmul
            logits = hidden[rows] @ weight.T  # [c, V] in the input dtype
            log_probs[rows], logsumexp[rows], sum_pi_squared[rows] = kernels.statistics(logits, targets[rows], inv_tau)
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.inv_tau, ctx.chunk_size = inv_tau, chunk_size
        ctx.last_logits = logits if keep_last else None  # read once by backward, then dropped
        ctx.mark_non_differentiable(sum_pi_squared)
        return log_probs, sum_pi_squared

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, _grad_sum_pi_squared):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        kernels = _fused_kernels(hidden.device)
        g = grad_log_probs.to(torch.float32).contiguous()  # [N] (an expanded sum() gradient is materialised)
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        grad_weight = None
        kept, ctx.last_logits = ctx.last_logits, None  # a second backward (retain_graph) recomputes every chunk
        for start in reversed(range(0, hidden.shape[0], ctx.chunk_size)):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]  # [c, d]
            logits = kept if kept is not None else h @ weight.T  # [c, V]: kept from forward, or recomputed
            kept = None
            grad_z = kernels.logits_grad_(logits, targets[rows], logsumexp[rows], g[rows], ctx.inv_tau)
            if need_hidden:
                torch.mm(grad_z, weight, out=grad_hidden[rows])  # [c, d]
            if need_weight:
                grad_weight = grad_z.T @ h if grad_weight is None else grad_weight.addmm_(grad_z.T, h)  # [V, d]
            del logits, grad_z
        if need_weight and grad_weight is None:  # no rows
            grad_weight = torch.zeros_like(weight)
        return grad_hidden, grad_weight, None, None, None, None


def takes_fused_path(implementation: str, hidden: torch.Tensor) -> bool:
    """Whether :func:`logprobs_and_sum_pi_squared` takes the fused path for ``implementation`` and ``hidden``.

    ``"fused"``: yes, ``"eager"``: no; ``"auto"``: on CUDA with Triton (torch.compile's GPU backend). fp64: never.
    """
    if hidden.dtype == torch.float64 or implementation == "eager":
        return False
    if implementation == "fused":
        return True
    return hidden.device.type == "cuda" and has_triton()


@functools.cache
def has_triton() -> bool:
    """Whether torch.compile's GPU backend (Triton, with a GPU it supports) is usable here."""
    try:
        from torch.utils._triton import has_triton as torch_has_triton
    except ImportError:  # pragma: no cover - very old torch
        return False
    return bool(torch_has_triton())


def logprobs_and_sum_pi_squared(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` and ``Σπ²`` from an LM head, chunk by chunk.

    With logits ``z = hidden @ weightᵀ / τ`` (never materialised whole):
    ``log_probs = z_y − logsumexp(z)`` and ``sum_pi_squared = Σ_v softmax(z)_v²``
    (F6). Rows are processed ``chunk_size`` at a time, so at most one
    ``[chunk_size, V]`` logits buffer exists. Backward recomputes each chunk's
    logits from ``hidden`` and ``weight`` instead of storing them (the fused
    path keeps the last chunk's buffer from forward to backward instead of
    recomputing it).

    Args:
        hidden: ``[..., d]`` final hidden states (bf16/fp16/fp32/fp64).
        weight: ``[V, d]`` LM-head weight, same dtype and device as ``hidden``.
        targets: ``[...]`` integer token ids in ``[0, V)``.
        temperature: ``τ > 0``, the sampling temperature.
        chunk_size: rows per chunk. Default: eager, one chunk's logits at
            about 4M elements on CPU (64M on accelerators); fused,
            :data:`FUSED_CHUNK_ROWS` rows.
        implementation: ``"eager"``: plain torch ops per chunk (several fp32
            ``[chunk, V]`` temporaries). ``"fused"``: per chunk one matmul in
            the input dtype and one pass over its logits
            (:func:`fused_chunk_statistics`, :func:`fused_logits_grad_`),
            compiled with ``torch.compile`` on accelerators, plain torch on
            CPU; the weight gradient is accumulated in the input dtype. fp64
            input always takes the eager path. ``"auto"`` (default): fused on
            CUDA with Triton, eager elsewhere. Both give the same values to
            rounding (tested).

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
    require_token_ids("targets", targets, vocab, "the rows of weight")
    inv_tau = 1.0 / positive_scalar("temperature", temperature)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS}, got {implementation!r}")
    fused = takes_fused_path(implementation, hidden)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, d]
    flat_targets = targets.reshape(-1).long()  # [N]
    if chunk_size is None:
        num_rows = flat_hidden.shape[0]
        if fused:
            chunk_size = max(1, min(num_rows, FUSED_CHUNK_ROWS))
        else:
            chunk_size = default_chunk_size(num_rows, vocab, hidden.device)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    if fused:
        keep_last = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        log_probs, sum_pi_squared = _FusedChunkedLogProbs.apply(
            flat_hidden, weight, flat_targets, inv_tau, chunk_size, keep_last
        )
    else:
        log_probs, sum_pi_squared = _ChunkedLogProbs.apply(flat_hidden, weight, flat_targets, inv_tau, chunk_size)
    _raise_if_nan("hidden, weight", sum_pi_squared)
    return log_probs.reshape(targets.shape), sum_pi_squared.reshape(targets.shape)
