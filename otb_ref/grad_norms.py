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

Assumptions, checked where possible: rows do not interact (true of causal LMs with attention masks);
every trainable parameter belongs directly to an ``nn.Linear``, an ``nn.Embedding`` or a norm layer (any
other parameterised module raises); layer activations keep the row dimension first (``[B, ..., d]``).
The result is exact, not an estimate: it equals ``otb_ref.exact.sequence_grad_norms_sq_fp64`` (which takes a
gradient per row with ``torch.func``) to rounding.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from otb_ref._checks import lm_batch_masks, positive_scalar, require_tensor

__all__ = ["row_grad_norms_sq", "sequence_grad_norms_sq"]

# Elements of the largest temporary (per-row gradients or Gram matrices) per block of rows.
_BLOCK_ELEMENTS = 1 << 27
# Norm-layer classes checked to compute ``w ⊙ n(x) + b`` (True) or not (False): checked once per class, because
# the check reads a value on the host, and a host sync per layer inside the backward stalls an accelerator.
_AFFINE_NORM_CLASSES: dict[type, bool] = {}
# How linear layers' weight norms are computed: "auto" (the cheaper form per call), "gram" or "materialize".
LINEAR_METHOD = "auto"


def sequence_grad_norms_sq(
    model: nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
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

    Returns:
        ``[B]`` float32 (accumulated in float64), ``>= 0``; 0 for an empty response.
    """
    mask = _check_inputs(input_ids, response_mask, attention_mask)
    tau = positive_scalar("temperature", temperature)
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    if accepts_keyword(model, "use_cache"):
        kwargs["use_cache"] = False

    def response_log_likelihood() -> torch.Tensor:  # [B]
        logits = logits_of(model(input_ids, **kwargs))  # [B, L, V]
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        z = logits[:, :-1].to(dtype) / tau  # [B, L-1, V]: position t - 1 predicts token t
        targets = input_ids[:, 1:].long()  # [B, L-1]
        log_probs = z.gather(-1, targets[..., None]).squeeze(-1) - z.logsumexp(dim=-1)  # [B, L-1]
        return (log_probs * mask[:, 1:].to(dtype)).sum(dim=1)  # [B]

    with _eval_mode(model):
        return row_grad_norms_sq(model, response_log_likelihood)


def row_grad_norms_sq(model: nn.Module, objective: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``||∇_θ f_i||²`` for each row ``i`` of ``f = objective()``, in one forward + backward.

    Args:
        model: the module whose trainable parameters θ are differentiated. Every trainable parameter
            must belong directly to an ``nn.Linear``, ``nn.Embedding`` or norm layer (else ValueError).
        objective: runs the forward of ``model`` on a batch of B rows and returns ``f``, ``[B]``, where
            ``f_i`` depends on row i's inputs only. Called once, with autograd on. The backward starts at the
            outputs of the layer calls whose input needs no gradient (embeddings, layers on frozen features), or
            at every layer output when there is none: inputs that require grad must not be mixed with such calls.

    Returns:
        ``[B]`` float32 (accumulated in float64). The parameters' ``.grad`` fields are not touched.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    tape = _Tape(model)
    with torch.inference_mode(False), torch.enable_grad(), tape.recording():
        f = objective()
    if not isinstance(f, torch.Tensor) or f.dim() != 1:
        raise ValueError(f"objective: expected a [B] tensor of per-row values, got {_describe(f)}")
    tape.start_backward(rows=f.shape[0], device=f.device)
    with torch.inference_mode(False), torch.enable_grad(), tape.attached():
        sources = tape.sources()
        if sources and f.requires_grad:
            torch.autograd.grad(f.sum(), sources, allow_unused=True)
    return tape.finish().float()


# --------------------------------------------------------------------------- per-call records


@dataclass
class _Call:
    """One forward call of a supported layer: what its parameters' per-row gradients are made of."""

    module: nn.Module
    kind: str  # "linear" | "embedding" | "norm"
    inputs: torch.Tensor  # linear: a [B, T, d_in]; embedding: ids [B, T]; norm: x [B, ...]
    output: torch.Tensor
    params: dict[str, torch.Tensor]  # norm layers: parameter values at forward time
    input_needs_grad: bool  # False: a source of the backward (e.g. the token embedding)
    arrived: bool = False  # the output gradient g has been seen
    grad: torch.Tensor | None = None  # g, kept when a parameter is shared (for the cross terms)
    grad_at_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # tied LM head: c_t[x_s] per embedding call


@dataclass
class _Shared:
    """A parameter used by several calls: ``||Σ_k G_k||² = Σ_k ||G_k||² + 2 Σ_{k<l} ⟨G_k, G_l⟩``."""

    calls: list[tuple[_Call, str]] = field(default_factory=list)  # (call, "weight" | "bias" | norm param)


class _Tape:
    """Forward hooks that record layer calls; output-gradient hooks that turn them into per-row norms."""

    def __init__(self, model: nn.Module):
        self.layers = _supported_layers(model)
        self.calls: list[_Call] = []
        self.total: torch.Tensor | None = None

    @contextlib.contextmanager
    def recording(self):
        """The forward hooks, for the objective's forward only (none is left during the backward, where norm layers
        are recomputed)."""
        handles = [m.register_forward_hook(self._record) for m in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

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
        needs_grad = kind != "embedding" and args[0].requires_grad
        self.calls.append(_Call(module, kind, args[0].detach(), output, params, needs_grad))

    def start_backward(self, rows: int, device: torch.device) -> None:
        for call in self.calls:
            if call.inputs.shape[0] != rows:
                raise ValueError(
                    f"model: {type(call.module).__name__} saw {call.inputs.shape[0]} rows in dim 0, the objective "
                    f"has {rows}: layers must keep the batch (row) dimension first"
                )
        self.total = torch.zeros(rows, dtype=torch.float64, device=device)
        self.shared = _shared_parameters(self.calls)

    @contextlib.contextmanager
    def attached(self):
        handles = [call.output.register_hook(self._hook(call)) for call in self.calls]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def sources(self) -> list[torch.Tensor]:
        """Outputs of calls whose input needs no gradient: the backward to them passes every layer."""
        found = [c.output for c in self.calls if not c.input_needs_grad]
        return found or [c.output for c in self.calls]

    def _hook(self, call: _Call):
        def on_grad(g: torch.Tensor) -> None:
            self._add(call, g.detach())

        return on_grad

    def _add(self, call: _Call, g: torch.Tensor) -> None:
        for norm_sq in _own_norms_sq(call, g).values():
            self.total += norm_sq
        call.arrived = True
        partners = [
            c
            for p in _trainable(call.module).values()
            if id(p) in self.shared
            for c, _ in self.shared[id(p)].calls
            if c is not call
        ]
        if call.kind == "linear" and partners and all(c.kind == "embedding" for c in partners):
            # A tied LM head keeps c_t[x_s] [B, T, S] for each embedding call, not the [B, T, V] logit gradients.
            c = _rows3(g)
            for embedding in partners:
                ids = embedding.inputs.reshape(c.shape[0], -1).long()  # [B, S]
                call.grad_at_ids[id(embedding)] = c.gather(2, ids[:, None, :].expand(-1, c.shape[1], -1))
        elif partners:
            call.grad = g

    def finish(self) -> torch.Tensor:
        for shared in self.shared.values():
            pairs = [(a, b) for k, a in enumerate(shared.calls) for b in shared.calls[k + 1 :]]
            for (call_a, name_a), (call_b, name_b) in pairs:
                if call_a.arrived and call_b.arrived:
                    self.total += 2 * _cross(call_a, name_a, call_b, name_b)
        self.calls.clear()
        return self.total


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


def _shared_parameters(calls: list[_Call]) -> dict[int, _Shared]:
    """Parameters that more than one call uses, by ``id``."""
    users: dict[int, _Shared] = {}
    for call in calls:
        for name, p in _trainable(call.module).items():
            users.setdefault(id(p), _Shared()).calls.append((call, name))
    return {key: shared for key, shared in users.items() if len(shared.calls) > 1}


# --------------------------------------------------------------------------- per-row squared norms


def _own_norms_sq(call: _Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{parameter name: [B] float64}``: each trainable parameter's ``||∇ f_i||²`` from this call alone."""
    own = _trainable(call.module)
    if call.kind == "linear":
        a = call.inputs.reshape(call.inputs.shape[0], -1, call.inputs.shape[-1])  # [B, T, d_in]
        g = g.reshape(g.shape[0], -1, g.shape[-1])  # [B, T, d_out]
        out = {}
        if "weight" in own:
            out["weight"] = linear_weight_norms_sq(a, g)
        if "bias" in own:
            out["bias"] = _squared_norms(g.sum(dim=1, dtype=_accumulate_dtype(g)))
        return out
    if call.kind == "embedding":
        return {"weight": embedding_norms_sq(call.inputs, g, call.module.num_embeddings)}
    grads = _norm_layer_row_grads(call, g)  # {name: [B, *shape]}
    return {n: _squared_norms(gr) for n, gr in grads.items()}


def _accumulate_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` batched, result in float32 (float64 for float64) with bf16/fp16 inputs kept as they are on CUDA."""
    dtype = _accumulate_dtype(x)
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


def linear_weight_norms_sq(a: torch.Tensor, g: torch.Tensor, method: str | None = None) -> torch.Tensor:
    """``||Σ_t g_t a_tᵀ||²`` per row: the Gram form or the materialised gradient, whichever is cheaper.

    a: [B, T, d_in], g: [B, T, d_out]. method: "auto" (default: ``LINEAR_METHOD``), "gram" or
    "materialize". Returns [B] float64.
    """
    rows, positions, d_in = a.shape
    d_out = g.shape[-1]
    method = method or LINEAR_METHOD
    if method not in ("auto", "gram", "materialize"):
        raise ValueError(f"method: expected 'auto', 'gram' or 'materialize', got {method!r}")
    cheaper = positions * positions * (d_in + d_out) < positions * d_in * d_out
    gram = method == "gram" or (method == "auto" and cheaper)
    out = torch.empty(rows, dtype=torch.float64, device=a.device)
    per_row = positions * positions if gram else d_in * d_out
    for r in _row_blocks(rows, per_row):
        if gram:  # Σ_{s,t} (a_s · a_t)(g_s · g_t)
            aa = _bmm(a[r], a[r].transpose(1, 2))  # [b, T, T]
            gg = _bmm(g[r], g[r].transpose(1, 2))  # [b, T, T]
            out[r] = (aa * gg).sum(dim=(1, 2), dtype=torch.float64)
        else:  # ||G_i||², G_i = g_iᵀ a_i
            out[r] = _squared_norms(_bmm(g[r].transpose(1, 2), a[r]))
    return out


def embedding_norms_sq(ids: torch.Tensor, g: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Σ_v ||Σ_{t: x_t = v} g_t||²`` per row. ids: [B, ...] integer, g: [B, ..., d]. Returns [B] float64."""
    rows = ids.shape[0]
    ids = ids.reshape(rows, -1).long()  # [B, T]
    g = g.reshape(rows, ids.shape[1], -1)  # [B, T, d]
    row_of = torch.arange(rows, device=ids.device)[:, None].expand_as(ids)  # [B, T]
    keys, where = torch.unique((row_of * vocab + ids).flatten(), return_inverse=True)  # [U], [B*T]
    summed = torch.zeros(keys.shape[0], g.shape[-1], dtype=_accumulate_dtype(g), device=g.device)  # [U, d]
    summed.index_add_(0, where, g.reshape(-1, g.shape[-1]).to(summed.dtype))
    out = torch.zeros(rows, dtype=torch.float64, device=g.device)
    return out.index_add_(0, keys // vocab, _squared_norms(summed))


def _norm_layer_row_grads(call: _Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row gradients of a norm layer's trainable parameters ``[B, *shape]`` each.

    Fast path, for layers of the form ``out = w ⊙ n(x) + b`` (LayerNorm, RMSNorm): ``n = layer(x; w=1, b=0)``
    in one batched call, ``∇_w f_i = Σ_t g_t ⊙ n_t`` and ``∇_b f_i = Σ_t g_t``. The form is verified against
    the recorded output; any other layer (e.g. ``(1 + w) ⊙ n``) takes a vmapped vector-Jacobian product.
    """
    names = list(_trainable(call.module))
    if set(call.params) <= {"weight", "bias"} and "weight" in call.params:
        normalized = _affine_norm_input(call, verify=type(call.module) not in _AFFINE_NORM_CLASSES)  # or None
        if normalized is not None:
            dtype = _accumulate_dtype(g)
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
    if w.dim() != 1 or w.shape != call.output.shape[-1:] or not _AFFINE_NORM_CLASSES.get(type(call.module), verify):
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
            affine = _close(probed, normalized * probe) and _close(rebuilt, call.output.detach())
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
        return (_bmm(a, a2.transpose(1, 2)) * _bmm(g, g2.transpose(1, 2))).sum(dim=(1, 2), dtype=torch.float64)
    if kinds == {"linear", "embedding"}:  # Σ_{s,t} c_t[x_s] (g_s · h_t)
        linear, embedding = (call_a, call_b) if call_a.kind == "linear" else (call_b, call_a)
        h, g = _rows3(linear.inputs), _rows3(embedding.grad)  # [B, T, d], [B, S, d]
        c_at_ids = linear.grad_at_ids[id(embedding)]  # [B, T, S]: c_t[x_s]
        return (_bmm(h, g.transpose(1, 2)).to(torch.float64) * c_at_ids.to(torch.float64)).sum(dim=(1, 2))
    if kinds == {"embedding"}:  # Σ_v ⟨Σ_{x_s = v} g_s, Σ_{x'_t = v} g'_t⟩
        ids_a, ids_b = call_a.inputs.reshape(call_a.grad.shape[0], -1), call_b.inputs.reshape(call_b.grad.shape[0], -1)
        same = (ids_a[:, :, None] == ids_b[:, None, :]).to(torch.float64)  # [B, S, S']
        return (_bmm(_rows3(call_a.grad), _rows3(call_b.grad).transpose(1, 2)).double() * same).sum(dim=(1, 2))
    raise ValueError(
        f"model: a parameter is shared by {type(call_a.module).__name__}.{name_a} and "
        f"{type(call_b.module).__name__}.{name_b}; per-row norms support sharing between Linear and Embedding weights"
    )


def _rows3(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


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
