"""Random-init causal LMs from sizes: the one recipe that the trainer's built-in model, the tests, the benchmarks and
the experiments build their models with (sizes in Hugging Face's config names). Imports only torch and
transformers, so the library's tests can use it without the trainer."""

from __future__ import annotations

import torch

CONFIG_CLASSES = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config"}
DEFAULTS = dict(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
# Qwen2.5-0.5B's shape (its config.json), the benchmarks' large model.
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def tiny_causal_lm(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A ``family`` causal LM (a key of :data:`CONFIG_CLASSES`) of :data:`DEFAULTS` updated by ``config``, its
    weights drawn after ``torch.manual_seed(seed)``, in ``dtype``, on torch's current default device."""
    import transformers

    if family not in CONFIG_CLASSES:
        raise ValueError(f"family: {family!r} is not one of {sorted(CONFIG_CLASSES)}")
    hf_config = getattr(transformers, CONFIG_CLASSES[family])(**{**DEFAULTS, **config})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
