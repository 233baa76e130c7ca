"""The policy: a Hugging Face causal LM (the built-in tiny Qwen2, or ``--model``) wrapped so that its LM head runs
inside one module's forward, which FSDP2 shards; and the tokenizer that goes with it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from otb_ref import logprobs_and_sum_pi_squared
from otb_ref.grad_norms import accepts_keyword, lm_head_log_probs
from otb_train import distributed
from otb_train.config import Config, UserError
from otb_train.tasks import CharTokenizer
from otb_train.tiny_models import tiny_causal_lm


class Policy(nn.Module):
    """A causal LM whose LM head runs inside this module's forward, so that FSDP2 gathers the head's weight there.

    FSDP2 unshards a module's parameters around ``forward`` only, so the three computations the trainer needs are
    one ``forward`` that hands over to the method its arguments name:

    * ``forward(ids, mask, positions, cache)`` -> :meth:`next_token_logits` (generation);
    * ``forward(ids, mask, positions, targets=[B, T])`` -> :meth:`log_probs_and_sum_pi_squared` (old log-probs
      and the update);
    * ``forward(..., targets=..., for_grad_norms=True)`` -> :meth:`log_probs_for_grad_norms` (one-pass ``||S||²``).
    """

    def __init__(self, lm: nn.Module, temperature: float, chunk_size: int | None):
        super().__init__()
        self.lm, self.temperature, self.chunk_size = lm, temperature, chunk_size
        self.cache_name = cache_keyword(lm.get_decoder())

    def forward(self, input_ids, attention_mask, position_ids, cache=None, targets=None, for_grad_norms=False):
        out = self.lm.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=targets is None,
            **{self.cache_name: cache},
        )
        if targets is None:
            return self.next_token_logits(out.last_hidden_state), getattr(out, self.cache_name)
        hidden = out.last_hidden_state[:, -targets.shape[1] - 1 : -1]  # position j-1 predicts token j
        if for_grad_norms:
            return self.log_probs_for_grad_norms(hidden, targets), None
        return self.log_probs_and_sum_pi_squared(hidden, targets)

    def next_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] fp32 of the token after the last position (temperature applied by the sampler)."""
        return (hidden[:, -1] @ self.lm.get_output_embeddings().weight.T).float()

    def log_probs_and_sum_pi_squared(self, hidden, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log π(targets), Σπ²)``, each [B, T] fp32, through otb_ref's chunked LM-head function (no [B, T, V])."""
        weight = self.lm.get_output_embeddings().weight  # [V, d]
        log_probs, sum_pi_squared = logprobs_and_sum_pi_squared(
            hidden, weight, targets, temperature=self.temperature, chunk_size=self.chunk_size
        )
        return log_probs.clone(), sum_pi_squared.clone()  # fresh tensors, not views: FSDP hooks its outputs

    def log_probs_for_grad_norms(self, hidden, targets) -> torch.Tensor:
        """``log π(targets)`` [B, T] through ``otb_ref.grad_norms.lm_head_log_probs`` (chunked over the vocabulary at
        the library's default budget, no [B, T, V]; ``--logprob-chunk-size`` counts rows of the other chunked path),
        whose call ``otb_ref.row_grad_norms_sq`` records to get each row's gradient norm in one pass."""
        return lm_head_log_probs(hidden, self.lm.get_output_embeddings(), targets, self.temperature)


def cache_keyword(decoder: nn.Module) -> str:
    """The name under which a Hugging Face decoder takes its KV cache and returns it in its output: ``cache`` from
    transformers 5.24 on (which deprecates ``past_key_values``), ``past_key_values`` before."""
    return "cache" if accepts_keyword(decoder, "cache") else "past_key_values"


def enable_hf_activation_checkpointing(lm: nn.Module) -> None:
    """transformers' own non-reentrant activation checkpointing of ``lm``'s layers (the trainer uses torch's,
    ``distributed.shard``): ``activation_checkpointing_enable`` from transformers 5.23 on (which deprecates
    ``gradient_checkpointing_enable``), ``gradient_checkpointing_enable`` before."""
    options = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str):
    """``AutoTokenizer``, except that a tokenizer_config.json naming a generic fast tokenizer gets exactly its
    tokenizer.json: transformers 5 otherwise builds the model type's own class (e.g. Qwen2Tokenizer, whose
    byte-level pre-tokenizer silently dropped the spaces of a character-level vocabulary)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in GENERIC_TOKENIZER_CLASSES and (Path(path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def build_model_and_tokenizer(cfg: Config):
    """(causal LM in fp32, tokenizer, EOS ids, pad id): the built-in tiny Qwen2, or ``--model``."""
    from transformers import AutoModelForCausalLM

    if not cfg.model:
        tokenizer, width = CharTokenizer(), cfg.hidden_size
        lm = tiny_causal_lm(
            "qwen2",
            cfg.seed,
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=max(1, width // 16),
            num_key_value_heads=max(1, width // 32),
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )
        return lm, tokenizer, [tokenizer.eos_token_id], tokenizer.pad_token_id
    try:
        tokenizer = load_tokenizer(cfg.model)
        lm = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - any loading failure is the user's checkpoint
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise UserError(f"--model {cfg.model}: not a loadable Hugging Face checkpoint ({reason})") from None
    head, config = lm.get_output_embeddings(), lm.config
    if (
        head is None
        or getattr(head, "bias", None) is not None
        or getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logit_scale", None) not in (None, 1.0)
    ):
        raise UserError(
            f"--model {cfg.model}: unsupported LM head (logits must be hidden @ W.T: no bias, soft-capping or scaling)"
        )
    eos = lm.generation_config.eos_token_id if lm.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    eos = sorted({*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None})
    if not eos:
        raise UserError(f"--model {cfg.model}: neither the tokenizer nor generation_config.json names an EOS token")
    return lm, tokenizer, eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def shard_policy(
    cfg: Config, lm: nn.Module, env: distributed.Dist, bf16: bool, checkpointing: bool, compile_layers: bool
) -> nn.Module:
    """FSDP2 over the decoder layers, then the Policy root; fully_shard moves each unit to the device."""
    layers = [m for m in lm.modules() if type(m).__name__ in (getattr(lm, "_no_split_modules", None) or ())]
    policy = Policy(lm, cfg.temperature, cfg.logprob_chunk_size or None)
    return distributed.shard(
        policy, layers, env, bf16=bf16, activation_checkpointing=checkpointing, compile_layers=compile_layers
    )
