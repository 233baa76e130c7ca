"""The CUDA-only paths: the Triton decode kernel, static decoding with CUDA graphs, rollouts, bf16 draws, one-pass
gradient norms on the GPU. They run in sessions lent a GPU (``python -m pytest -q tests/test_cuda_paths.py``; the
device script is ``benchmarks/gpu_device_checks.sh``) and skip with a reason everywhere else. With
``OTB_REF_RECORDS=FILE`` set, the measured numbers (largest differences, the bf16 draw disagreement rate) are
appended to FILE as JSON lines; nothing here asserts a speed.

Every test runs with TF32 off, so "fp32" means IEEE float32 matrix products on the GPU too.
"""

import json
import math
import os

import pytest
import torch

from otb_ref.exact import sequence_grad_norms_sq_fp64 as exact_norms
from otb_ref.grad_norms import lm_head_log_probs, row_grad_norms_sq
from otb_train.model import Policy, enable_hf_activation_checkpointing
from otb_train.rollout import (
    draw_disagreement_probability,
    generate,
    position_ids_from_mask,
    sample_tokens,
    sampling_uniforms,
)
from otb_train.static_decode import StaticKVDecoder, decode_attention
from otb_train.tiny_models import tiny_causal_lm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (run in a session lent one: benchmarks/gpu_device_checks.sh)",
)
CUDA = torch.device("cuda")
SMALL = dict(
    vocab_size=40,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def record(**fields) -> None:
    """Append a measurement to ``$OTB_REF_RECORDS`` (JSON lines), with the GPU and torch; nothing when unset."""
    path = os.environ.get("OTB_REF_RECORDS")
    if path:
        with open(path, "a") as out:
            out.write(
                json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__, **fields}) + "\n"
            )


def left_padded_prompts(batch=6, width=9, vocab=40, seed=3):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return (torch.randint(3, vocab, (batch, width), generator=generator) * mask).to(CUDA), mask.to(CUDA)


# --------------------------------------------------------------------------- the Triton decode kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_attention_equals_sdpa_on_cuda(dtype):
    """Odd group and head sizes, a row whose only valid slot is the last, a long span.

    Reference: SDPA on the same inputs upcast to fp32. fp32: both compute the softmax in fp32 and differ by summation
    order only (1e-5 of values of order 1). bf16: the kernel reads bf16 keys and values into fp32 and rounds the
    output once to bf16, so it lies within one bf16 rounding (2⁻⁸ relative) of the fp32 result, plus the fp32 part.
    """
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 2, 2, 16, 40, 33), (2, 2, 7, 64, 50, 50), (2, 1, 3, 24, 20, 17), (64, 2, 7, 64, 1100, 1024)]
    worst = 0.0
    for batch, kv_heads, group, dim, capacity, span in shapes:
        query = torch.randn(batch, kv_heads, group, dim, generator=generator)
        keys, values = (torch.randn(batch, kv_heads, capacity, dim, generator=generator) for _ in range(2))
        valid = torch.rand(batch, capacity, generator=generator) > 0.3
        valid[:, span - 1] = True
        valid[0, : span - 1] = False
        query, keys, values, valid = (t.to(CUDA) for t in (query, keys, values, valid))
        query, keys, values = (t.to(dtype) for t in (query, keys, values))
        expected = decode_attention(query.float(), keys.float(), values.float(), valid, span, dim**-0.5, "sdpa")
        got = decode_attention(query, keys, values, valid, span, dim**-0.5, backend="triton")
        assert got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2**-8
        error = ((got.float() - expected).abs() / (expected.abs() + 1)).max().item()
        worst = max(worst, error)
        assert error <= tolerance + 1e-5, (batch, group, dim, span, error)
    record(test="triton_decode_attention_vs_sdpa", dtype=str(dtype)[6:], max_rel_error=worst)


# --------------------------------------------------------------------------- static decoding with CUDA graphs


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_static_decode_with_cuda_graphs_equals_the_models_forward(kind):
    """fp32, CUDA graphs and the default attention backend (Triton on CUDA when installed): the same logits as the
    model's own forward, step after step, across several attention-span buckets. Tolerance: 1e-4 absolute on logits
    of order 1 (different kernels, fp32 summation orders; the CPU test holds 1e-5 with one kernel family)."""
    lm = tiny_causal_lm(kind, **SMALL).eval().to(CUDA)
    ids, mask = left_padded_prompts()
    steps, width = 24, ids.shape[1]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    positions = position_ids_from_mask(mask)
    policy = Policy(lm, temperature=1.0, chunk_size=None)
    with torch.no_grad():
        reference, cache = policy(ids, mask, positions, None)
        decoder = StaticKVDecoder(policy, lm, steps, cuda_graphs=True, buckets=4)
        logits, state = decoder(ids, mask, positions, None)
        next_position, worst = positions[:, -1:] + 1, 0.0
        for t in range(steps):
            token = reference.argmax(-1, keepdim=True)
            reference, cache = policy(token, full_mask[:, : width + t + 1], next_position, cache)
            logits, state = decoder(token, full_mask[:, : width + t + 1], next_position, state)
            worst = max(worst, (logits - reference).abs().max().item())
            next_position = next_position + 1
    assert len(decoder.graphs) >= 2  # several buckets were captured and replayed
    record(test="static_decode_cuda_graphs_vs_forward", family=kind, max_abs_logit_diff=worst)
    assert worst <= 1e-4


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_generate_with_cuda_graphs_gives_the_same_rollout(kind):
    """fp32, EOS reachable: the static decoder with CUDA graphs and the model's forward sample the same tokens, also
    when finished rows are dropped (``drop_finished``)."""
    lm = tiny_causal_lm(kind, **SMALL).eval().to(CUDA)
    ids, mask = left_padded_prompts()
    uniforms = sampling_uniforms(0, 3, num_rows=ids.shape[0], max_new_tokens=40)
    kwargs = dict(eos_token_ids=[1, 2], pad_token_id=0, max_new_tokens=40, temperature=1.5, check_every=4)
    policy = Policy(lm, temperature=1.0, chunk_size=None)
    reference = generate(policy, ids, mask, uniforms, **kwargs)
    static = generate(StaticKVDecoder(policy, lm, 40, cuda_graphs=True), ids, mask, uniforms, **kwargs)
    assert reference.finished.any() and reference.response_ids.shape[1] > 1  # EOS and several decode steps happened
    assert torch.equal(reference.response_ids, static.response_ids)
    assert torch.equal(reference.response_mask, static.response_mask)
    assert torch.equal(reference.finished, static.finished)
    # drop_finished: the batch narrows, its graphs are captured again for the smaller batch; the same rollout
    narrowed, decoder = [], StaticKVDecoder(policy, lm, 40, cuda_graphs=True)
    select_rows = decoder.select_rows
    decoder.select_rows = lambda rows: narrowed.append(rows.numel()) or select_rows(rows)
    dropped = generate(decoder, ids, mask, uniforms, drop_finished=True, **kwargs)
    assert narrowed and narrowed == sorted(narrowed, reverse=True) and narrowed[0] < ids.shape[0]  # it did narrow
    assert all(torch.equal(got, want) for got, want in zip(dropped, reference))


def test_bf16_draw_disagreement_matches_its_exact_probability():
    """bf16, a head with ordinary logits (std ~3, EOS an ordinary token): the static decoder (CUDA graphs, Triton)
    and the model's own forward, fed the same tokens, each draw one token with the same uniform.

    Given the two logit vectors of a draw, the draws differ with the probability
    :func:`otb_train.rollout.draw_disagreement_probability` computes exactly (inverse-CDF coupling). The uniforms are
    independent of everything before their step, so the count of disagreements minus the sum ``μ`` of those
    probabilities is a martingale with increments in [-1, 1] and predictable variance ``v = Σ p(1 − p)``.
    Freedman's inequality bounds it for a variance level fixed in advance, so it is applied on the grid
    ``σ² = 1, 2, 4, …, 2^K ≥ draws/4`` (``K + 1`` levels, δ/(K + 1) each, both sides) at the first level
    ``≥ v``: ``|count − μ| ≤ c/3 + √(c²/9 + 2cσ²)``, ``c = ln(2(K + 1)/δ)``, δ = 1e-4. It checks the sampler's
    coupling (what the two decoders' logits make of one uniform), not how close the bf16 logits are: that is
    measured, and recorded with the rate a bf16 user sees between the two decoders.
    (The coupling bound ``Σ_i |c_i − c'_i|`` it replaces exceeded 1 per draw here: no test at all.)"""
    config = dict(SMALL, vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    lm = tiny_causal_lm("qwen2", **config).eval().to(CUDA)
    with torch.no_grad():
        lm.lm_head.weight.mul_(3.0 / (lm(torch.arange(10, device=CUDA)[None]).logits.std()))
    lm = lm.to(torch.bfloat16)
    ids, mask = left_padded_prompts(batch=64, width=16, vocab=1000)
    steps, width = 32, ids.shape[1]
    uniforms = sampling_uniforms(0, 1, ids.shape[0], steps).to(CUDA)
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    positions = position_ids_from_mask(mask)
    policy = Policy(lm, temperature=1.0, chunk_size=None)
    disagree, mean, variance = 0, 0.0, 0.0
    with torch.no_grad():
        reference, cache = policy(ids, mask, positions, None)
        decoder = StaticKVDecoder(policy, lm, steps, cuda_graphs=True)
        logits, state = decoder(ids, mask, positions, None)
        next_position = positions[:, -1:] + 1
        for t in range(steps):
            token = sample_tokens(reference, uniforms[:, t])
            disagree += int((sample_tokens(logits, uniforms[:, t]) != token).sum())
            p = draw_disagreement_probability(reference, logits)
            mean, variance = mean + float(p.sum()), variance + float((p * (1 - p)).sum())
            reference, cache = policy(token[:, None], full_mask[:, : width + t + 1], next_position, cache)
            logits, state = decoder(token[:, None], full_mask[:, : width + t + 1], next_position, state)
            next_position = next_position + 1
    draws = ids.shape[0] * steps
    levels = math.ceil(math.log2(draws / 4)) + 1  # σ² = 2^0 … 2^K, the last ≥ draws/4 ≥ v
    level = 2.0 ** max(0, math.ceil(math.log2(max(variance, 1.0))))
    c = math.log(2 * levels / 1e-4)
    allowed = c / 3 + math.sqrt(c * c / 9 + 2 * c * level)
    record(
        test="bf16_draw_disagreement",
        vocab=config["vocab_size"],
        draws=draws,
        disagreements=disagree,
        rate=disagree / draws,
        predicted_rate=mean / draws,
        allowed_deviation=allowed,
    )
    assert abs(disagree - mean) <= allowed, (disagree, mean, allowed)


# --------------------------------------------------------------------------- one-pass gradient norms on the GPU


def padded_batch(vocab: int, seed: int = 0):
    """Left and right padding, a hole, an empty response."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (5, 12), generator=generator)
    attention = torch.ones(5, 12, dtype=torch.long)
    response = torch.zeros(5, 12)
    response[0, 4:] = 1
    attention[1, :3] = 0
    response[1, 6:] = 1
    attention[2, 9:] = 0
    response[2, 2:9] = 1
    response[3, 5:] = 1
    response[3, 7:9] = 0
    return ids.to(CUDA), response.to(CUDA), attention.to(CUDA)


def log_likelihood(model, ids, response, attention, chunked: bool, temperature: float = 1.0, chunk_size=None):
    """``Σ_t m_t log π(y_t)`` per row through the model's head or the chunked one; the model's own mode (training
    mode: transformers checkpoints only then; the tiny models have no dropout)."""
    if chunked:
        hidden = model.get_decoder()(ids, attention_mask=attention, use_cache=False).last_hidden_state[:, :-1]
        log_probs = lm_head_log_probs(hidden, model.lm_head, ids[:, 1:], temperature, chunk_size)
    else:
        logits = model(ids, attention_mask=attention, use_cache=False).logits[:, :-1]
        z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
        log_probs = z.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (log_probs * response[:, 1:].to(log_probs.dtype)).sum(dim=1)


def checkpointed(model):
    """Non-reentrant activation checkpointing on, in training mode; a counter of the first layer MLP's forward calls
    (a recomputation shows as a second call per pass)."""
    enable_hf_activation_checkpointing(model)
    model.train()
    calls = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_f3_one_pass_norms_on_cuda_with_checkpointing_equal_per_row_gradients(tied, chunked):
    """float64 on the GPU, transformers' non-reentrant activation checkpointing, the model's head or the chunked
    one: every row's ||S_i||² equals a separate exact gradient per row. Tolerance 1e-6 relative: the float32 result
    (6e-8) and transformers' float32 islands in a float64 forward, as on CPU (tests/test_otb_ref/test_grad_norms.py)."""
    sizes = dict(vocab_size=37, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = tiny_causal_lm("qwen2", 5, **sizes, tie_word_embeddings=tied).double().to(CUDA)
    ids, response, attention = padded_batch(37)
    expected = exact_norms(model, ids, response, attention, temperature=0.8)
    calls = checkpointed(model)
    got = row_grad_norms_sq(model, lambda: log_likelihood(model, ids, response, attention, chunked, 0.8, 5))
    assert calls[0] == 2  # the forward and the backward's recomputation
    assert got.is_cuda and float(got[4]) == 0.0
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


def test_one_pass_norms_bf16_on_cuda_against_a_per_row_loop():
    """bf16 on the GPU, checkpointing and the chunked head (the half-precision ``bmm(out_dtype=float32)`` path): the
    one-pass norms against a loop of ordinary backward passes, one row each, in the same bf16 model. The two sum the
    same per-parameter gradients in different orders and roundings; the difference is recorded, and held to 5% (the
    0.5B benchmark's bf16 difference is 0.2%): a lost or doubled term moves a norm by far more."""
    sizes = dict(vocab_size=3000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=True)
    model = tiny_causal_lm("qwen2", 1, **sizes).to(CUDA, torch.bfloat16)
    ids, response, attention = padded_batch(3000, seed=2)
    calls = checkpointed(model)
    got = row_grad_norms_sq(model, lambda: log_likelihood(model, ids, response, attention, True, chunk_size=700))
    assert calls[0] == 2
    loop = []
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        log_likelihood(model, ids[i : i + 1], response[i : i + 1], attention[i : i + 1], False).sum().backward()
        loop.append(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    loop = torch.stack(loop)
    nonzero = loop > 0
    rel = ((got.double() - loop).abs()[nonzero] / loop[nonzero]).max().item()
    record(test="one_pass_bf16_vs_loop", max_rel_diff=rel)
    assert float(got[4]) == 0.0 and rel < 0.05
