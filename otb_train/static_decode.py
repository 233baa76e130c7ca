"""Decoding with a static KV cache, optionally replayed as CUDA graphs, for Llama-family models.

:class:`StaticKVDecoder` is a ``ForwardFn`` for :func:`otb_train.rollout.generate`:

* **Prefill** goes through the caller's own forward (under FSDP2 that call
  also gathers the parameters, which ``parallel.gathered_for_generation``
  keeps gathered). Its KV cache is copied into preallocated
  ``[B, H_kv, P + T_max, D]`` buffers, one pair per layer.
* **Each new token** runs a decode step written here over the model's own
  submodules (embedding, norms, projections, MLP, rotary embedding, LM-head
  weight): the new key and value are written in place at one index, and the
  attention reads the cache up to a length rounded up to one of ``buckets``
  sizes. Nothing is concatenated or reallocated, no mask is rebuilt, no host
  value is read, and there are no FSDP hooks, so on CUDA each bucket's step is
  captured once as a CUDA graph and then replayed: one launch per token.

The maths is the model's: the same modules, the same rotary function (taken
from the model's own modeling file), and softmax attention in fp32 over the
valid cache slots (:func:`decode_attention`: a Triton kernel on CUDA that
reads each KV head once for its whole query group, else
``scaled_dot_product_attention`` with the group packed as queries). Masked
slots and slots past the current length get probability exactly 0.
Supported: ``model_type`` in :data:`SUPPORTED` with full attention in every
layer (:func:`static_decode_unsupported` says why not otherwise; callers fall
back to the model's own forward).

train.py uses it by default on CUDA (``--static-decode`` / ``--no-static-decode``). Inside train.py on one H200
(``benchmarks/gpu_train_step.py``, float64 sampling): 39.0k tokens/s at the shape below. Measured on one H100 (torch
2.11, bf16, FSDP2 one rank; ``benchmarks/gpu_train_paths.py``, float32 sampling): the
trainer's built-in model at width 1024 x 16 layers, 512 rows x 512 new tokens after prompts of up to
512 tokens, generates 38.9k tokens/s with CUDA graphs (25.4k eager) against 4.1k for the model's own
forward with a check after every token; the attention kernel is 77% of a decode step's GPU time.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SUPPORTED", "StaticKVDecoder", "decode_attention", "static_decode_unsupported"]

SUPPORTED = ("qwen2", "llama", "qwen3")


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside an activation-checkpointing wrapper (or the module itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def static_decode_unsupported(lm: nn.Module) -> str | None:
    """Why :class:`StaticKVDecoder` cannot run ``lm`` (a Hugging Face causal LM), or None if it can."""
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        return f"model_type {model_type!r} is not one of {SUPPORTED}"
    decoder = lm.get_decoder()
    missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(decoder, name)]
    if missing:
        return f"the decoder has no {', '.join(missing)}"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "a layer without full attention"
    attn = _unwrap(decoder.layers[0]).self_attn
    if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
        return "an attention module without q/k/v/o projections"
    if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb"):
        return "no apply_rotary_pos_emb in the modeling file"
    return None


def _prefill_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, H_kv, P, D]`` of ``layer`` in a Hugging Face cache (transformers 4.x or 5.x)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


_TRITON_KERNEL: Any = None  # built on first use; False when Triton is unavailable


def _triton_decode_attention():
    """The Triton kernel of :func:`decode_attention` (None without Triton)."""
    global _TRITON_KERNEL
    if _TRITON_KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _TRITON_KERNEL = False
            return None

        @triton.jit
        def kernel(
            q_ptr,
            k_ptr,
            v_ptr,
            valid_ptr,
            out_ptr,
            scale,
            span,
            sq_b,
            sq_h,
            sq_g,
            sk_b,
            sk_h,
            sk_l,
            sv_b,
            sv_h,
            sv_l,
            sm_b,
            so_b,
            so_h,
            so_g,
            GROUP: tl.constexpr,
            GROUP_P: tl.constexpr,
            DIM: tl.constexpr,
            DIM_P: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            # One program per (row, KV head): its GROUP queries against slots [0, span), online softmax in fp32.
            b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
            g, d = tl.arange(0, GROUP_P), tl.arange(0, DIM_P)
            q_mask = (g[:, None] < GROUP) & (d[None, :] < DIM)
            q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=q_mask, other=0.0)
            q = q.to(tl.float32) * scale
            m = tl.full([GROUP_P], -1e30, tl.float32)  # finite: a fully masked prefix is wiped by alpha = 0 later
            total = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
            for start in range(0, span, BLOCK):
                n = start + tl.arange(0, BLOCK)
                inside = n < span
                valid = tl.load(valid_ptr + b * sm_b + n, mask=inside, other=0) != 0
                kv_mask = inside[:, None] & (d[None, :] < DIM)
                k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_l + d[None, :], mask=kv_mask, other=0.0)
                scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [GROUP_P, BLOCK]
                scores = tl.where(valid[None, :], scores, -1e30)
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(scores - m_new[:, None])
                v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_l + d[None, :], mask=kv_mask, other=0.0)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
                total = total * alpha + tl.sum(p, axis=1)
                m = m_new
            out = (acc / total[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out, mask=q_mask)

        _TRITON_KERNEL = kernel
    return _TRITON_KERNEL or None


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    span: int,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of one new token per row over cache slots ``[0, span)``, grouped-query.

    Args:
        query: ``[B, H_kv, G, D]``, the ``G`` query heads that share each KV head.
        keys, values: ``[B, H_kv, capacity, D]`` static cache (only ``[:, :, :span]`` is read).
        valid: ``[B, capacity]`` bool, the slots a row attends to (at least one in ``[0, span)``).
        span, scale: slots read; softmax scale.
        backend: ``"sdpa"`` (``scaled_dot_product_attention`` with a boolean mask), ``"triton"`` (one
            program per row and KV head, fp32 scores and online softmax, no mask tensor), or ``"auto"``
            (Triton on CUDA when installed, else SDPA).

    Returns:
        ``[B, H_kv, G, D]`` in ``query``'s dtype. Both backends compute softmax in fp32; they differ by
        rounding (summation order), never by which slots count.
    """
    use_triton = backend == "triton" or (backend == "auto" and query.is_cuda)
    kernel = _triton_decode_attention() if use_triton else None
    if backend == "triton" and kernel is None:
        raise RuntimeError("decode_attention: the triton backend needs the triton package")
    if kernel is None:
        mask = valid[:, None, None, :span]  # [B, 1, 1, span]
        keys, values = keys[:, :, :span], values[:, :, :span]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    query = query.contiguous()
    batch, kv_heads, group, dim = query.shape
    out = torch.empty_like(query)
    group_p, dim_p = max(2, 1 << (group - 1).bit_length()), max(16, 1 << (dim - 1).bit_length())
    # H100, [512, 32, 2, 16] x 1024 slots: one warp and 32 slots a step stream 1.5 TB/s (4 warps, 128 slots: 1.3).
    small = group_p * dim_p <= 64
    block, warps = (32, 1) if small else (max(16, min(128, 4096 // (group_p * dim_p))), 4)
    valid = valid.view(torch.uint8)
    kernel[(batch, kv_heads)](
        query,
        keys,
        values,
        valid,
        out,
        scale,
        span,
        *query.stride()[:3],
        *keys.stride()[:3],
        *values.stride()[:3],
        valid.stride(0),
        *out.stride()[:3],
        GROUP=group,
        GROUP_P=group_p,
        DIM=dim,
        DIM_P=dim_p,
        BLOCK=block,
        num_warps=warps,
    )
    return out


class StaticKVDecoder:
    """``forward(input_ids, attention_mask, position_ids, cache) -> (logits [B, V] fp32, cache)`` for ``generate``.

    Args:
        prefill: the model's own ``ForwardFn`` (e.g. ``otb_train.model.Policy``); called
            once, for the prompt, and must return a Hugging Face cache.
        lm: the Hugging Face causal LM inside ``prefill`` (``Policy.lm``). Its
            parameters are looked up after the prefill, so FSDP2's gathered
            parameters are the ones used.
        max_new_tokens: ``T_max`` of the ``generate`` call.
        cuda_graphs: capture and replay the decode step (default: on CUDA only).
        buckets: the attention reads the cache up to the next multiple of
            ``ceil((P + T_max) / buckets)`` positions; one graph per size used.
        attention: the backend of :func:`decode_attention`.

    The returned logits of a decode step are a buffer that the next step
    overwrites (``generate`` samples from it before calling again). Every
    generated position is attended, as in ``generate``; the ``attention_mask``
    of decode calls is not read. Build one decoder per ``generate`` call.
    """

    def __init__(
        self,
        prefill: Callable,
        lm: nn.Module,
        max_new_tokens: int,
        *,
        cuda_graphs: bool | None = None,
        buckets: int = 8,
        attention: str = "auto",
    ):
        reason = static_decode_unsupported(lm)
        if reason is not None:
            raise ValueError(f"lm: static decoding does not support this model: {reason}")
        self.prefill, self.lm, self.max_new_tokens = prefill, lm, max_new_tokens
        self.cuda_graphs, self.buckets, self.attention_backend = cuda_graphs, max(1, buckets), attention
        decoder = lm.get_decoder()
        self.layers = [_unwrap(layer) for layer in decoder.layers]
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.apply_rotary = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, input_ids, attention_mask, position_ids, cache):
        if cache is None:
            return self._start(input_ids, attention_mask, position_ids)
        if cache is not self:
            raise ValueError("cache: expected the decoder returned by the previous call")
        return self._decode(input_ids, position_ids), self

    @torch.no_grad()
    def _start(self, input_ids, attention_mask, position_ids):
        """Prefill through the model's forward; copy its cache into static buffers."""
        logits, cache = self.prefill(input_ids, attention_mask, position_ids, None)
        batch, prompt_len = input_ids.shape
        self.capacity = prompt_len + self.max_new_tokens
        self.keys, self.values = [], []
        for layer in range(len(self.layers)):
            for store, source in zip((self.keys, self.values), _prefill_kv(cache, layer)):
                buffer = source.new_zeros(*source.shape[:2], self.capacity, source.shape[-1])
                buffer[:, :, :prompt_len] = source
                store.append(buffer)
        device = input_ids.device
        self.kv_valid = torch.zeros(batch, self.capacity, dtype=torch.bool, device=device)
        self.kv_valid[:, :prompt_len] = attention_mask.bool()
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.length = prompt_len  # cache slots written so far
        if self.cuda_graphs is None:
            self.cuda_graphs = device.type == "cuda"
        self._check_parameters()
        return logits, self

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current batch, in that order) of every buffer: the rows the
        caller still decodes. The graphs captured for the old batch size are dropped with their memory pool; each
        span is captured again, once, for the new batch."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.kv_valid = self.kv_valid.index_select(0, rows)
        self.token, self.position = self.token.index_select(0, rows), self.position.index_select(0, rows)
        self.graphs, self.pool = {}, None

    def _check_parameters(self) -> None:
        """The decode step needs whole (gathered) parameters, not FSDP shards."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch built without distributed
            return
        if any(isinstance(p, DTensor) for p in self.lm.parameters()):
            raise RuntimeError(
                "StaticKVDecoder: the parameters are sharded DTensors; decode inside "
                "parallel.gathered_for_generation (the prefill gathers them)"
            )

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Write the inputs into the static buffers and run (or replay) the step for the current bucket."""
        if self.length >= self.capacity:
            raise RuntimeError(f"StaticKVDecoder: more than max_new_tokens={self.max_new_tokens} decode calls")
        self.token.copy_(input_ids)
        self.position.copy_(position_ids)
        self.index.fill_(self.length)
        self.kv_valid[:, self.length] = True
        width = math.ceil(self.capacity / self.buckets)
        span = min(self.capacity, math.ceil((self.length + 1) / width) * width)
        self.length += 1
        if not self.cuda_graphs:
            return self._step(span)
        if span not in self.graphs:
            self.graphs[span] = self._capture(span)
        graph, logits = self.graphs[span]
        graph.replay()
        return logits

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (the step is idempotent: it rewrites the same cache slot), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(span)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(span)
        return graph, logits

    @torch.no_grad()
    def _step(self, span: int) -> torch.Tensor:
        """One token for every row: the decoder layers as in the model, attention over cache slots ``< span``."""
        hidden = self.embed(self.token)  # [B, 1, d]
        cos, sin = self.rotary(hidden, self.position)
        for i, layer in enumerate(self.layers):
            attention = self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, i, span)
            hidden = hidden + attention
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.norm(hidden)[:, -1]  # [B, d]
        return (hidden @ self.lm.get_output_embeddings().weight.T).float()

    def _attention(self, attn: nn.Module, x, cos, sin, layer: int, span: int) -> torch.Tensor:
        """The model's attention for one new token, with this layer's static cache."""
        batch, head_dim = x.shape[0], attn.head_dim
        query = attn.q_proj(x).view(batch, 1, -1, head_dim)
        key = attn.k_proj(x).view(batch, 1, -1, head_dim)
        value = attn.v_proj(x).view(batch, 1, -1, head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before the rotation
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key = self.apply_rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)  # [B, H, 1, D]
        self.keys[layer].index_copy_(2, self.index, key)
        self.values[layer].index_copy_(2, self.index, value)
        kv_heads = key.shape[1]
        query = query.reshape(batch, kv_heads, -1, head_dim)  # query head h uses KV head h // (H / H_kv)
        scale = getattr(attn, "scaling", head_dim**-0.5)
        out = decode_attention(
            query, self.keys[layer], self.values[layer], self.kv_valid, span, scale, self.attention_backend
        )  # [B, H_kv, H / H_kv, D]
        return attn.o_proj(out.reshape(batch, 1, -1))
