"""The trainer's two hot paths on one GPU: generation tokens/s and update-phase MFU. One JSON record per line.

    python benchmarks/gpu_train_paths.py            # the issue's shapes (one H100: a few minutes)
    python benchmarks/gpu_train_paths.py --quick    # tiny shapes through every code path, seconds, CPU or GPU
    python benchmarks/gpu_train_paths.py --only generation        # or: sampling | decode | update

Both phases run as train.py runs them: a 1-rank process group (NCCL on GPU, gloo on CPU), the policy
wrapped by ``otb_train.model.Policy`` and sharded by ``otb_train.distributed.shard`` (FSDP2, bf16 parameters with fp32
reductions on GPU, fp32 on CPU).

``bench: "generation"`` — the built-in model of ``otb_train.model.build_model_and_tokenizer`` with
``--hidden-size 1024 --num-layers 16`` (Qwen2, 64 heads of 16, 32 KV heads, 15-token vocabulary, ~250M
parameters), 512 rows, left-padded prompts of 256-512 tokens (width 512), 512 new tokens each (EOS is an
id that is never sampled, so every row runs to the cap), inside ``distributed.gathered_for_generation``:

* ``old``: the model's forward with its growing cache, float64 sampling, a check after every token;
* ``new_sampling``: the same forward, float32 sampling, a check every 16 tokens;
* ``static_eager``: plus ``otb_train.static_decode.StaticKVDecoder`` without CUDA graphs;
* ``static_graphs``: plus CUDA graphs (the fast path; capture time included).

``tokens_per_s`` = rows × new tokens / wall time of the whole ``generate`` call (prefill included).
``agreement_with_old``: the fraction of response tokens equal to the old path's (bf16 kernels differ, so
a row may diverge after a near-tie; not a correctness measure). ``bench: "sampling"``: float32 vs float64
token agreement and batch-split invariance of ``sample_tokens`` on the device, at the vocabulary of Qwen2.5.

``bench: "decode_breakdown"`` — where one decode step's time goes at Qwen2.5-0.5B's shape (V = 151,936), 256 rows:
the static decoder's call, ``sample_tokens`` in float64 and float32, ``generate``'s bookkeeping; each timed alone.

``bench: "update"`` — Qwen2.5-0.5B's shape, random init from a config (hidden 896, 24 layers, 14 heads
of 64, 2 KV heads, intermediate 4864, vocabulary 151936, tied embeddings): rows of prompt 512 + response
512 tokens. One optimizer step = 32 rows in micro-batches of ``micro_batch_rows``: ``Policy`` forward with
targets (the chunked log-prob path), ``clipped_policy_loss`` (token-mean), backward, gradient-norm clip,
AdamW step — as train.py's update loop. With and without activation checkpointing.

Model FLOPs (PaLM's convention, as used for MFU; activation-checkpointing recomputation and the chunked
LM head's recomputation in backward are not counted), per row of S = prompt + response tokens, R response
tokens, L layers, width d, q = heads × head_dim, k = kv_heads × head_dim, f = intermediate size, V vocabulary:

    N_body  = L × (2·d·q + 2·d·k + 3·d·f)              matmul weights of the decoder layers
    forward = 2·N_body·S + 4·L·q·S² + 2·d·V·R          body, attention (QKᵀ and AV, full S², not halved for
                                                       causality, as PaLM), LM head on the response only
    model FLOPs = 3 × forward                          (backward = 2 × forward)
    MFU = model FLOPs per second / 989e12              (H100 SXM dense bf16; --peak-tflops to change)

``tokens_per_s`` counts all S tokens of every row. ``bench: "profile"``: the 15 device kernels with the most
self time over one optimizer step (and the top CPU ops), with the share of kernel categories.

Every case is guarded: a failure prints ``{"bench": "error", ...}`` and the rest runs.

Measured on one H100 80GB (torch 2.11.0+cu130, transformers 5.17.0), the whole run in about 4 minutes:
generation old 4.1k tokens/s, new_sampling 7.7k, static_eager 25.4k, static_graphs 38.9k (9.5x old);
update MFU without / with activation checkpointing 6.3% / 4.7% (4-row micro-batches), 12.0% / 8.2% (8),
18.0% / 15.7% (16); the device is busy about half of an 8-row step and matmuls are 35% of its kernel time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import traceback

import torch

from harness import emit, peak_gib, reset_peak, sync
from otb_train import distributed
from otb_train.config import Config
from otb_train.losses import clipped_policy_loss
from otb_train.model import Policy, build_model_and_tokenizer
from otb_train.rollout import generate, position_ids_from_mask, sample_tokens, sampling_uniforms
from otb_train.static_decode import StaticKVDecoder
from otb_train.tiny_models import QWEN25_05B, tiny_causal_lm

H100_BF16_DENSE_TFLOPS = 989.0
FULL = dict(
    gen_hidden=1024,
    gen_layers=16,
    gen_rows=512,
    gen_prompt=512,
    gen_new=512,
    sample_vocab=151936,
    sample_rows=512,
    decode_model=dict(QWEN25_05B),  # decode: Qwen2.5-0.5B's shape (tied), 256 rows of prompts up to 512 tokens
    decode_rows=256,
    decode_steps=64,  # timed, of a decoder sized for decode_capacity new tokens (train.py's 512)
    decode_capacity=512,
    update={k: v for k, v in QWEN25_05B.items() if k != "tie_word_embeddings"},  # Qwen2.5-0.5B's shape
    prompt=512,
    response=512,
    rows_per_step=32,
    micro_rows=(4, 8, 16),
    timed_steps=3,
)
# The tiny model of the quick run's decode and update sections.
QUICK_MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
)
QUICK = dict(
    gen_hidden=64,
    gen_layers=2,
    gen_rows=8,
    gen_prompt=16,
    gen_new=12,
    sample_vocab=1000,
    sample_rows=16,
    decode_model=QUICK_MODEL,
    decode_rows=8,
    decode_steps=6,
    decode_capacity=12,
    update=QUICK_MODEL,
    prompt=16,
    response=16,
    rows_per_step=4,
    micro_rows=(2,),
    timed_steps=1,
)


def guarded(bench: str, case: str):
    """Context manager: an exception becomes an error record, and the benchmark goes on."""

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except Exception as error:  # noqa: BLE001 - report every failure, keep going
            lines = traceback.format_exc().strip().splitlines()
            emit(
                {
                    "bench": "error",
                    "of": bench,
                    "case": case,
                    "error": f"{type(error).__name__}: {error}"[:2000],
                    "traceback": lines[-12:],
                }
            )
        finally:
            release_memory()

    return guard()


def release_memory() -> None:
    """Drop cached device memory between cases."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(env: distributed.Dist) -> dict:
    """What ran: versions, device, attention backends."""
    import transformers

    record = {
        "bench": "env",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu",
        "backend": torch.distributed.get_backend(),
        "threads": torch.get_num_threads(),
    }
    if env.device.type == "cuda":
        record["cuda"] = torch.version.cuda
        record["sdpa_flash"] = torch.backends.cuda.flash_sdp_enabled()
        record["sdpa_mem_efficient"] = torch.backends.cuda.mem_efficient_sdp_enabled()
    return record


def sharded_policy(lm: torch.nn.Module, env: distributed.Dist, checkpointing: bool) -> torch.nn.Module:
    """``otb_train.model.Policy`` around ``lm``, sharded exactly as train.py shards it."""
    lm.eval()
    layers = [m for m in lm.modules() if type(m).__name__ in (getattr(lm, "_no_split_modules", None) or ())]
    policy = Policy(lm, temperature=1.0, chunk_size=None)
    return distributed.shard(
        policy, layers, env, bf16=env.device.type == "cuda", activation_checkpointing=checkpointing
    )


# ----------------------------------------------------------------------------- sampling


def bench_sampling(shape: dict, env: distributed.Dist) -> None:
    """float32 vs float64 agreement, split invariance and time of ``sample_tokens`` at a realistic vocabulary."""
    rows, vocab, device = shape["sample_rows"], shape["sample_vocab"], env.device
    generator = torch.Generator().manual_seed(0)
    logits = (3.0 * torch.randn(rows, vocab, generator=generator)).to(device)  # a spread like a trained LM's
    uniforms = sampling_uniforms(0, 0, rows, 8).to(device)
    for top_p in (1.0, 0.9):
        agree, split_equal, times = 0, 0, {}
        for t in range(uniforms.shape[1]):
            u = uniforms[:, t]
            fp32 = sample_tokens(logits, u, top_p=top_p)
            agree += int((fp32 == sample_tokens(logits, u, top_p=top_p, dtype=torch.float64)).sum())
            halves = torch.cat(
                [sample_tokens(logits[:1], u[:1], top_p=top_p), sample_tokens(logits[1:], u[1:], top_p=top_p)]
            )
            split_equal += int((fp32 == halves).sum())
        for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
            start = sync(device)
            for _ in range(5):
                sample_tokens(logits, uniforms[:, 0], top_p=top_p, dtype=dtype)
            times[f"{name}_ms"] = round((sync(device) - start) / 5 * 1e3, 3)
        draws = rows * uniforms.shape[1]
        emit(
            {
                "bench": "sampling",
                "rows": rows,
                "vocab": vocab,
                "top_p": top_p,
                "draws": draws,
                "float32_equals_float64": agree / draws,
                "split_invariant": split_equal / draws,
                **times,
            }
        )


# ----------------------------------------------------------------------------- generation


def generation_inputs(shape: dict, vocab: int, device: torch.device):
    """Left-padded random prompts (lengths half to full width) and the global uniforms."""
    rows, width = shape["gen_rows"], shape["gen_prompt"]
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(2, vocab, (rows, width), generator=generator) * mask
    uniforms = sampling_uniforms(0, 1, rows, shape["gen_new"])
    return ids.to(device), mask.to(device), uniforms.to(device)


def run_generation(policy, path: str, inputs, shape: dict, vocab: int, max_new_tokens: int):
    """One ``generate`` call of ``path`` inside ``gathered_for_generation``, as train.py calls it."""
    ids, mask, uniforms = inputs
    options = dict(
        eos_token_ids=[vocab], pad_token_id=0, max_new_tokens=max_new_tokens, keep_going=distributed.any_rank
    )
    if path == "old":
        options.update(check_every=1, sample_dtype=torch.float64)
    with distributed.gathered_for_generation(policy):
        forward = policy
        if path.startswith("static"):
            forward = StaticKVDecoder(policy, policy.lm, max_new_tokens, cuda_graphs=path == "static_graphs")
        return generate(forward, ids, mask, uniforms[:, :max_new_tokens], **options)


def bench_generation(shape: dict, env: distributed.Dist, paths: list[str], profile: bool) -> None:
    """Tokens/s of each generation path on the built-in model shape."""
    cfg = Config(hidden_size=shape["gen_hidden"], num_layers=shape["gen_layers"])
    lm, tokenizer, _, _ = build_model_and_tokenizer(cfg)
    vocab, params = len(tokenizer), sum(p.numel() for p in lm.parameters())
    policy = sharded_policy(lm, env, checkpointing=False)
    inputs = generation_inputs(shape, vocab, env.device)
    reference, base_seconds = None, None
    for path in paths:
        if path == "static_graphs" and env.device.type != "cuda":
            emit({"bench": "generation", "path": path, "skipped": "CUDA graphs need a CUDA device"})
            continue
        with guarded("generation", path):
            run_generation(policy, path, inputs, shape, vocab, max_new_tokens=4)  # warm-up: kernels, allocator
            reset_peak(env.device)
            start = sync(env.device)
            rollout = run_generation(policy, path, inputs, shape, vocab, max_new_tokens=shape["gen_new"])
            seconds = sync(env.device) - start
            tokens = int(rollout.response_mask.sum())
            record = {
                "bench": "generation",
                "path": path,
                "rows": shape["gen_rows"],
                "prompt_width": shape["gen_prompt"],
                "new_tokens": rollout.response_ids.shape[1],
                "params": params,
                "hidden": shape["gen_hidden"],
                "layers": shape["gen_layers"],
                "vocab": vocab,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "peak_memory_gib": peak_gib(env.device),
            }
            if path == "old":
                reference, base_seconds = rollout.response_ids, seconds
            elif reference is not None:
                record["speedup_vs_old"] = round(base_seconds / seconds, 2)
                record["agreement_with_old"] = float((rollout.response_ids == reference).float().mean())
            emit(record)
    for graphs in (False, True) if env.device.type == "cuda" else (False,):
        with guarded("decoder_check", f"cuda_graphs={graphs}"):
            check_decoder(policy, inputs, graphs)
    if profile:
        for path in ("model_forward", "static_eager"):
            with guarded("profile", f"decode_{path}"):
                profile_decode(policy, inputs, path, env, warm_steps=shape["gen_new"] // 4)
    del policy, lm


def check_decoder(policy, inputs, cuda_graphs: bool, rows: int = 64, steps: int = 8) -> None:
    """Logits of ``StaticKVDecoder`` vs the model's own forward, fed the same (greedy) tokens."""
    ids, mask, _ = (x[:rows] for x in inputs)
    prompt_len = ids.shape[1]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    positions = position_ids_from_mask(mask)
    diffs, agree, scale = [], 0, 0.0
    with torch.no_grad(), distributed.gathered_for_generation(policy):
        reference, cache = policy(ids, mask, positions, None)
        decoder = StaticKVDecoder(policy, policy.lm, steps, cuda_graphs=cuda_graphs)
        logits, state = decoder(ids, mask, positions, None)
        next_position = positions[:, -1:] + 1
        for t in range(steps):
            token = reference.argmax(-1, keepdim=True)
            reference, cache = policy(token, full_mask[:, : prompt_len + t + 1], next_position, cache)
            logits, state = decoder(token, full_mask[:, : prompt_len + t + 1], next_position, state)
            diffs.append(float((reference - logits).abs().max()))
            agree += int((reference.argmax(-1) == logits.argmax(-1)).sum())
            scale = max(scale, float(reference.abs().max()))
            next_position = next_position + 1
    rows = ids.shape[0]
    emit(
        {
            "bench": "decoder_check",
            "cuda_graphs": cuda_graphs,
            "rows": rows,
            "steps": steps,
            "max_abs_logit_diff": max(diffs),
            "max_abs_logit": scale,
            "argmax_agreement": agree / (rows * steps),
        }
    )


def bench_decode(shape: dict, env: distributed.Dist) -> None:
    """Where a decode step's time goes at a real vocabulary: Qwen2.5-0.5B's shape (random init, sharded as train.py
    shards it), ``decode_rows`` left-padded prompts of half to full 512 tokens, the static decoder (CUDA graphs on
    CUDA). Per step, each part timed alone with the device synchronised around it: the decoder call (fed the argmax),
    ``sample_tokens`` on its logits in float64 (train.py's default) and in float32, and ``generate``'s per-token
    EOS test (``bookkeeping``; not its column writes, nor its host check every 16 tokens). Medians over
    ``decode_steps`` steps, in ms."""
    config = shape["decode_model"]
    vocab = config["vocab_size"]
    with torch.device(env.device):
        lm = tiny_causal_lm("qwen2", 0, **config, max_position_embeddings=2048)
    policy = sharded_policy(lm, env, checkpointing=False)
    inputs = generation_inputs(dict(gen_rows=shape["decode_rows"], gen_prompt=shape["prompt"],
                                     gen_new=shape["decode_steps"]), vocab, env.device)  # fmt: skip
    ids, mask, uniforms = inputs
    steps, width = shape["decode_steps"], ids.shape[1]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    positions = position_ids_from_mask(mask)
    eos, alive = (
        torch.tensor([vocab - 1], device=env.device),
        torch.ones(ids.shape[0], dtype=torch.bool, device=env.device),
    )
    parts: dict[str, list[float]] = {"decoder": [], "sample_float64": [], "sample_float32": [], "bookkeeping": []}

    def timed_part(name: str, fn):
        start = sync(env.device)
        out = fn()
        parts[name].append((sync(env.device) - start) * 1e3)
        return out

    reset_peak(env.device)
    with torch.no_grad(), distributed.gathered_for_generation(policy):
        # the cache of train.py's 512 new tokens, so each step's attention spans what train.py's early steps span
        capacity = shape["decode_capacity"]
        decoder = StaticKVDecoder(policy, policy.lm, capacity, cuda_graphs=env.device.type == "cuda")
        logits, state = decoder(ids, mask, positions, None)
        next_position = positions[:, -1:] + 1
        for t in range(steps):
            token = timed_part("sample_float64", lambda: sample_tokens(logits, uniforms[:, t]))
            timed_part("sample_float32", lambda: sample_tokens(logits, uniforms[:, t], dtype=torch.float32))
            alive = timed_part("bookkeeping", lambda: alive & ~torch.isin(torch.where(alive, token, 0), eos))
            feed = logits.argmax(-1, keepdim=True)
            logits, state = timed_part(
                "decoder", lambda: decoder(feed, full_mask[:, : width + t + 1], next_position, state)
            )
            next_position = next_position + 1
    warm = parts["decoder"][steps // 4 :]  # the first steps capture graphs for new span buckets
    emit(
        {
            "bench": "decode_breakdown",
            "rows": ids.shape[0],
            "prompt_width": width,
            "steps": steps,
            "max_new_tokens": shape["decode_capacity"],
            "vocab": vocab,
            "params": sum(p.numel() for p in lm.parameters()),
            "cuda_graphs": env.device.type == "cuda",
            **{f"{name}_ms": round(sorted(v)[len(v) // 2], 3) for name, v in parts.items()},
            "decoder_ms_after_warmup": round(sorted(warm)[len(warm) // 2], 3),
            "peak_memory_gib": peak_gib(env.device),
        }
    )
    del policy, lm


# ----------------------------------------------------------------------------- update


def update_model_flops(config, rows: int, prompt: int, response: int) -> float:
    """Model FLOPs of forward + backward for ``rows`` rows (the module docstring's formula)."""
    d, layers, f, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, k = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    seq = prompt + response
    body = layers * (2 * d * q + 2 * d * k + 3 * d * f)
    forward = 2 * body * seq + 4 * layers * q * seq * seq + 2 * d * vocab * response
    return 3.0 * forward * rows


def update_model(shape: dict, device: torch.device):
    """A random-init Qwen2 of the update shape, built on ``device`` (no download)."""
    extra = dict(max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
    with torch.device(device):
        lm = tiny_causal_lm("qwen2", 0, torch.float32, **shape["update"], **extra)
    return lm, lm.config


def update_batch(shape: dict, vocab: int, rows: int, device: torch.device, padded: bool):
    """Sequences, attention, positions, response ids and mask of ``rows`` rows, as train.py builds them."""
    prompt, response = shape["prompt"], shape["response"]
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(vocab, (rows, prompt + response), generator=generator)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.bool)
    response_mask = torch.ones(rows, response, dtype=torch.bool)
    if padded:  # left-padded prompts and right-padded responses of 3/4 to full length
        prompt_mask = torch.arange(prompt)[None] >= torch.randint(0, prompt // 4 + 1, (rows, 1), generator=generator)
        response_mask = torch.arange(response)[None] < torch.randint(
            3 * response // 4, response + 1, (rows, 1), generator=generator
        )
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    targets = ids[:, prompt:] * response_mask
    batch = (ids * attention, attention, position_ids_from_mask(attention), targets, response_mask)
    return [x.to(device) for x in batch]


def optimizer_step(policy, optimizer, micro_batches, old_log_probs, advantages, tokens: float) -> float:
    """train.py's update for one mini-batch: micro-batch losses normalised globally, clip, AdamW."""
    for (sequences, attention, positions, targets, mask), old, adv in zip(micro_batches, old_log_probs, advantages):
        log_probs, _ = policy(sequences, attention, positions, targets=targets)
        loss, _ = clipped_policy_loss(
            log_probs,
            old,
            adv,
            mask,
            clip_low=0.2,
            clip_high=0.2,
            aggregation="token-mean",
            global_tokens=tokens,
            global_sequences=float(len(micro_batches) * len(mask)),
        )
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def prepare_update(policy, shape, vocab, micro_rows, device, padded):
    """Micro-batches of one optimizer step and their old log-probs (one no-grad pass) and advantages."""
    steps = max(1, shape["rows_per_step"] // micro_rows)
    micro = [update_batch(shape, vocab, micro_rows, device, padded) for _ in range(steps)]
    with torch.no_grad():
        old = [policy(*batch[:3], targets=batch[3])[0] for batch in micro]
    generator = torch.Generator().manual_seed(3)
    advantages = [torch.randn(batch[3].shape, generator=generator).to(device) for batch in micro]
    tokens = float(sum(batch[4].sum() for batch in micro))
    return micro, old, advantages, tokens


def bench_update(shape: dict, env: distributed.Dist, peak_tflops: float, profile: bool) -> None:
    """Tokens/s and MFU of the update phase, with and without activation checkpointing."""
    device = env.device
    for checkpointing in (False, True):
        with guarded("update", f"activation_checkpointing={checkpointing}"):
            lm, config = update_model(shape, device)
            params = sum(p.numel() for p in lm.parameters())
            policy = sharded_policy(lm, env, checkpointing)
            optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
            middle = shape["micro_rows"][len(shape["micro_rows"]) // 2]
            cases = [(m, False) for m in shape["micro_rows"]] + [(middle, True)]
            for micro_rows, padded in cases:
                case = f"activation_checkpointing={checkpointing},micro_rows={micro_rows},padded={padded}"
                with guarded("update", case):
                    measure_update(
                        policy,
                        optimizer,
                        config,
                        params,
                        shape,
                        env,
                        peak_tflops,
                        micro_rows,
                        padded,
                        checkpointing,
                        profile=profile
                        and not checkpointing
                        and not padded
                        and micro_rows == shape["micro_rows"][len(shape["micro_rows"]) // 2],
                    )
            del policy, optimizer, lm


def measure_update(
    policy, optimizer, config, params, shape, env, peak_tflops, micro_rows, padded, checkpointing, profile
) -> None:
    """Time ``timed_steps`` optimizer steps after one warm-up step; emit the record (and a profile)."""
    device = env.device
    micro, old, advantages, tokens = prepare_update(policy, shape, config.vocab_size, micro_rows, device, padded)
    rows = micro_rows * len(micro)
    optimizer_step(policy, optimizer, micro, old, advantages, tokens)  # warm-up
    reset_peak(device)
    start = sync(device)
    for _ in range(shape["timed_steps"]):
        optimizer_step(policy, optimizer, micro, old, advantages, tokens)
    seconds = (sync(device) - start) / shape["timed_steps"]
    seq = shape["prompt"] + shape["response"]
    flops = update_model_flops(config, rows, shape["prompt"], shape["response"])
    emit(
        {
            "bench": "update",
            "activation_checkpointing": checkpointing,
            "micro_batch_rows": micro_rows,
            "rows_per_optimizer_step": rows,
            "prompt": shape["prompt"],
            "response": shape["response"],
            "padded": padded,
            "valid_token_fraction": round(float(sum(b[1].sum() for b in micro)) / (rows * seq), 3),
            "params": params,
            "step_seconds": round(seconds, 4),
            "tokens_per_s": round(rows * seq / seconds, 1),
            "model_tflop_per_step": round(flops / 1e12, 3),
            "achieved_tflops": round(flops / seconds / 1e12, 1),
            "mfu": round(flops / seconds / (peak_tflops * 1e12), 4),
            "peak_tflops": peak_tflops,
            "peak_memory_gib": peak_gib(device),
        }
    )
    if profile:
        with guarded("profile", "update"):
            profile_update(policy, optimizer, micro, old, advantages, tokens, env, micro_rows)
        with guarded("update_breakdown", "update"):
            update_breakdown(policy, optimizer, micro, old, advantages, tokens, config, env, micro_rows)


# ----------------------------------------------------------------------------- profile


KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "kernel_0d1d")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "sm90_xmma")),
    ("nccl", ("nccl",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
    ("reduce_norm_softmax", ("reduce", "norm", "softmax", "logsumexp", "sum")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


def kernel_category(name: str) -> str:
    """A coarse category of a kernel name (first match of ``KERNEL_CATEGORIES``)."""
    lowered = name.lower()
    return next((category for category, keys in KERNEL_CATEGORIES if any(k in lowered for k in keys)), "other")


def device_kernels(prof) -> dict[str, list[float]]:
    """``name -> [calls, microseconds]`` of device-side events (kernels, copies), user annotations excluded."""
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if "CUDA" not in str(getattr(event, "device_type", "")) or getattr(event, "is_user_annotation", False):
            continue
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    return kernels


def kernel_summary(prof, wall_s: float, repeats: int = 1) -> dict:
    """Top 15 kernels, category shares and device busy fraction (per repeat)."""
    kernels = device_kernels(prof)
    total = sum(us for _, us in kernels.values())
    categories: dict[str, float] = {}
    for name, (_, us) in kernels.items():
        categories[kernel_category(name)] = categories.get(kernel_category(name), 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "wall_ms": round(wall_s * 1e3 / repeats, 2),
        "device_kernel_ms": round(total / 1e3 / repeats, 2),
        "device_busy_fraction": round(total / 1e6 / wall_s, 3) if wall_s else None,
        "category_share": {k: round(v / total, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])}
        if total
        else {},
        "top_kernels": [
            {
                "name": name[:160],
                "calls": int(calls / repeats),
                "ms": round(us / 1e3 / repeats, 3),
                "share": round(us / total, 4),
            }
            for name, (calls, us) in top
        ],
    }


def sync_sources(prof, limit: int = 6) -> list[dict]:
    """Where the host waited for the device: Python stacks of ``.item()`` / ``bool()`` (``_local_scalar_dense``)."""
    stacks: dict[str, int] = {}
    for event in prof.events():
        if event.name in ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero") and event.stack:
            frames = [f for f in event.stack if "site-packages/torch/" not in f][:3]
            key = " <- ".join(frames)
            stacks[key] = stacks.get(key, 0) + 1
    return [{"calls": n, "stack": key[:400]} for key, n in sorted(stacks.items(), key=lambda kv: -kv[1])[:limit]]


def profile_update(policy, optimizer, micro, old, advantages, tokens, env, micro_rows) -> None:
    """torch.profiler over one optimizer step: top device kernels, categories, host syncs, top CPU ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    start = sync(env.device)
    with profile(activities=activities, with_stack=True) as prof:
        optimizer_step(policy, optimizer, micro, old, advantages, tokens)
        sync(env.device)
    wall = time.perf_counter() - start
    cpu_top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    emit(
        {
            "bench": "profile",
            "phase": "update",
            "micro_batch_rows": micro_rows,
            "micro_batches": len(micro),
            **kernel_summary(prof, wall),
            "host_syncs": sync_sources(prof),
            "top_cpu_ops": [
                {"name": e.key[:100], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
                for e in cpu_top
            ],
        }
    )


def update_breakdown(policy, optimizer, micro, old, advantages, tokens, config, env, micro_rows) -> None:
    """Seconds of the parts of one optimizer step: micro-batch forward+backward, the LM head alone, clip+AdamW."""
    from otb_ref import logprobs_and_sum_pi_squared

    device, (sequences, attention, positions, targets, mask) = env.device, micro[0]
    start = sync(device)
    log_probs, _ = policy(sequences, attention, positions, targets=targets)
    forward = sync(device) - start
    loss, _ = clipped_policy_loss(
        log_probs, old[0], advantages[0], mask, global_tokens=tokens, global_sequences=float(len(micro) * len(mask))
    )
    loss.backward()
    backward = sync(device) - start - forward
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(*targets.shape, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02).requires_grad_()
    start = sync(device)
    head_forward = logprobs_and_sum_pi_squared(hidden, weight, targets)[0]
    head_fwd = sync(device) - start
    head_forward.sum().backward()
    head_bwd = sync(device) - start - head_fwd
    start = sync(device)
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    emit(
        {
            "bench": "update_breakdown",
            "micro_batch_rows": micro_rows,
            "micro_forward_ms": round(forward * 1e3, 2),
            "micro_backward_ms": round(backward * 1e3, 2),
            "lm_head_forward_ms": round(head_fwd * 1e3, 2),
            "lm_head_backward_ms": round(head_bwd * 1e3, 2),
            "clip_and_adamw_ms": round((sync(device) - start) * 1e3, 2),
        }
    )


def profile_decode(policy, inputs, path: str, env, warm_steps: int, steps: int = 4) -> None:
    """Kernels of ``steps`` decode calls (after ``warm_steps``) of the model's forward or the static decoder."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask, _ = inputs
    width, total = ids.shape[1], warm_steps + steps
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], total)], dim=1)
    positions = position_ids_from_mask(mask)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    with torch.no_grad(), distributed.gathered_for_generation(policy):
        forward = policy if path == "model_forward" else StaticKVDecoder(policy, policy.lm, total, cuda_graphs=False)
        logits, cache = forward(ids, mask, positions, None)
        next_position = positions[:, -1:] + 1
        for t in range(total):
            if t == warm_steps:
                start = sync(env.device)
                prof = profile(activities=activities)
                prof.__enter__()
            token = logits.argmax(-1, keepdim=True)
            logits, cache = forward(token, full_mask[:, : width + t + 1], next_position, cache)
            next_position = next_position + 1
        sync(env.device)
        prof.__exit__(None, None, None)
        wall = time.perf_counter() - start
    emit(
        {
            "bench": "profile",
            "phase": f"decode_{path}",
            "rows": ids.shape[0],
            "cache_length": width + total,
            "per": "decode step",
            **kernel_summary(prof, wall, repeats=steps),
        }
    )


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes through every code path (seconds)")
    parser.add_argument(
        "--only",
        choices=("sampling", "generation", "decode", "update"),
        action="append",
        help="run only these sections (repeatable)",
    )
    parser.add_argument(
        "--generation-paths",
        default="old,new_sampling,static_eager,static_graphs",
        help="comma-separated generation paths",
    )
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS, help="dense bf16 peak for MFU")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler records")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    sections = args.only or ["sampling", "generation", "decode", "update"]
    env = distributed.init("auto")
    try:
        emit(environment(env))
        if "sampling" in sections:
            with guarded("sampling", "sample_tokens"):
                bench_sampling(shape, env)
        if "generation" in sections:
            with guarded("generation", "setup"):
                bench_generation(shape, env, [p for p in args.generation_paths.split(",") if p], not args.no_profile)
        if "decode" in sections:
            with guarded("decode", "setup"):
                bench_decode(shape, env)
        if "update" in sections:
            with guarded("update", "setup"):
                bench_update(shape, env, args.peak_tflops, profile=not args.no_profile)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
