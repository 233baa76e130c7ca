"""Every response's exact ``||S||²`` in one forward + backward (THEORY F3: the energy of the EOB).

For rows ``i`` of a batch and a per-row objective ``f_i`` (for the EOB, ``f_i = Σ_t m_it log π(y_it)``, so
``∇_θ f_i = S_i``), this module computes ``||∇_θ f_i||²`` for every row at the cost of about one ordinary
forward + backward. The backward asks autograd for gradients with respect to layer OUTPUTS only, so the
usual weight-gradient matmuls are never run; in their place each layer turns its input activations ``a``
and output gradients ``g`` into per-row squared norms ("ghost norms", Goodfellow 2015; Li et al. 2022;
Bu et al.'s Book-Keeping):

    Linear, y_t = W a_t + c:   ∇_W f_i = Σ_t g_t a_tᵀ           (sum over the row's positions t)
        Gram form:             ||∇_W f_i||² = Σ_{s,t} (a_s · a_t)(g_s · g_t)     cost T² (d_in + d_out)
        materialised form:     ||Σ_t g_t a_tᵀ||²                                  cost T d_in d_out
        (the cheaper one is chosen per layer call);  ||∇_c f_i||² = ||Σ_t g_t||²
    Embedding, y_t = E[x_t]:   ||∇_E f_i||² = Σ_v ||Σ_{t: x_t = v} g_t||²
    Norm layers (RMSNorm, LayerNorm: a few parameters acting on each position): the per-row gradient
        itself, by a per-row vector-Jacobian product of the layer (torch.func.vmap over rows).

A parameter used by several calls (tied input/output embeddings) gets the sum of the calls' gradients
before squaring: ``||G + H||² = ||G||² + ||H||² + 2⟨G, H⟩``, with e.g. for the LM head ``G = Σ_t c_t h_tᵀ``
(logit gradients c, hidden states h) and the embedding ``H = Σ_s e_{x_s} g_sᵀ``:
``⟨G, H⟩ = Σ_{s,t} c_t[x_s] (g_s · h_t)``.

Memory: a call keeps its input, not its output. Inside a non-reentrant activation-checkpointed region it keeps
nothing: its input comes back when the backward recomputes the region (see ``_Tape``).

Assumptions, checked where possible: rows do not interact (true of causal LMs with attention masks);
every trainable parameter belongs directly to an ``nn.Linear``, an ``nn.Embedding`` or a norm layer (any
other parameterised module raises); layer activations keep the row dimension first (``[B, ..., d]``).
The result is exact, not an estimate: it equals ``otb_ref.exact.sequence_grad_norms_sq_fp64`` (which takes a
gradient per row with ``torch.func``) to rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from otb_ref._checks import compute_dtype, lm_batch_masks, positive_scalar, require_tensor, require_token_ids
from otb_ref.proxy import chunk_logits, chunk_logits_grad_, default_chunk_size

__all__ = ["lm_head_log_probs", "plain_lm_head", "row_grad_norms_sq", "sequence_grad_norms_sq"]

# Elements of the largest temporary (per-row gradients or Gram matrices) per block of rows.
_BLOCK_ELEMENTS = 1 << 27
# Norm-layer classes checked to compute ``w ⊙ n(x) + b`` (True) or not (False): checked once per class, because
# the check reads a value on the host, and a host sync per layer inside the backward stalls an accelerator.
_AFFINE_NORM_CLASSES: dict[type, bool] = {}
# How linear layers' weight norms may be computed (``linear_method``): "auto" (the cheaper form per call), "gram" or
# "materialize".
LINEAR_METHODS = ("auto", "gram", "materialize")
# The tapes recording a forward now (innermost last): where lm_head_log_probs finds the row_grad_norms_sq call whose
# objective runs it. A context variable: set and reset by the tape's ``recording()``, one value per thread and task.
_recording: contextvars.ContextVar[tuple[_Tape, ...]] = contextvars.ContextVar("otb_ref_grad_norms_tapes", default=())


def sequence_grad_norms_sq(
    model: nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunked_lm_head: bool = False,
    chunk_size: int | None = None,
    *,
    linear_method: str = "auto",
) -> torch.Tensor:
    """``||S_i||² = ||∇_θ Σ_t m_it log π(y_it)||²`` for every row, in one forward + backward (F3).

    Same convention as :func:`otb_ref.exact.sequence_grad_norms_sq_fp64`: ``log π(y_t) =
    log_softmax(logits[t − 1] / temperature)[y_t]``, θ = every parameter with ``requires_grad``, the
    model's default position ids, dropout off (eval mode during the call; each module's mode restored).

    Args:
        model: a causal LM called as ``model(input_ids, attention_mask=..., use_cache=False)`` returning
            logits ``[B, L, V]`` (a tensor, a tuple starting with them, or an object with ``.logits``).
            Its parameters, ``.grad`` fields and train/eval modes are left as they were.
        input_ids: ``[B, L]`` integer ids, prompt then response.
        response_mask: ``[B, L]`` 0/1; 1 marks the response tokens whose log-probs enter ``S``. Column 0
            must be 0 (token 0 has no predicting position).
        attention_mask: optional ``[B, L]`` 0/1 passed to the model (left or right padding).
        temperature: ``τ > 0``.
        chunked_lm_head: False: the model's own logits ``[B, L, V]``. True: no ``[B, L, V]`` tensor: the hidden
            states of ``model.get_decoder()`` (a Hugging Face causal LM) go through :func:`lm_head_log_probs` with
            ``model.get_output_embeddings()``, which must compute plain ``h Wᵀ`` logits (refused: a head bias,
            ``final_logit_softcapping`` or a ``logit_scale`` ≠ 1 in ``model.config``).
        chunk_size: vocabulary rows per chunk of the chunked head (default: see :func:`lm_head_log_probs`).
        linear_method: how linear layers' weight norms are computed, as in :func:`row_grad_norms_sq`.

    Returns:
        ``[B]`` float32 (accumulated in float64), ``>= 0``; 0 for an empty response.
    """
    mask = _check_inputs(input_ids, response_mask, attention_mask)
    tau = positive_scalar("temperature", temperature)
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    if accepts_keyword(model, "use_cache"):
        kwargs["use_cache"] = False
    targets = input_ids[:, 1:].long()  # [B, L-1]: position t - 1 predicts token t
    if chunked_lm_head:
        decoder, head = plain_lm_head(model)
        with _eval_mode(model):
            _check_plain_logits(
                model,
                decoder,
                head,
                input_ids[:1],
                {k: v[:1] if k == "attention_mask" else v for k, v in kwargs.items()},
            )

        def log_probs_of_targets() -> torch.Tensor:  # [B, L-1]
            hidden = _last_hidden(decoder(input_ids, **kwargs))
            return lm_head_log_probs(hidden[:, :-1], head, targets, tau, chunk_size)

    else:

        def log_probs_of_targets() -> torch.Tensor:  # [B, L-1]
            logits = logits_of(model(input_ids, **kwargs))  # [B, L, V]
            z = logits[:, :-1].to(compute_dtype(logits)) / tau  # [B, L-1, V]
            return z.gather(-1, targets[..., None]).squeeze(-1) - z.logsumexp(dim=-1)

    def response_log_likelihood() -> torch.Tensor:  # [B]
        log_probs = log_probs_of_targets()
        return (log_probs * mask[:, 1:].to(log_probs.dtype)).sum(dim=1)

    with _eval_mode(model):
        return row_grad_norms_sq(model, response_log_likelihood, linear_method=linear_method)


def _last_hidden(output) -> torch.Tensor:
    """A decoder's hidden states: ``.last_hidden_state``, or the first item of a tuple."""
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _check_plain_logits(model: nn.Module, decoder: nn.Module, head: nn.Linear, ids: torch.Tensor, kwargs) -> None:
    """The model's own logits on one row must be its decoder's hidden states times the head's weight (one small
    forward, no gradient): a head that scales, caps or shifts its logits is refused, whatever its config says."""
    with torch.no_grad():
        want = logits_of(model(ids, **kwargs))
        got = _last_hidden(decoder(ids, **kwargs)) @ head.weight.T
    if got.shape != want.shape or not _close(got, want.to(got.dtype)):
        raise ValueError(
            "chunked_lm_head: the model's logits are not its decoder's hidden states times the head's weight "
            "(h Wᵀ); the chunked head would compute other log-probs"
        )


def plain_lm_head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """``(model.get_decoder(), model.get_output_embeddings())`` of a Hugging Face causal LM whose logits are plain
    ``h Wᵀ``; ValueError otherwise (no such methods, a head that is not a bias-free ``nn.Linear``, or a config with
    ``final_logit_softcapping`` or ``logit_scale`` ≠ 1)."""
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    config = getattr(model, "config", None)
    if (
        not callable(get_decoder)
        or not isinstance(head, nn.Linear)
        or head.bias is not None
        or getattr(config, "final_logit_softcapping", None)
        or any(getattr(config, name, None) not in (None, 1.0) for name in ("logit_scale", "logits_scaling"))
    ):
        raise ValueError(
            "chunked_lm_head: the model must be a causal LM with get_decoder() and a bias-free nn.Linear from "
            "get_output_embeddings() computing plain logits h Wᵀ (no soft-capping or scaling)"
        )
    return get_decoder(), head


def row_grad_norms_sq(
    model: nn.Module, objective: Callable[[], torch.Tensor], *, linear_method: str = "auto"
) -> torch.Tensor:
    """``||∇_θ f_i||²`` for each row ``i`` of ``f = objective()``, in one forward + backward.

    Args:
        model: the module whose trainable parameters θ are differentiated. Every trainable parameter
            must belong directly to an ``nn.Linear``, ``nn.Embedding`` or norm layer (else ValueError).
        objective: runs the forward of ``model`` on a batch of B rows and returns ``f``, ``[B]``, where
            ``f_i`` depends on row i's inputs only. Called once, with autograd on. The backward starts at the
            outputs of the layer calls whose input needs no gradient (embeddings, layers on frozen features), or
            at every layer output when there is none: inputs that require grad must not be mixed with such calls.
            Non-reentrant activation checkpointing is supported, selective too (a checkpointed call's input comes
            back with the recomputation); reentrant checkpointing and other saved-tensor hooks (e.g.
            ``save_on_cpu``) are refused.
        linear_method: how each linear layer call's weight norm is computed: ``"auto"`` (default) the cheaper of
            the Gram form and the materialised gradient (see :func:`linear_weight_norms_sq`), or always
            ``"gram"`` or ``"materialize"``. Every choice gives the exact norms (to rounding).

    Returns:
        ``[B]`` float32 (accumulated in float64). The parameters' ``.grad`` fields are not touched.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if linear_method not in LINEAR_METHODS:
        raise ValueError(f"linear_method: expected one of {LINEAR_METHODS}, got {linear_method!r}")
    tape = _Tape(model, linear_method)
    try:
        with torch.inference_mode(False), torch.enable_grad(), tape.recording():
            f = objective()
        if not isinstance(f, torch.Tensor) or f.dim() != 1:
            raise ValueError(f"objective: expected a [B] tensor of per-row values, got {_describe(f)}")
        tape.start_backward(rows=f.shape[0], device=f.device)
        with torch.inference_mode(False), torch.enable_grad(), tape.replaying():
            sources = tape.sources()
            if sources and f.requires_grad:
                torch.autograd.grad(f.sum(), sources, allow_unused=True)
        return tape.finish().float()
    finally:
        tape.detach_hooks()


def recorded_calls() -> list:
    """The layer calls recorded so far by the innermost :func:`row_grad_norms_sq` whose objective is running now;
    empty outside one. A hook for tests and debugging: each call has ``module``, ``kind`` (``"linear"``,
    ``"embedding"`` or ``"norm"``), ``inputs`` (None while a checkpointed call waits for its recomputation),
    ``output`` (kept only where the backward starts) and ``recomputed``."""
    tapes = _recording.get()
    return tapes[-1].calls if tapes else []


# --------------------------------------------------------------------------- the LM head, chunked over the vocabulary


def lm_head_log_probs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``log π(y_t) = z_t[y_t] − logsumexp(z_t)`` with ``z_t = W h_t / τ``, never forming ``[B, T, V]`` logits.

    The head's weight ``W`` [V, d] is taken ``chunk_size`` vocabulary rows at a time: forward keeps a running
    logsumexp, backward recomputes each chunk's logits, so the largest buffers are ``[B·T, chunk]`` (and, in
    :func:`row_grad_norms_sq`, ``[B, chunk, d]`` or a ``[B, T, T]`` Gram accumulator). Differentiable
    in ``hidden`` and ``W``. Inside :func:`row_grad_norms_sq`'s objective it is the head's recorded call: with the
    gradient at the logits ``c_t = g_t (e_{y_t} − π_t) / τ`` (``g`` the gradient at the log-probs), its backward adds
    the head weight's per-row ``||Σ_t c_t h_tᵀ||²`` chunk by chunk (the sum over chunks of the chunks' squares:
    Gram form ``Σ_{s,t} (h_s·h_t)(c_s·c_t)`` or materialised, whichever is cheaper, as for any linear layer) and
    keeps ``c_t[x_s]`` for a weight tied to the input embedding; ``W``'s own gradient is then not formed.

    Args:
        hidden: ``[B, T, d]`` final hidden states (what the head multiplies), floating.
        lm_head: an ``nn.Linear`` without bias; weight ``[V, d]`` of hidden's dtype and device.
        targets: ``[B, T]`` integer ids in ``[0, V)``.
        temperature: ``τ > 0``.
        chunk_size: vocabulary rows per chunk. Default: a chunk's largest buffer at about 4M elements on CPU (64M
            on accelerators), the budget of :func:`otb_ref.logprobs_and_sum_pi_squared`.

    Returns:
        ``[B, T]`` float32 (float64 for float64 input).
    """
    weight = _check_head(hidden, lm_head, targets)
    inv_tau = 1.0 / positive_scalar("temperature", temperature)
    rows, positions, width = hidden.shape
    if chunk_size is None:
        per_entry = max(rows * positions, rows * width)  # the chunk's logits; its materialised head gradients
        chunk_size = default_chunk_size(weight.shape[0], per_entry, hidden.device)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    if positions == 0:  # no token to predict: nothing depends on the head
        return torch.zeros(targets.shape, dtype=compute_dtype(hidden), device=hidden.device)
    recorded = None
    tapes = _recording.get()
    if tapes and torch.is_grad_enabled():
        tape = tapes[-1]
        call, hidden = tape.record_chunked_head(lm_head, hidden)
        if call is not None:
            recorded, weight = (tape, call), weight.detach()  # the tape books W's norms; W's gradient is not needed
    return _ChunkedHead.apply(hidden, weight, targets.long(), inv_tau, chunk_size, recorded)


def _check_head(hidden, lm_head, targets) -> torch.Tensor:
    """The head's weight, after checking the three arguments of :func:`lm_head_log_probs`."""
    require_tensor("hidden", hidden)
    require_tensor("targets", targets)
    if hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"hidden: expected floating [B, T, d], got {hidden.dtype} {tuple(hidden.shape)}")
    if not isinstance(lm_head, nn.Linear) or lm_head.bias is not None:
        raise ValueError(f"lm_head: expected an nn.Linear without bias, got {lm_head!r}")
    weight = lm_head.weight
    if weight.shape[1] != hidden.shape[2] or weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"lm_head: weight {weight.dtype} {tuple(weight.shape)} on {weight.device} does not match hidden "
            f"{hidden.dtype} {tuple(hidden.shape)} on {hidden.device}"
        )
    if targets.shape != hidden.shape[:2] or targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(
            f"targets: expected integer ids {tuple(hidden.shape[:2])}, got {targets.dtype} {tuple(targets.shape)}"
        )
    require_token_ids("targets", targets, weight.shape[0], "the rows of the head's weight")
    return weight


def _vocab_chunks(vocab: int, chunk_size: int):
    for start in range(0, vocab, chunk_size):
        yield slice(start, min(vocab, start + chunk_size))


def _in_chunk(ids: torch.Tensor, chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids − chunk.start clamped into the chunk, whether the id lies in it)``, both shaped like ``ids``."""
    inside = (ids >= chunk.start) & (ids < chunk.stop)
    return (ids - chunk.start).clamp(0, chunk.stop - chunk.start - 1), inside


class _ChunkedHead(torch.autograd.Function):
    """``log π(y)`` through an LM head chunked over the vocabulary (see :func:`lm_head_log_probs`)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_tau, chunk_size, recorded):  # noqa: D401
        h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # [N, d], [N]
        dtype = compute_dtype(hidden)
        running_max = torch.full(y.shape, -torch.inf, dtype=dtype, device=h.device)
        running_sum = torch.zeros_like(running_max)
        target_logit = torch.zeros_like(running_max)
        for chunk in _vocab_chunks(weight.shape[0], chunk_size):
            z = chunk_logits(h, weight[chunk], inv_tau, dtype)  # [N, c]
            local, inside = _in_chunk(y, chunk)
            target_logit = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), target_logit)
            new_max = torch.maximum(running_max, z.amax(dim=1))
            running_sum = running_sum * (running_max - new_max).exp() + z.sub_(new_max[:, None]).exp_().sum(dim=1)
            running_max = new_max
        logsumexp = running_max + running_sum.log()  # [N]
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.inv_tau, ctx.chunk_size, ctx.recorded = inv_tau, chunk_size, recorded
        return target_logit.view(targets.shape) - logsumexp.view(targets.shape)  # a fresh tensor, not a view

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        dtype = logsumexp.dtype
        g = grad_log_probs.reshape(-1).to(dtype)  # [N]
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        norms = _HeadNorms(*ctx.recorded, hidden, weight.shape[0], ctx.chunk_size) if ctx.recorded else None
        for chunk in _vocab_chunks(weight.shape[0], ctx.chunk_size):
            z = chunk_logits(h, weight[chunk], ctx.inv_tau, dtype)  # [N, c]
            local, inside = _in_chunk(y, chunk)
            # [N, c]: the gradient at the head's output, g (e_y − π) / τ
            c = chunk_logits_grad_(z, logsumexp, g, local, torch.where(inside, g, 0.0), ctx.inv_tau, hidden.dtype)
            if grad_h is not None:
                grad_h += (c @ weight[chunk]).to(dtype)
            if grad_w is not None:
                grad_w[chunk] = c.T @ h
            if norms is not None:
                norms.add(c.view(*targets.shape, -1), chunk)
        if norms is not None:
            norms.book()
        grad_h = grad_h.to(hidden.dtype).view(hidden.shape) if grad_h is not None else None
        return grad_h, grad_w, None, None, None, None


class _HeadNorms:
    """A chunked head call's per-row ``||Σ_t c_t h_tᵀ||²`` and tied embeddings' ``c_t[x_s]``, chunk by chunk."""

    def __init__(self, tape: _Tape, call: _Call, hidden: torch.Tensor, vocab: int, chunk_size: int):
        self.tape, self.call, self.hidden = tape, call, hidden  # hidden [B, T, d]
        rows, positions, width = hidden.shape
        partners = call.partners
        if any(p.kind != "embedding" for p in partners):
            raise ValueError(
                "lm_head: its weight is used by another call than the input embedding's; lm_head_log_probs "
                "supports a head tied to the input embedding only"
            )
        dtype = compute_dtype(hidden)
        self.tied = {id(e): _TiedIds(_ids(e, rows), vocab, chunk_size, positions, dtype) for e in partners}
        self.gram = _use_gram(positions, width, vocab, tape.linear_method)
        self.cc = torch.zeros(rows, positions, positions, dtype=dtype, device=hidden.device) if self.gram else None
        self.norms = torch.zeros(rows, dtype=torch.float64, device=hidden.device)

    def add(self, c: torch.Tensor, chunk: slice) -> None:
        """One chunk's logit gradients ``c`` [B, T, c] (vocabulary rows ``chunk``)."""
        if self.gram:  # Σ_chunks c_s·c_t
            self.cc += batched_matmul(c, c.transpose(1, 2))
        else:  # Σ_chunks ||c_iᵀ h_i||²
            self.norms += _squared_norms(batched_matmul(c.transpose(1, 2), self.hidden))
        for tied in self.tied.values():
            tied.take(c, chunk)

    def book(self) -> None:
        if self.gram:  # Σ_{s,t} (h_s·h_t)(c_s·c_t)
            self.norms = (batched_matmul(self.hidden, self.hidden.transpose(1, 2)) * self.cc).sum(
                dim=(1, 2), dtype=torch.float64
            )
        self.tape.book(self.call, [self.norms], {key: tied.at_ids() for key, tied in self.tied.items()})


class _TiedIds:
    """``c_t[x_s]`` [B, T, S] of an embedding call's ids ``x`` [B, S], filled chunk by chunk: each chunk of the
    vocabulary reads only the (row, slot) pairs whose id lies in it. The ids are sorted once and every chunk's range
    in that order read to the host once, so the chunks together read ``B·S·T`` values (not ``B·T·S`` per chunk)."""

    def __init__(self, ids: torch.Tensor, vocab: int, chunk_size: int, positions: int, dtype: torch.dtype):
        self.rows, self.slots, self.chunk_size = *ids.shape, chunk_size
        self.sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)  # [B·S]
        self.order, self.row_of = order, order // self.slots  # each sorted id's place, and its row
        starts = torch.arange(0, vocab, chunk_size, device=ids.device)
        self.bounds = torch.searchsorted(self.sorted_ids, starts).tolist() + [ids.numel()]  # one host read
        self.found = torch.zeros(ids.numel(), positions, dtype=dtype, device=ids.device)  # [B·S, T]: c_t[x_s]

    def take(self, c: torch.Tensor, chunk: slice) -> None:
        """``c`` [B, T, c]: the logit gradients at vocabulary rows ``chunk`` (a chunk of ``_vocab_chunks``)."""
        k = chunk.start // self.chunk_size
        lo, hi = self.bounds[k], self.bounds[k + 1]
        if hi > lo:
            local = self.sorted_ids[lo:hi] - chunk.start
            self.found[self.order[lo:hi]] = c[self.row_of[lo:hi], :, local].to(self.found.dtype)  # [K, T]

    def at_ids(self) -> torch.Tensor:
        return self.found.view(self.rows, self.slots, -1).transpose(1, 2)  # [B, T, S]


# --------------------------------------------------------------------------- per-call records


@dataclass(eq=False)  # calls are compared by identity
class _Call:
    """One forward call of a supported layer: what its parameters' per-row gradients are made of."""

    module: nn.Module
    kind: str  # "linear" | "embedding" | "norm"
    inputs: torch.Tensor | None  # linear: a [B, T, d_in]; embedding: ids [B, T]; norm: x [B, ...]; None: see below
    output: torch.Tensor | None  # kept where the backward may start (a source); else None
    params: dict[str, torch.Tensor]  # norm layers: parameter values at forward time
    input_needs_grad: bool  # False: a source of the backward (e.g. the token embedding)
    rows: int = 0  # the input's dim 0
    recomputed: bool = False  # inside an activation-checkpointed region: the input comes back with the recomputation
    fingerprint: torch.Tensor | None = None  # of a recomputed call's input: pairs a layer's several such calls
    pending: torch.Tensor | None = None  # g of a recomputed call, arrived before its input
    arrived: bool = False  # the output gradient g has been seen
    grad: torch.Tensor | None = None  # g, kept when a parameter is shared (for the cross terms)
    grad_at_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # tied LM head: c_t[x_s] per embedding call
    partners: list[_Call] = field(default_factory=list)  # the other calls using one of its parameters (set at backward)


@dataclass
class _Shared:
    """A parameter used by several calls: ``||Σ_k G_k||² = Σ_k ||G_k||² + 2 Σ_{k<l} ⟨G_k, G_l⟩``."""

    calls: list[tuple[_Call, str]] = field(default_factory=list)  # (call, "weight" | "bias" | norm param)


class _Tape:
    """Forward hooks that record layer calls; output-gradient hooks that turn them into per-row norms.

    A call keeps its input (what its parameters' gradients are made of), not its output: the gradient hook is set on
    the output at the call, and outputs are kept only where the backward starts (the sources). A call inside a
    non-reentrant activation-checkpointed region keeps nothing but a fingerprint: its ops saved no tensor through the
    tape's own saved-tensor hooks (the checkpoint's hooks took them), so the tape takes its input again when the
    backward recomputes the region (a forward pre-hook), and computes its norms once both input and output gradient
    are there, outside the recomputation. A start of the backward keeps its input: nothing recomputes it for it.
    """

    def __init__(self, model: nn.Module, linear_method: str = "auto"):
        self.layers = _supported_layers(model)
        self.trainable = {module: _trainable(module) for module in self.layers}  # read once, not per call
        self.linear_method = linear_method  # one of LINEAR_METHODS
        self.calls: list[_Call] = []
        self.terms: list[torch.Tensor] = []  # [B] float64 each: every norm and cross term, summed once by finish()
        self.hooks: list = []  # handles of the output-gradient hooks
        self.candidates: list[torch.Tensor] = []  # every output, until a call whose input needs no gradient is seen
        self.has_source = False
        self.packed = 0  # tensors saved for backward through the tape's hooks (i.e. outside checkpointed regions)
        self.packed_at_entry: dict[nn.Module, int] = {}
        self.waiting: dict[nn.Module, list[_Call]] = {}  # recomputed calls whose input has not come back yet
        self.ready: list[_Call] = []  # recomputed calls with input and output gradient, norms not yet computed

    @contextlib.contextmanager
    def recording(self):
        """The forward hooks and the saved-tensor hooks, for the objective's forward only;
        :func:`lm_head_log_probs` finds the tape here."""
        handles = [m.register_forward_pre_hook(self._enter) for m in self.layers]
        handles += [m.register_forward_hook(self._record) for m in self.layers]
        token = _recording.set((*_recording.get(), self))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            _recording.reset(token)
            for h in handles:
                h.remove()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        return t

    def _enter(self, module, args):
        self.packed_at_entry[module] = self.packed

    def _record(self, module, args, output):
        if not torch.is_grad_enabled():  # a call under no_grad puts nothing in the gradient
            return
        kind = self.layers[module]
        if not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"model: {type(module).__name__} must take and return a tensor to be supported")
        if not output.requires_grad:
            raise ValueError(
                f"model: the output of {type(module).__name__} does not require grad although it has trainable "
                "parameters (reentrant activation checkpointing or no_grad inside the model is not supported; "
                "use torch.utils.checkpoint with use_reentrant=False)"
            )
        params = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)} if kind == "norm" else {}
        is_source = kind == "embedding" or not args[0].requires_grad
        x = args[0].detach()
        call = _Call(module, kind, x, output if is_source else None, params, not is_source, rows=x.shape[0])
        checkpointed = self.packed == self.packed_at_entry.pop(module, -1)  # saved nothing through the tape's hooks
        if checkpointed and not is_source:  # a start (an embedding too) keeps its input: nothing recomputes it for it
            call.inputs, call.recomputed, call.fingerprint = None, True, _fingerprint(x)
            self.waiting.setdefault(module, []).append(call)
        self.calls.append(call)
        self.hooks.append(output.register_hook(lambda g: self._add(call, g.detach())))
        if is_source:
            self.has_source = True
            self.candidates.clear()
        elif not self.has_source:
            self.candidates.append(output)

    @contextlib.contextmanager
    def replaying(self):
        """Forward pre-hooks for the backward: a checkpointed region's recomputation gives back its calls' inputs."""
        handles = [m.register_forward_pre_hook(self._replay) for m in self.waiting]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _replay(self, module, args):
        """A layer call during the backward is a recomputation: its input goes to the waiting call it reproduces (the
        only one, or the one whose fingerprint it matches); norms wait until the recomputation is over."""
        waiting = self.waiting.get(module)
        if not waiting:
            return
        x = args[0].detach()
        if len(waiting) == 1:
            call = waiting.pop()
        else:  # one layer, several waiting calls: pair by content (a host read, in this rare case only)
            fingerprint = _fingerprint(x)
            matches = [c for c in waiting if _close(fingerprint, c.fingerprint)]
            if not matches:
                raise ValueError(
                    f"model: a recomputed input of {type(module).__name__} matches none of its checkpointed calls "
                    "(activation checkpointing must recompute what the forward computed)"
                )
            call = matches[-1]
            waiting.remove(call)
        call.inputs = x
        if call.pending is not None:
            self.ready.append(call)

    def _flush(self) -> None:
        """Norms of recomputed calls whose output gradient came first: computed outside the recomputation."""
        while self.ready:
            call = self.ready.pop()
            g, call.pending = call.pending, None
            self._add(call, g)

    def record_chunked_head(self, module: nn.Module, hidden: torch.Tensor) -> tuple[_Call | None, torch.Tensor]:
        """``(call, hidden)`` for :func:`lm_head_log_probs` on ``module``, whose backward books the call's norms;
        ``(None, hidden)`` when the head has no trainable weight. Hidden states that need no gradient become a leaf
        that does, where the backward starts."""
        if module not in self.layers or self.layers[module] != "linear":
            return None, hidden
        is_source = not hidden.requires_grad
        if is_source:
            hidden = hidden.detach().requires_grad_()
            self.has_source = True
            self.candidates.clear()
        call = _Call(
            module, "linear", hidden.detach(), hidden if is_source else None, {}, not is_source, hidden.shape[0]
        )
        self.calls.append(call)
        return call, hidden

    def start_backward(self, rows: int, device: torch.device) -> None:
        for call in self.calls:
            if call.rows != rows:
                raise ValueError(
                    f"model: {type(call.module).__name__} saw {call.rows} rows in dim 0, the objective "
                    f"has {rows}: layers must keep the batch (row) dimension first"
                )
        self.rows, self.device = rows, device
        self.shared = _shared_parameters(self.calls, self.trainable)
        for call in self.calls:
            call.partners = self.partners(call)

    def sources(self) -> list[torch.Tensor]:
        """Outputs of calls whose input needs no gradient: the backward to them passes every layer (else every
        layer output)."""
        return [c.output for c in self.calls if not c.input_needs_grad] or self.candidates

    def detach_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.candidates.clear()

    def partners(self, call: _Call) -> list[_Call]:
        """The other calls that use one of ``call``'s trainable parameters."""
        return [
            c
            for p in self.trainable[call.module].values()
            if id(p) in self.shared
            for c, _ in self.shared[id(p)].calls
            if c is not call
        ]

    def _add(self, call: _Call, g: torch.Tensor) -> None:
        """The output gradient ``g`` of a recorded call: its parameters' norms, and what cross terms need."""
        self._flush()
        if call.inputs is None:  # a recomputed call's input comes back later
            call.pending = g
            return
        partners, own = call.partners, self.trainable[call.module]
        if call.kind == "linear" and partners and all(c.kind == "embedding" for c in partners):
            # A tied LM head keeps c_t[x_s] [B, T, S] for each embedding call, not the [B, T, V] logit gradients.
            c = _rows3(g)
            ids = {id(e): _ids(e, c.shape[0])[:, None, :].expand(-1, c.shape[1], -1) for e in partners}
            at_ids = {k: c.gather(2, i) for k, i in ids.items()}
            self.book(call, _own_norms_sq(call, g, own, self.linear_method).values(), at_ids)
        else:
            call.grad = g if partners else None
            self.book(call, _own_norms_sq(call, g, own, self.linear_method).values(), {})
        if not partners:
            call.inputs = None  # used: let it go

    def book(self, call: _Call, norms_sq, grad_at_ids: dict[int, torch.Tensor]) -> None:
        self.terms.extend(norms_sq)
        call.grad_at_ids.update(grad_at_ids)
        call.arrived = True

    def finish(self) -> torch.Tensor:
        self._flush()
        for call in self.calls:
            if call.pending is not None:
                raise ValueError(
                    f"model: the input of {type(call.module).__name__} was saved through other saved-tensor hooks "
                    "and not recomputed (only non-reentrant activation checkpointing is supported, not e.g. "
                    "save_on_cpu)"
                )
        for shared in self.shared.values():
            pairs = [(a, b) for k, a in enumerate(shared.calls) for b in shared.calls[k + 1 :]]
            for (call_a, name_a), (call_b, name_b) in pairs:
                if call_a.arrived and call_b.arrived:
                    self.terms.append(2 * _cross(call_a, name_a, call_b, name_b))
        self.calls.clear()
        if not self.terms:
            return torch.zeros(self.rows, dtype=torch.float64, device=self.device)
        return torch.stack(self.terms).sum(dim=0)  # one sum: a per-term `total +=` costs a launch per layer call


# --------------------------------------------------------------------------- which layers, which parameters


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or type(module).__name__.endswith("Norm")


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def _supported_layers(model: nn.Module) -> dict[nn.Module, str]:
    """``{module: kind}`` for every module that owns trainable parameters; raise on any other."""
    layers = {}
    for name, module in model.named_modules():
        own = _trainable(module)
        if not own:
            continue
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
            layers[module] = "linear"
        elif isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
            if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
                raise ValueError(f"model: embedding {name!r} uses max_norm, scale_grad_by_freq or sparse: unsupported")
            layers[module] = "embedding"
        elif _is_norm(module):
            layers[module] = "norm"
        else:
            raise ValueError(
                f"model: parameter {name + '.' + next(iter(own))!r} belongs to {type(module).__name__}, which per-row "
                "gradient norms do not support (supported: nn.Linear, nn.Embedding, norm layers)"
            )
    if not layers:
        raise ValueError("model: has no trainable parameters (requires_grad=True)")
    return layers


def _shared_parameters(calls: list[_Call], trainable: dict[nn.Module, dict[str, nn.Parameter]]) -> dict[int, _Shared]:
    """Parameters that more than one call uses, by ``id``."""
    users: dict[int, _Shared] = {}
    for call in calls:
        for name, p in trainable[call.module].items():
            users.setdefault(id(p), _Shared()).calls.append((call, name))
    return {key: shared for key, shared in users.items() if len(shared.calls) > 1}


# --------------------------------------------------------------------------- per-row squared norms


def _own_norms_sq(call: _Call, g: torch.Tensor, own: dict, linear_method: str) -> dict[str, torch.Tensor]:
    """``{parameter name: [B] float64}``: each trainable parameter (``own``, the module's) ``||∇ f_i||²`` from this
    call alone."""
    if call.kind == "linear":
        a = call.inputs.reshape(call.inputs.shape[0], -1, call.inputs.shape[-1])  # [B, T, d_in]
        g = g.reshape(g.shape[0], -1, g.shape[-1])  # [B, T, d_out]
        out = {}
        if "weight" in own:
            out["weight"] = linear_weight_norms_sq(a, g, linear_method)
        if "bias" in own:
            out["bias"] = _squared_norms(g.sum(dim=1, dtype=compute_dtype(g)))
        return out
    if call.kind == "embedding":
        return {"weight": embedding_norms_sq(call.inputs, g, call.module.num_embeddings)}
    grads = _norm_layer_row_grads(call, g, list(own))  # {name: [B, *shape]}
    return {n: _squared_norms(gr) for n, gr in grads.items()}


def batched_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` batched (``[b, n, k] @ [b, k, m]``), the result in the compute dtype (float32, float64 for float64):
    bf16/fp16 inputs are multiplied as they are on CUDA with a float32 result (``out_dtype``, where torch has it),
    elsewhere converted first. Every product of activations and gradients in this module goes through here."""
    dtype = compute_dtype(x)
    if x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda:
        try:
            return torch.bmm(x, y, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return torch.bmm(x.to(dtype), y.to(dtype))


def _squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``Σ x²`` over all but the first dim, accumulated in float64 without a float64 copy of ``x``. [B] float64."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1, dtype=torch.float64).square()


def _row_blocks(rows: int, per_row: int):
    step = max(1, _BLOCK_ELEMENTS // max(per_row, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def linear_weight_norms_sq(a: torch.Tensor, g: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """``||Σ_t g_t a_tᵀ||²`` per row: the Gram form or the materialised gradient, whichever is cheaper.

    a: [B, T, d_in], g: [B, T, d_out]. method: "auto" (default), "gram" or
    "materialize". Returns [B] float64.
    """
    rows, positions, d_in = a.shape
    gram = _use_gram(positions, d_in, g.shape[-1], method)
    blocks = list(_row_blocks(rows, positions * positions if gram else d_in * g.shape[-1]))
    if len(blocks) == 1:
        return _linear_block_norms_sq(a, g, gram)
    out = torch.empty(rows, dtype=torch.float64, device=a.device)
    for r in blocks:
        out[r] = _linear_block_norms_sq(a[r], g[r], gram)
    return out


def _linear_block_norms_sq(a: torch.Tensor, g: torch.Tensor, gram: bool) -> torch.Tensor:
    if gram:  # Σ_{s,t} (a_s · a_t)(g_s · g_t)
        aa = batched_matmul(a, a.transpose(1, 2))  # [b, T, T]
        gg = batched_matmul(g, g.transpose(1, 2))  # [b, T, T]
        return (aa * gg).sum(dim=(1, 2), dtype=torch.float64)
    return _squared_norms(batched_matmul(g.transpose(1, 2), a))  # ||G_i||², G_i = g_iᵀ a_i


def _use_gram(positions: int, d_in: int, d_out: int, method: str) -> bool:
    """Whether a linear weight's norm takes the Gram form: cost ``T² (d_in + d_out)`` against the materialised
    gradient's ``T d_in d_out`` ("auto"), or as ``method`` says."""
    if method not in LINEAR_METHODS:
        raise ValueError(f"method: expected 'auto', 'gram' or 'materialize', got {method!r}")
    cheaper = positions * positions * (d_in + d_out) < positions * d_in * d_out
    return method == "gram" or (method == "auto" and cheaper)


def embedding_norms_sq(ids: torch.Tensor, g: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Σ_v ||Σ_{t: x_t = v} g_t||²`` per row. ids: [B, ...] integer, g: [B, ..., d]. Returns [B] float64."""
    rows = ids.shape[0]
    ids = ids.reshape(rows, -1).long()  # [B, T]
    g = g.reshape(rows, ids.shape[1], -1)  # [B, T, d]
    row_of = torch.arange(rows, device=ids.device)[:, None].expand_as(ids)  # [B, T]
    keys, where = torch.unique((row_of * vocab + ids).flatten(), return_inverse=True)  # [U], [B*T]
    summed = torch.zeros(keys.shape[0], g.shape[-1], dtype=compute_dtype(g), device=g.device)  # [U, d]
    summed.index_add_(0, where, g.reshape(-1, g.shape[-1]).to(summed.dtype))
    out = torch.zeros(rows, dtype=torch.float64, device=g.device)
    return out.index_add_(0, keys // vocab, _squared_norms(summed))


def _norm_layer_row_grads(call: _Call, g: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Per-row gradients of a norm layer's trainable parameters ``[B, *shape]`` each.

    Fast path, for layers of the form ``out = w ⊙ n(x) + b`` (LayerNorm, RMSNorm): ``n = layer(x; w=1, b=0)``
    in one batched call, ``∇_w f_i = Σ_t g_t ⊙ n_t`` and ``∇_b f_i = Σ_t g_t``. The form is verified against
    the recorded output; any other layer (e.g. ``(1 + w) ⊙ n``) takes a vmapped vector-Jacobian product.
    """
    if set(call.params) <= {"weight", "bias"} and "weight" in call.params:
        normalized = _affine_norm_input(call, verify=type(call.module) not in _AFFINE_NORM_CLASSES)  # or None
        if normalized is not None:
            dtype = compute_dtype(g)
            out = {}
            if "weight" in names:
                out["weight"] = (g.to(dtype) * normalized.to(dtype)).flatten(1, -2).sum(dim=1)
            if "bias" in names:
                out["bias"] = g.flatten(1, -2).sum(dim=1, dtype=dtype)
            return out
    return _norm_layer_row_grads_vjp(call, g, names)


def _affine_norm_input(call: _Call, verify: bool) -> torch.Tensor | None:
    """``n(x)`` (the layer at ``w = 1, b = 0``) if the layer computes ``w ⊙ n(x) + b``, else None.

    The form is verified on the first call of each layer class (``verify``) and the answer remembered for the
    class: the layer at a probe weight ``w_p`` (``0.5 … 1.5`` along the last dim, ``b = 0``) must equal
    ``w_p ⊙ n(x)``, and ``w ⊙ n(x) + b`` the recorded output. The probe matters: a weight of ones (a norm at
    init) cannot tell ``w ⊙ n`` from e.g. ``(1 + w) ⊙ n / 2``.
    """
    w = call.params["weight"]
    if w.dim() != 1 or w.shape != call.inputs.shape[-1:] or not _AFFINE_NORM_CLASSES.get(type(call.module), verify):
        return None
    unit = {"weight": torch.ones_like(w)}
    if "bias" in call.params:
        unit["bias"] = torch.zeros_like(call.params["bias"])
    with torch.no_grad():
        normalized = functional_call(call.module, unit, (call.inputs,))
        if verify:
            probe = torch.linspace(0.5, 1.5, w.shape[0], dtype=w.dtype, device=w.device)
            probed = functional_call(call.module, {**unit, "weight": probe}, (call.inputs,))
            rebuilt = normalized * w + (call.params["bias"] if "bias" in call.params else 0)
            recorded = functional_call(call.module, call.params, (call.inputs,))  # the layer as it was called
            affine = _close(probed, normalized * probe) and _close(rebuilt, recorded)
            _AFFINE_NORM_CLASSES[type(call.module)] = affine
            if not affine:
                return None
    return normalized


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``max |got − want| ≤ tol × max |want|``, tol by dtype: 1e-10 (float64), 1e-5 (float32), 2e-2 (else)."""
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-5}.get(want.dtype, 2e-2)
    return bool((got - want).abs().amax() <= tolerance * want.abs().amax().clamp_min(1e-30))


def _norm_layer_row_grads_vjp(call: _Call, g: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Per-row gradients of a norm layer's trainable parameters by a vmapped vector-Jacobian product."""
    frozen = {n: p for n, p in call.params.items() if n not in names}

    def row_grad(params, x_row, g_row):
        def layer(p):
            return functional_call(call.module, {**p, **frozen}, (x_row[None],))

        out, pullback = vjp(layer, params)
        return pullback(g_row[None].to(out.dtype))[0]

    params = {n: call.params[n] for n in names}
    return vmap(row_grad, in_dims=(None, 0, 0))(params, call.inputs, g)


def _cross(call_a: _Call, name_a: str, call_b: _Call, name_b: str) -> torch.Tensor:
    """``⟨G_a, G_b⟩`` per row for two calls' gradients of one shared parameter. Returns [B] float64."""
    kinds = {call_a.kind, call_b.kind}
    if kinds == {"linear"} and name_a == name_b == "weight":  # Σ_{s,t} (a_s·a'_t)(g_s·g'_t)
        a, g = _rows3(call_a.inputs), _rows3(call_a.grad)
        a2, g2 = _rows3(call_b.inputs), _rows3(call_b.grad)
        return (batched_matmul(a, a2.transpose(1, 2)) * batched_matmul(g, g2.transpose(1, 2))).sum(
            dim=(1, 2), dtype=torch.float64
        )
    if kinds == {"linear", "embedding"}:  # Σ_{s,t} c_t[x_s] (g_s · h_t)
        linear, embedding = (call_a, call_b) if call_a.kind == "linear" else (call_b, call_a)
        h, g = _rows3(linear.inputs), _rows3(embedding.grad)  # [B, T, d], [B, S, d]
        c_at_ids = linear.grad_at_ids[id(embedding)]  # [B, T, S]: c_t[x_s]
        return (batched_matmul(h, g.transpose(1, 2)).to(torch.float64) * c_at_ids.to(torch.float64)).sum(dim=(1, 2))
    if kinds == {"embedding"}:  # Σ_v ⟨Σ_{x_s = v} g_s, Σ_{x'_t = v} g'_t⟩
        ids_a, ids_b = call_a.inputs.reshape(call_a.grad.shape[0], -1), call_b.inputs.reshape(call_b.grad.shape[0], -1)
        same = (ids_a[:, :, None] == ids_b[:, None, :]).to(torch.float64)  # [B, S, S']
        return (batched_matmul(_rows3(call_a.grad), _rows3(call_b.grad).transpose(1, 2)).double() * same).sum(
            dim=(1, 2)
        )
    raise ValueError(
        f"model: a parameter is shared by {type(call_a.module).__name__}.{name_a} and "
        f"{type(call_b.module).__name__}.{name_b}; per-row norms support sharing between Linear and Embedding weights"
    )


def _rows3(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """``[B, 10]`` per row (float32, float64 for float64): the first 8 values, the sum and the norm; tells which of
    a layer's checkpointed calls a recomputed input belongs to. Made of reductions and slices, no matrix product: a
    selective checkpointing policy that saves matrix products (the usual one) would otherwise cache this product too
    and hand its output to the layers' own products in the recomputation (its cache is read back by position)."""
    rows, dtype = x.reshape(x.shape[0], -1), compute_dtype(x)
    summary = [rows.sum(dim=1, dtype=dtype), torch.linalg.vector_norm(rows, dim=1, dtype=dtype)]
    return torch.cat([rows[:, :8].to(dtype), torch.stack(summary, dim=1)], dim=1)


def _ids(embedding: _Call, rows: int) -> torch.Tensor:
    """An embedding call's ids as ``[B, S]`` int64."""
    return embedding.inputs.reshape(rows, -1).long()


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Dropout off for the call; each module's own ``training`` flag restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``.logits``, or the first item of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"model: output of type {type(output).__name__} holds no logits")


def accepts_keyword(model: nn.Module, keyword: str) -> bool:
    """Whether ``model.forward`` takes ``keyword`` (False when its signature cannot be read)."""
    try:
        return keyword in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _describe(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _check_inputs(input_ids, response_mask, attention_mask) -> torch.Tensor:
    require_tensor("input_ids", input_ids)
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected integer ids [B, L], got {input_ids.dtype} {tuple(input_ids.shape)}")
    return lm_batch_masks(input_ids, response_mask, attention_mask)[0]
