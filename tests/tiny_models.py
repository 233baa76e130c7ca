"""Tiny random-init causal LMs for the tests: one recipe; each test passes the sizes it needs (Hugging Face names)."""

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


def tiny_causal_lm(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A ``family`` causal LM of :data:`DEFAULTS` updated by ``config``, seeded by ``seed``."""
    import transformers

    hf_config = getattr(transformers, CONFIG_CLASSES[family])(**{**DEFAULTS, **config})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
