"""Σπ² from verl's fused LM-head path (``actor_rollout_ref.model.use_fused_kernels=true``; verl 0.9.1).

verl's fused forward computes the log-probs and entropy chunk by chunk from the last hidden states and the LM-head
weight, so no ``[T, V]`` logits exist; its FSDP engine therefore refuses ``calculate_sum_pi_squared`` there.
:func:`install` adds Σπ² to that same chunk loop (one LM-head matmul per chunk: ``log π(y)``, the entropy and
``Σ_v π_v²`` all come from one ``softmax`` of it) by wrapping four functions of verl, and a fifth for the
non-fused path:

1. ``dense_common.forward_with_torch_backend`` (the forward verl's monkey patch gives text models for the torch and
   liger backends): with the keyword ``otb_ref_sum_pi_squared=True`` it runs the model with Σπ² requested and
   returns ``sum_pi_squared`` in its output, beside ``log_probs`` and ``entropy``;
2. ``FusedLinearForPPO.forward``: while Σπ² is requested, :func:`chunk_statistics` replaces verl's chunk loop
   (the same operations for the log-probs and entropy, so the same numbers, plus Σπ²);
3. ``FSDPEngineWithLMHead.prepare_model_inputs``: adds that keyword when the micro-batch asks for Σπ² with fused
   kernels, after checking that the model's forward is the wrapped one (else it refuses, naming the keys);
4. ``FSDPEngineWithLMHead.prepare_model_outputs``: lays Σπ² out as the log-probs (remove-padding on and off)
   instead of raising;
5. ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits`` (verl's own Σπ² of its non-fused path): in
   fp32 with autocast off, 512 rows at a time (:func:`_full_logits_in_fp32`); under verl's default bf16 autocast
   verl's formula ran in bf16.

A run that does not ask for Σπ² with fused kernels goes through verl's functions 1–4 unchanged. The forward wrap
takes effect for models built after :func:`install` (verl's monkey patch reads the module attribute when it
patches).
"""

from __future__ import annotations

import contextvars
import functools

import torch

__all__ = ["chunk_statistics", "install", "FLAG", "logit_rescaling"]

FLAG = "otb_ref_sum_pi_squared"  # the model keyword that asks the wrapped fused forward for Σπ²
_MARK = "_otb_ref_sum_pi_squared"
_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("otb_ref_sum_pi_squared", default=None)
KEYS_TO_CHANGE = (
    "set actor_rollout_ref.model.use_fused_kernels=false or actor_rollout_ref.actor.calculate_sum_pi_squared=false"
)
# Hugging Face config keys by which a model's head rescales or caps its logits (Granite, Cohere, Gemma2/3...), with
# the values that leave them unchanged. verl 0.9.1's fused forward applies none of them, so its log-probs and the
# route's Σπ² would be those of other logits.
LOGIT_RESCALING_NO_OP = {"logits_scaling": (None, 1.0), "logit_scale": (None, 1.0), "final_logit_softcapping": (None,)}
# Model types whose default (a key absent from config.json) rescales: transformers' config classes.
LOGIT_RESCALING_DEFAULTS = {
    "cohere": ("logit_scale", 0.0625),
    "cohere2": ("logit_scale", 0.0625),
    "gemma2": ("final_logit_softcapping", 30.0),
    "gemma3n": ("final_logit_softcapping", 30.0),
    "gemma3n_text": ("final_logit_softcapping", 30.0),
}


def logit_rescaling(hf_config: dict) -> str | None:
    """``"key=value"`` by which a Hugging Face config (a dict, as config.json or ``config.to_dict()``; its
    ``text_config`` too) rescales or caps the logits, or None."""
    for section in (hf_config, hf_config.get("text_config") or {}):
        values = dict(section)
        default = LOGIT_RESCALING_DEFAULTS.get(section.get("model_type"))
        if default is not None and default[0] not in values:
            values[default[0]] = default[1]
        for key, no_op in LOGIT_RESCALING_NO_OP.items():
            if key in values and values[key] not in no_op:
                return f"{key}={values[key]}"
    return None


def chunk_statistics(hidden, weight, labels, temperature: float, chunk_size: int, cross_entropy=None):
    """``(log π(labels), entropy, Σπ²)`` of ``softmax(hidden @ weightᵀ / temperature)``, ``chunk_size`` rows at a time.

    The LM-head matmul and the temperature division run as in verl 0.9.1's fused torch backend, under whatever
    autocast the caller set (verl's FSDP engine runs its forward under bf16 autocast by default): so the logits
    are verl's. Everything after them runs in fp32 with autocast off: the softmax, verl's log-probs and entropy
    (the same fp32 operations as verl's, so the same numbers; ``cross_entropy`` is verl's flash-attn kernel where
    it uses one, else ``log_softmax``) and ``Σ_v π_v²`` of the same ``π``, a reduction that autocast would
    otherwise run as a bf16 matmul (bf16's 8-bit significand: relative errors up to ~1e-2, so the energy
    ``1 − 2π + Σπ²`` of a confident token is wrong by more than itself, often negative).
    hidden: ``[..., d]``; weight: ``[V, d]``; labels: ``[...]``. Returns three
    tensors shaped like ``labels``: fp32, hidden's dtype (as verl), fp32.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    rows = flat_hidden.shape[0]
    log_probs = torch.empty(rows, device=hidden.device, dtype=torch.float32)
    entropy = hidden.new_empty(rows)
    sum_pi_squared = torch.empty(rows, device=hidden.device, dtype=torch.float32)
    for start in range(0, rows, chunk_size):
        part = slice(start, min(start + chunk_size, rows))
        logits = (flat_hidden[part] @ weight.t()) / temperature  # the chunk's one LM-head matmul, as verl's
        logits_dtype = logits.dtype
        with torch.autocast(device_type=logits.device.type, enabled=False):
            logits = logits.to(torch.float32)
            probs = logits.softmax(dim=-1)
            entropy[part] = (torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)).to(logits_dtype)
            sum_pi_squared[part] = torch.einsum("rv,rv->r", probs, probs)  # fp32; no third [c, V] buffer
            del probs
            if cross_entropy is not None:
                log_probs[part] = -cross_entropy(logits, flat_labels[part])[0]
            else:
                log_probs[part] = logits.log_softmax(dim=-1).gather(-1, flat_labels[part].unsqueeze(-1)).squeeze(-1)
    return log_probs.view(labels.shape), entropy.view(labels.shape), sum_pi_squared.view(labels.shape)


def _fused_linear_forward(original, functional):
    """``FusedLinearForPPO.forward`` that, while a forward asked for Σπ², computes it in the same chunk loop."""

    @functools.wraps(original)
    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        request = _REQUEST.get()
        if request is None:
            return original(self, hidden_states, vocab_weights, input_ids, temperature)
        if self.impl_backend == "liger" and functional._LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY is not None:
            raise NotImplementedError(
                "otb_ref: Σπ² with fused kernels: liger-kernel is installed, so the liger backend runs liger's "
                "kernel, which gives no Σπ²; set actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"
            )
        if torch.is_grad_enabled() and (hidden_states.requires_grad or vocab_weights.requires_grad):
            raise NotImplementedError(
                "otb_ref: Σπ² with fused kernels is computed in no-grad passes only (verl's old-log-prob pass)"
            )
        cross_entropy = functional.cross_entropy_loss if functional._FLASH_ATTN_CROSS_ENTROPY_AVAILABLE else None
        log_probs, entropy, request["sum_pi_squared"] = chunk_statistics(
            hidden_states, vocab_weights, input_ids.to(torch.int64), temperature, self.chunk_size, cross_entropy
        )
        return log_probs, entropy

    setattr(forward, _MARK, True)
    return forward


def _model_forward(original):
    """The fused model forward, with the keyword :data:`FLAG`: Σπ² requested, returned as ``sum_pi_squared``."""

    @functools.wraps(original)
    def forward_with_torch_backend(self, *args, otb_ref_sum_pi_squared: bool = False, **kwargs):
        if not otb_ref_sum_pi_squared:
            return original(self, *args, **kwargs)
        request: dict = {}
        token = _REQUEST.set(request)
        try:
            output = original(self, *args, **kwargs)
        finally:
            _REQUEST.reset(token)
        if "sum_pi_squared" not in request:
            raise RuntimeError(f"otb_ref: {type(self).__name__}'s fused forward did not reach FusedLinearForPPO")
        output["sum_pi_squared"] = request["sum_pi_squared"]
        return output

    setattr(forward_with_torch_backend, _MARK, True)
    return forward_with_torch_backend


def asks_for_it(micro_batch) -> bool:
    """Whether a micro-batch asks the engine for Σπ² with fused kernels (verl's non-tensor flags)."""
    from verl.utils import tensordict_utils as tu

    flags = ("calculate_sum_pi_squared", "use_fused_kernels")
    return all(tu.get_non_tensor_data(data=micro_batch, key=key, default=False) for key in flags)


def require_route(module: torch.nn.Module) -> None:
    """Raise unless ``module`` holds a model whose fused forward is the wrapped torch/liger one."""
    for model in module.modules():
        backend = getattr(model, "_verl_fused_kernels_backend", None)
        if backend is None:
            continue
        config = getattr(model, "config", None)
        rescaled = logit_rescaling(config.to_dict()) if hasattr(config, "to_dict") else None
        if rescaled is not None:
            raise NotImplementedError(
                f"otb_ref: Σπ² with fused kernels: {type(model).__name__}'s head rescales or caps its logits "
                f"({rescaled}), which verl's fused forward does not apply: {KEYS_TO_CHANGE}"
            )
        if backend in ("torch", "liger") and getattr(type(model).forward, _MARK, False):
            return
        raise NotImplementedError(
            f"otb_ref: Σπ² with fused kernels covers verl's text-model forward with the torch or liger backend "
            f"(built after `import verl`); {type(model).__name__} runs another (backend {backend!r}): {KEYS_TO_CHANGE}"
        )
    raise NotImplementedError(
        f"otb_ref: Σπ² with fused kernels: no model patched by verl's fused kernels; {KEYS_TO_CHANGE}"
    )


def _prepare_inputs(original):
    @functools.wraps(original)
    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = original(self, micro_batch)
        if asks_for_it(micro_batch):
            require_route(self.module)
            model_inputs[FLAG] = True
        return model_inputs, output_args

    setattr(prepare_model_inputs, _MARK, True)
    return prepare_model_inputs


def layout_like_log_probs(engine, values: torch.Tensor, output_args: dict, micro_batch) -> torch.Tensor:
    """Per-token ``values`` of the fused forward (``[1, nnz + pad]`` packed, or ``[B, L]`` padded) as the engine lays
    out its log-probs: a jagged ``[B, j]`` nested tensor over the micro-batch's sequences."""
    from verl.utils import tensordict_utils as tu

    offsets = micro_batch["input_ids"].offsets()
    if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        flat = engine._gather_and_unpad_packed(values.squeeze(0), output_args["pad_size"])
    else:
        lengths = offsets.diff()
        flat = values[torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1)]
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


def _prepare_outputs(original):
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if not asks_for_it(micro_batch):
            return original(self, output, output_args, micro_batch, logits_processor_func)
        from verl.utils import tensordict_utils as tu

        values = output.get("sum_pi_squared", None)
        if values is None:
            raise RuntimeError(f"otb_ref: the fused forward returned no sum_pi_squared; {KEYS_TO_CHANGE}")
        tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=False)  # verl's part: log-probs, entropy
        try:
            model_output = original(self, output, output_args, micro_batch, logits_processor_func)
        finally:
            tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=True)
        model_output["sum_pi_squared"] = layout_like_log_probs(self, values, output_args, micro_batch)
        return model_output

    setattr(prepare_model_outputs, _MARK, True)
    return prepare_model_outputs


def _full_logits_in_fp32(original):
    """verl's ``calculate_sum_pi_squared_from_logits`` (its non-fused FSDP path) in fp32 with autocast off.

    Under verl's default bf16 autocast the LM head returns bf16 logits, and verl's
    ``exp(logsumexp(2x) − 2 logsumexp(x))`` then runs in bf16: its exponent's rounding (logsumexp ~ 1e2 has a bf16
    spacing of 0.5) makes Σπ² wrong by up to tens of percent. Here each block of 512 rows is upcast and reduced as
    ``Σ softmax²`` in fp32, so no ``[T, V]`` fp32 copy is made (on fp32 logits: verl's values up to its formula's
    rounding, ~1e-6 relative)."""

    @functools.wraps(original)
    def calculate_sum_pi_squared_from_logits(logits):
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], device=logits.device, dtype=torch.float32)
        with torch.autocast(device_type=logits.device.type, enabled=False):
            for start in range(0, flat.shape[0], 512):
                probs = flat[start : start + 512].float().softmax(dim=-1)
                out[start : start + 512] = torch.einsum("rv,rv->r", probs, probs)
        return out.view(logits.shape[:-1])

    setattr(calculate_sum_pi_squared_from_logits, _MARK, True)
    return calculate_sum_pi_squared_from_logits


def install() -> bool:
    """Put the route in place (idempotent); ``False`` where verl's functions are not the expected ones."""
    try:
        from verl.models.transformers import dense_common
        from verl.utils import torch_functional as verl_functional
        from verl.utils.experimental import torch_functional as functional
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError:
        return False
    wraps = (
        (dense_common, "forward_with_torch_backend", _model_forward),
        (functional.FusedLinearForPPO, "forward", lambda f: _fused_linear_forward(f, functional)),
        (FSDPEngineWithLMHead, "prepare_model_inputs", _prepare_inputs),
        (FSDPEngineWithLMHead, "prepare_model_outputs", _prepare_outputs),
        (verl_functional, "calculate_sum_pi_squared_from_logits", _full_logits_in_fp32),
    )
    if any(getattr(owner, name, None) is None for owner, name, _ in wraps):
        return False
    for owner, name, wrap in wraps:
        current = getattr(owner, name)
        if not getattr(current, _MARK, False):
            setattr(owner, name, wrap(current))
    return True
