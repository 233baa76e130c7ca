"""Exact score norms ``||S||²`` and ``||S_t||²`` for real batches on a small causal LM.

THEORY §1 notation. For one response ``y`` with mask ``m`` (1 on tokens the
policy generated), the token score and the cumulative score are

    s_j = m_j ∇_θ log π_θ(y_j | h_j)              (zero where m_j = 0)
    S_t = Σ_{j ≤ t} s_j,        S = S_T

with ``π_j = softmax(z_{j−1} / temperature)``: token ``j`` is predicted from
the logits at position ``j − 1``. θ is every parameter of the model with
``requires_grad=True`` (tied weights counted once).

* :func:`sequence_grad_norms_sq_fp64` returns ``||S||²`` per row, ``[B]``: the
  ``grad_norms_sq`` input of ``compute_advantages("eob", ...)`` (F3).
* :func:`prefix_grad_norms_sq_fp64` returns ``||S_t||²`` at every position, ``[B, L]``,
  zero where the response mask is 0: its response slice ``[:, -T:]`` (or
  whichever ``[B, T]`` columns hold the responses) is the ``cumulative_energy``
  input of ``compute_advantages("otb_exact", ...)`` (F5 with exact energies).
  The Logit-Gradient Proxy of F6 estimates the same quantity from forward
  passes only; these functions are its exact reference.

Method. The model is copied (``copy.deepcopy(model).double().eval()``): the
caller's model (parameters, dtype, ``.grad`` fields, train/eval mode) is never
touched, and dropout is off during the computation (eval mode), whatever
mode the caller's model is in. The copy is called through
``torch.func.functional_call`` with the trainable parameters as explicit
inputs, each row fed alone as a ``[1, L]`` batch, so a row's gradient is that
of its own log-probs only (in a padded batched forward, rows could interact
only through padding; here they cannot at all):

* ``||S||²``: ``torch.func.grad`` of ``Σ_j m_j log π(y_j)``; O(P) memory per
  row, P = number of trainable parameters.
* ``||S_t||²``: ``torch.func.jacrev`` of the vector of per-token log-probs over
  the row's response span (first to last response token, holes included): a
  Jacobian ``[n, P]`` (``n ≤ L``; one batched backward over the tokens, no
  Python loop over tokens), masked, cumulative-summed over tokens, squared
  norms. This is done parameter tensor by parameter tensor, which gives the
  same numbers as flattening to ``[n, P]`` because squared norms add over
  blocks. Memory is O(L × P) per row (plus the batched backward's
  activations, O(L × the activations of one forward)).

float64 throughout. Models written for bf16 keep float32 "islands" that would
silently round a float64 forward, and through its backward the gradients, to
float32 (~1e-8 relative): transformers' RMSNorm (``hidden.to(torch.float32)``),
rotary embeddings (``.float()``), eager attention
(``softmax(..., dtype=torch.float32)``). During the forward a
``TorchFunctionMode`` promotes every such float32/float16/bfloat16 request to
float64 (see :class:`_Float64Mode`), so the results are float64-exact: e.g.
the prefix norm at the last response token equals the sequence norm to
~1e-16 relative (with the islands, only to ~1e-8). The results are the
gradients of the model's function evaluated in float64 at the caller's
parameter values (a bf16/fp32 model's own low-precision forward differs from
that by its rounding).

Batching over rows. Rows are mapped with ``torch.func.vmap`` where possible,
in chunks that bound memory (``_VMAP_ELEMENTS``). ``vmap`` over the batch
does NOT work when a per-row ``attention_mask`` goes to a transformers model
with its default SDPA attention: the mask construction
(``masking_utils._ignore_causal_mask_sdpa``) branches in Python on the mask's
values, which vmap forbids (eager attention, or no attention mask, vmaps
fine). Rows are therefore grouped by identical attention-mask pattern (e.g.
all rows without padding; all rows with the same left padding) and each group
is vmapped with its mask as a constant. If vmap still fails (a model with
other data-dependent Python control flow), the computation falls back to a
plain loop over rows, with identical results.

Model calls. ``model(input_ids[1, L], attention_mask=[1, L] if given,
use_cache=False if the forward accepts it)``. Position ids are the model's
default, i.e. what that call computes (for transformers models ``0..L−1``
whatever the padding): the norms are the gradients of exactly those
log-probs.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.overrides import TorchFunctionMode

from otb_ref._checks import lm_batch_masks, positive_scalar, require_tensor
from otb_ref.grad_norms import accepts_keyword, logits_of

__all__ = ["sequence_grad_norms_sq_fp64", "prefix_grad_norms_sq_fp64"]

# Use torch.func.vmap over rows (False: always a plain loop over rows; the
# tests run both paths).
_VMAP_ROWS = True
# float64 elements of gradient / Jacobian output per vmap chunk (≈ 128 MiB).
_VMAP_ELEMENTS = 1 << 24


def sequence_grad_norms_sq_fp64(
    model: nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Exact squared norm of each response's score, ``||S||²`` (THEORY §1, F3).

    ``out[b] = ||∇_θ Σ_j m_bj log π(y_bj)||²`` with
    ``log π(y_j) = log_softmax(logits[j − 1] / temperature)[y_j]``, θ = all
    parameters with ``requires_grad=True``.

    Args:
        model: a causal LM ``nn.Module`` called as ``model(input_ids[1, L],
            attention_mask=...)`` and returning logits ``[1, L, V]`` (a tensor,
            a tuple whose first item is the logits, or an object with
            ``.logits``, e.g. any ``transformers`` ``*ForCausalLM``). It is
            not modified: a float64 copy in eval mode (dropout off) is used.
        input_ids: ``[B, L]`` integer ids, prompt followed by response (padding
            anywhere the attention mask is 0).
        response_mask: ``[B, L]`` 0/1 (any dtype); 1 marks the response tokens
            whose log-probs enter ``S``. Holes (tool output inside a response)
            are allowed; a row of zeros (empty response) gives 0. Column 0 must
            be 0 (token 0 has no predicting position), and every response
            token and its predicting position must be real tokens.
        attention_mask: optional ``[B, L]`` 0/1 (1 = real token), left or right
            padding; passed to the model.
        temperature: ``τ > 0``; logits are divided by it.

    Returns:
        ``[B]`` float64 on ``input_ids``' device, ``>= 0``, whatever the model's
        dtype (computed on a float64 copy on the model's device, float32
        islands promoted; see the module docstring). An ordinary tensor even
        when called under ``torch.inference_mode()``: it can be updated in
        place and enter autograd. Feeds
        ``compute_advantages("eob", ..., grad_norms_sq=...)``.

    Raises:
        ValueError: message starts with the offending argument's name.
    """
    with _grad_mode():
        job = _prepare(model, input_ids, response_mask, attention_mask, temperature)
        out = torch.zeros(job.batch, dtype=torch.float64, device=job.device)  # [B]
        for rows, attn, lo, hi in job.chunks(per_row_elements=job.num_params):
            out[rows] = _run_chunk(job, _sequence_rows, rows, attn, lo, hi)
    return out.to(input_ids.device)


def prefix_grad_norms_sq_fp64(
    model: nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Exact squared norm of the cumulative score ``||S_t||²`` at every position (THEORY §1, F5).

    ``out[b, t] = ||Σ_{j ≤ t} m_bj ∇_θ log π(y_bj)||²`` where
    ``m_bt = 1``, and exactly 0 where ``m_bt = 0`` (prompt, padding, holes).
    At a row's last response position it equals :func:`sequence_grad_norms_sq_fp64`.

    Args:
        model, input_ids, response_mask, attention_mask, temperature: as in
            :func:`sequence_grad_norms_sq_fp64`.

    Returns:
        ``[B, L]`` float64 on ``input_ids``' device (computed as in
        :func:`sequence_grad_norms_sq_fp64`), on the same grid as ``input_ids``.
        The ``[B, T]`` columns that hold the responses are the
        ``cumulative_energy`` input of
        ``compute_advantages("otb_exact", ..., cumulative_energy=...)``.

    Memory: O(L × P) per row (the per-token Jacobian), P = number of trainable
    parameters; rows are processed in chunks of at most ``_VMAP_ELEMENTS``
    Jacobian elements.

    Raises:
        ValueError: message starts with the offending argument's name.
    """
    with _grad_mode():
        job = _prepare(model, input_ids, response_mask, attention_mask, temperature)
        out = torch.zeros(job.batch, job.length, dtype=torch.float64, device=job.device)  # [B, L]
        for rows, attn, lo, hi in job.chunks(per_row_elements=job.length * job.num_params):
            out[rows, lo : hi + 1] = _run_chunk(job, _prefix_rows, rows, attn, lo, hi)
    return out.to(input_ids.device)


# --------------------------------------------------------------------------- internals


class _Job:
    """Validated inputs, the float64 model copy and its trainable parameters."""

    def __init__(self, model, params, ids, mask, attn, tau, forward_kwargs):
        self.model = model  # float64 eval-mode copy
        self.params = params  # {name: tensor} trainable parameters (detached)
        self.num_params = sum(p.numel() for p in params.values())
        self.ids = ids  # [B, L] int64 on the model's device
        self.mask = mask  # [B, L] float64 0/1
        self.attn = attn  # [B, L] int64 0/1 or None
        self.tau = tau
        self.forward_kwargs = forward_kwargs
        self.batch, self.length = ids.shape
        self.device = ids.device
        self.use_vmap = _VMAP_ROWS

    def chunks(self, per_row_elements: int):
        """Yield ``(rows [c] long, attention row [L] or None, lo, hi)``.

        Rows with an empty response are skipped (their norms are 0). Rows in
        one chunk share the attention-mask pattern; ``lo..hi`` (inclusive) is
        the union of their response spans.
        """
        active = self.mask.bool().any(dim=1).nonzero().flatten()  # [r] rows with a response
        if active.numel() == 0:
            return
        if self.attn is None:
            groups = [(active, None)]
        else:
            patterns, inverse = torch.unique(self.attn[active], dim=0, return_inverse=True)  # [G, L], [r]
            groups = [(active[inverse == g], patterns[g]) for g in range(patterns.shape[0])]
        size = max(1, _VMAP_ELEMENTS // max(per_row_elements, 1)) if self.use_vmap else 1
        positions = torch.arange(self.length, device=self.device)  # [L]
        for rows, attn in groups:  # rows [r_g], attn [L] or None
            for start in range(0, rows.numel(), size):
                chunk = rows[start : start + size]  # [c]
                on = self.mask[chunk].bool().any(dim=0)  # [L] some row has a response token here
                lo = int(positions[on].min())
                hi = int(positions[on].max())
                yield chunk, attn, lo, hi


@contextlib.contextmanager
def _grad_mode():
    """Autograd on, even when the caller runs under ``torch.no_grad`` or ``inference_mode``."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
_CAST_METHODS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _is_low(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value in _LOW_PRECISION


class _Float64Mode(TorchFunctionMode):
    """Promote every low-precision floating dtype requested inside the forward to float64.

    Models written for bf16 keep "islands" in float32: transformers' RMSNorm
    does ``hidden_states.to(torch.float32)``, rotary embeddings call
    ``.float()``, eager attention uses ``softmax(..., dtype=torch.float32)``.
    On a float64 copy these would round activations, and through their
    backward the gradients, to float32 (~1e-8 relative). Inside this mode
    ``.float()/.half()/.bfloat16()``, a float32/16 or bfloat16 ``dtype`` given
    to ``Tensor.to``/``Tensor.type`` (positionally or by keyword) and any
    ``dtype=`` keyword of a torch function become float64, so the whole
    forward (and hence the backward) is float64. Tensors created without a
    dtype still get the default dtype; arithmetic with float64 promotes them.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _CAST_METHODS:
            return args[0].to(torch.float64)
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(torch.float64 if _is_low(a) else a for a in args)
        if _is_low(kwargs.get("dtype")):
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _token_log_probs(job: _Job, params, ids_row, attn, lo: int, hi: int) -> torch.Tensor:
    """``log π(y_j)`` for ``j = lo..hi`` of one row fed alone as ``[1, L]``. Returns ``[n]``, n = hi − lo + 1."""
    kwargs = dict(job.forward_kwargs)
    if attn is not None:
        kwargs["attention_mask"] = attn[None]  # [1, L]
    with _Float64Mode():
        output = functional_call(job.model, params, (ids_row[None],), kwargs)  # ids [1, L]
    logits = _logits_of(output, job.length)  # [1, L, V]
    z = logits[0, lo - 1 : hi] / job.tau  # [n, V]: position j − 1 predicts token j
    targets = ids_row[lo : hi + 1]  # [n]
    return z.log_softmax(dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [n]


def _sequence_rows(job: _Job, ids_row, mask_row, attn, lo: int, hi: int) -> torch.Tensor:
    """``||S||²`` of one row (scalar)."""

    def score_objective(params):
        log_probs = _token_log_probs(job, params, ids_row, attn, lo, hi)  # [n]
        return (log_probs * mask_row[lo : hi + 1]).sum()  # Σ_j m_j log π(y_j)

    scores = grad(score_objective)(job.params)  # {name: [*shape]} = S
    return sum(s.square().sum() for s in scores.values())  # ||S||²


def _prefix_rows(job: _Job, ids_row, mask_row, attn, lo: int, hi: int) -> torch.Tensor:
    """``||S_t||²`` for ``t = lo..hi`` of one row, ``[n]``, zero where the mask is 0."""

    def token_log_probs(params):
        return _token_log_probs(job, params, ids_row, attn, lo, hi)  # [n]

    jacobian = jacrev(token_log_probs)(job.params)  # {name: [n, *shape]}: row j = ∇ log π(y_j)
    m = mask_row[lo : hi + 1]  # [n]
    energy = torch.zeros_like(m)  # [n]
    for name in list(jacobian):
        block = jacobian.pop(name)  # [n, *shape]
        s = block.reshape(block.shape[0], -1) * m[:, None]  # [n, p_block]: s_j restricted to the block
        cumulative = s.cumsum(dim=0)  # [n, p_block]: S_t restricted to the block
        energy = energy + cumulative.square().sum(dim=-1)  # [n]: Σ over blocks = ||S_t||²
    return energy * m  # [n], exactly 0 off the mask (holes included)


def _run_chunk(job: _Job, row_fn: Callable, rows: torch.Tensor, attn, lo: int, hi: int) -> torch.Tensor:
    """``row_fn`` on each row of ``rows``: vmapped if possible, else a row loop. Returns ``[c, ...]``."""
    ids = job.ids[rows]  # [c, L]
    mask = job.mask[rows]  # [c, L]
    with warnings.catch_warnings():
        # functorch's BatchedFallback warns "There is a performance drop because we
        # have not yet implemented the batching rule for ..." (e.g. the SDPA backward).
        warnings.filterwarnings("ignore", message="There is a performance drop")
        if job.use_vmap:
            try:
                return vmap(lambda i, m: row_fn(job, i, m, attn, lo, hi))(ids, mask)  # [c, ...]
            except Exception:  # vmap unsupported by this model: loop over rows from now on
                job.use_vmap = False
        return torch.stack([row_fn(job, ids[k], mask[k], attn, lo, hi) for k in range(ids.shape[0])])


def _logits_of(output: Any, length: int) -> torch.Tensor:
    logits = logits_of(output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != (1, length):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"model: expected logits of shape (1, {length}, V) for one row, got {shape}")
    if logits.dtype != torch.float64:
        warnings.warn(
            f"model: the float64 copy produced {logits.dtype} logits; the norms are not exact in float64",
            stacklevel=_callers_level(),
        )
    return logits


_INSIDE = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # otb_ref/
)


def _callers_level() -> int:
    """``warnings.warn``'s ``stacklevel`` for a warning raised by this function's caller that names the first frame
    outside otb_ref and torch: the user's call (the frames between vary: torch.func's transforms, the row loop)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def _prepare(model, input_ids, response_mask, attention_mask, temperature) -> _Job:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model: has no trainable parameters (requires_grad=True)")

    require_tensor("input_ids", input_ids)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected shape [B, L], got {tuple(input_ids.shape)}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected an integer dtype, got {input_ids.dtype}")
    if input_ids.numel() and int(input_ids.min()) < 0:
        raise ValueError(f"input_ids: ids must be >= 0, found {int(input_ids.min())}")
    vocab = _embedding_size(model)
    if vocab is not None and input_ids.numel() and int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids: id {int(input_ids.max())} >= the model's vocabulary size {vocab}")

    mask, attn = lm_batch_masks(input_ids, response_mask, attention_mask)  # [B, L] bool each (attn or None)
    if attn is not None:
        predictor_real = torch.zeros_like(attn)
        predictor_real[:, 1:] = attn[:, :-1]  # [B, L]: position t − 1 is a real token
        bad = mask & ~(attn & predictor_real)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"response_mask: response token at (row {b}, position {t}) is padding or is predicted "
                "from padding (attention_mask is 0 there or at the position before)"
            )

    if isinstance(temperature, bool):
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}")
    tau = positive_scalar("temperature", temperature)

    work = copy.deepcopy(model).double().eval()  # float64, dropout off; the caller's model is untouched
    for p in work.parameters():
        p.grad = None
    params = {name: p.detach() for name, p in work.named_parameters() if p.requires_grad}
    device = next(iter(params.values())).device

    # no KV cache objects inside the transforms
    forward_kwargs = {"use_cache": False} if accepts_keyword(work, "use_cache") else {}

    return _Job(
        model=work,
        params=params,
        # copies: normal (non-inference) tensors even for inference-mode inputs
        ids=input_ids.to(device=device, dtype=torch.long, copy=True),
        mask=mask.to(device=device, dtype=torch.float64, copy=True),
        attn=None if attn is None else attn.to(device=device, dtype=torch.long, copy=True),
        tau=tau,
        forward_kwargs=forward_kwargs,
    )


def _embedding_size(model: nn.Module) -> int | None:
    getter = getattr(model, "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        embedding = getter()
    except Exception:
        return None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None
